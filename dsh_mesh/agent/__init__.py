"""The agent loop: inbox, turns, steps, Steer and Queue delivery, interrupt, settlement."""

from dsh_mesh.agent._agent import Agent, AgentHost, AgentState
from dsh_mesh.agent._answer_check import AnswerChecker
from dsh_mesh.agent._context import SUMMARY_INSTRUCTION
from dsh_mesh.agent._inbox import Inbox
from dsh_mesh.agent._render import (
    SUMMARY_FRAME,
    cleared_stub,
    completed_turn_prefix,
    frame_summary,
    render,
    render_inbound,
)
from dsh_mesh.agent._settlement import Settlement, settlement_outcome

__all__ = [
    "SUMMARY_FRAME",
    "SUMMARY_INSTRUCTION",
    "Agent",
    "AgentHost",
    "AgentState",
    "AnswerChecker",
    "Inbox",
    "Settlement",
    "cleared_stub",
    "completed_turn_prefix",
    "frame_summary",
    "render",
    "render_inbound",
    "settlement_outcome",
]
