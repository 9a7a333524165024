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
    """One tool invocation a model asked for. ``arguments_json`` is the model's raw JSON text.

    As a step records it (:func:`~dsh_mesh.core.recorded_step`), ``call_id`` is unique in its
    step and well formed; ``given_id`` is the id the model gave when the step records the call
    under another (``None``: ``call_id`` is the model's own); ``refused`` says why the call is
    never run (its arguments were too deep or too large to keep, and ``arguments_json`` is
    ``"{}"`` in their place), and is its result; ``""`` for a call that may run."""

    call_id: str
    name: str
    arguments_json: str
    given_id: str | None = None
    refused: str = ""


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
