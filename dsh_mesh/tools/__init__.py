"""Tools: the registry, presets, the standard ``send_message`` and the spawn tools, Python tools
(:func:`tool`) and the limits every user tool call runs under."""

from dsh_mesh.tools._function import FunctionTool, ToolContext, tool
from dsh_mesh.tools._guard import CallLimits, cut, limits_of, run_limited
from dsh_mesh.tools._instructions import RETURN_INSTRUCTION, child_task
from dsh_mesh.tools._registry import (
    ApprovalPolicy,
    ContextPolicy,
    DescriptorFilter,
    Preset,
    ToolRegistry,
    ToolSet,
    ToolSource,
    TurnLimits,
)
from dsh_mesh.tools._runtime import ChildKind, SubagentRuntime
from dsh_mesh.tools._standard import (
    MAX_MESSAGE_CHARS,
    SEND_MESSAGE,
    SEND_MESSAGE_DESCRIPTOR,
    SEND_MESSAGE_IDENTITY,
    SPAWN_DESCRIPTORS,
    SendMessageTool,
    SpawnTool,
    is_standard_send_message,
    standard_tools,
)
from dsh_mesh.tools._tool import (
    Heartbeat,
    Replay,
    Tool,
    ToolIdentity,
    ToolInvocation,
    ToolOutput,
    canonical_name,
    is_idempotent_by_key,
    is_standard_tool,
    outcome_unknown,
    replay_of,
)

__all__ = [
    "MAX_MESSAGE_CHARS",
    "RETURN_INSTRUCTION",
    "SEND_MESSAGE",
    "SEND_MESSAGE_DESCRIPTOR",
    "SEND_MESSAGE_IDENTITY",
    "SPAWN_DESCRIPTORS",
    "ApprovalPolicy",
    "CallLimits",
    "ChildKind",
    "ContextPolicy",
    "DescriptorFilter",
    "FunctionTool",
    "Heartbeat",
    "Preset",
    "Replay",
    "SendMessageTool",
    "SpawnTool",
    "SubagentRuntime",
    "Tool",
    "ToolContext",
    "ToolIdentity",
    "ToolInvocation",
    "ToolOutput",
    "ToolRegistry",
    "ToolSet",
    "ToolSource",
    "TurnLimits",
    "canonical_name",
    "child_task",
    "cut",
    "is_idempotent_by_key",
    "is_standard_send_message",
    "is_standard_tool",
    "limits_of",
    "outcome_unknown",
    "replay_of",
    "run_limited",
    "standard_tools",
    "tool",
]
