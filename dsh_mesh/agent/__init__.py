"""The agent loop: inbox, turns, steps, Steer and Queue delivery, interrupt, settlement."""

from dsh_mesh.agent._agent import Agent, AgentHost, AgentState, Settlement
from dsh_mesh.agent._inbox import Inbox
from dsh_mesh.agent._render import completed_turn_prefix, render, render_inbound

__all__ = [
    "Agent",
    "AgentHost",
    "AgentState",
    "Inbox",
    "Settlement",
    "completed_turn_prefix",
    "render",
    "render_inbound",
]
