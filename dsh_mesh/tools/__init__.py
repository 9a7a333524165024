"""Tools: the registry, presets, the standard ``send_message`` and the spawn tools."""

from dsh_mesh.tools._instructions import RETURN_INSTRUCTION, child_task
from dsh_mesh.tools._registry import DescriptorFilter, Preset, ToolRegistry, ToolSet, TurnLimits
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
    Tool,
    ToolIdentity,
    ToolInvocation,
    ToolOutput,
    is_idempotent_by_key,
    outcome_unknown,
)

__all__ = [
    "MAX_MESSAGE_CHARS",
    "RETURN_INSTRUCTION",
    "SEND_MESSAGE",
    "SEND_MESSAGE_DESCRIPTOR",
    "SEND_MESSAGE_IDENTITY",
    "SPAWN_DESCRIPTORS",
    "ChildKind",
    "DescriptorFilter",
    "Preset",
    "SendMessageTool",
    "SpawnTool",
    "SubagentRuntime",
    "Tool",
    "ToolIdentity",
    "ToolInvocation",
    "ToolOutput",
    "ToolRegistry",
    "ToolSet",
    "TurnLimits",
    "child_task",
    "is_idempotent_by_key",
    "is_standard_send_message",
    "outcome_unknown",
    "standard_tools",
]
