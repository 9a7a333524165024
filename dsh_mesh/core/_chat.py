"""Provider-neutral chat messages: what an agent sends to a model and what it gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dsh_mesh.core._text import ValidText


class Role(enum.Enum):
    """The speaker of one chat message sent to a provider."""

    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, kw_only=True)
class ToolCall(ValidText):
    """One tool invocation a model asked for. ``arguments_json`` is the model's raw JSON text."""

    call_id: str
    name: str
    arguments_json: str


@dataclass(frozen=True, kw_only=True)
class Usage:
    """Token figures a provider reported for one model call (zero where it reports none)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class ChatMessage(ValidText):
    """One message of a model request, after the transcript has been rendered."""

    _PROSE = frozenset({"content"})

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
