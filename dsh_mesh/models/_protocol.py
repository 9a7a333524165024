"""The one small protocol every model provider implements.

Providers stream events so a later provider can forward tokens as they arrive; the agent loop
collects them into one :class:`ModelResponse` per step.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsh_mesh.core import ChatMessage, SessionId, ToolCall, ToolDescriptor, Usage


class CallPurpose(enum.Enum):
    """What a model call is for: a step of a turn, or writing the summary of a compaction
    (docs/context.md). A compaction's request has the same head and conversation as a step's,
    then asks for the summary; a provider must not let it call tools."""

    STEP = "step"
    COMPACTION = "compaction"


@dataclass(frozen=True, kw_only=True)
class ModelRequest:
    """Everything one model call sees. ``system_prompt`` and ``tools`` form the request head
    that provider prompt caches key on; they depend only on the session's spec, never its kind."""

    session_id: SessionId
    model: str
    system_prompt: str
    tools: tuple[ToolDescriptor, ...]
    messages: tuple[ChatMessage, ...]
    max_output_tokens: int | None = None
    """The most tokens one call may generate (the preset's limit); ``None``: the provider's."""
    purpose: CallPurpose = CallPurpose.STEP
    output_schema: str = ""
    """The JSON schema (canonical JSON) a final answer must match, ``""`` for none: a provider
    with a structured-output mode asks for it (ADR 0052). Never set on a compaction's request.
    The agent checks the answer either way."""
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Scratch space its caller keeps for the calls of one turn (the same dict for each): a
    provider may keep there what it derives from ``messages`` alone (their wire encoding,
    keyed by message), so a step encodes only the messages no earlier step of the turn had.
    Never part of the call; dropped with the turn."""


class FinishReason(enum.Enum):
    """Why a model call stopped: a final answer, tool calls to run, or the token limit."""

    STOP = "stop"
    TOOL_CALLS = "tool-calls"
    LENGTH = "length"
    """The provider stopped because the token budget ran out."""


@dataclass(frozen=True, kw_only=True)
class TextDelta:
    """A streamed piece of the assistant's text."""

    text: str


@dataclass(frozen=True, kw_only=True)
class ToolCallEvent:
    """A complete tool call the model asked for, streamed as soon as it is whole."""

    call: ToolCall


@dataclass(frozen=True, kw_only=True)
class Finished:
    """The last event of a streamed model call: why it stopped and the usage it reports."""

    finish_reason: FinishReason
    usage: Usage


ModelEvent = TextDelta | ToolCallEvent | Finished


@dataclass(frozen=True, kw_only=True)
class ModelResponse:
    """A whole model call, collected from its stream: text, tool calls, finish reason, usage."""

    text: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    usage: Usage


class ModelProvider(Protocol):
    """Streams one model call. Must end with exactly one :class:`Finished` event.

    Raising any exception fails the step (the turn ends with outcome ``error``). Cancellation of
    the consuming task must propagate: a provider never swallows ``CancelledError``.
    """

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]: ...


async def complete(
    provider: ModelProvider,
    request: ModelRequest,
    on_text: Callable[[str], None] | None = None,
) -> ModelResponse:
    """Run one call to completion and collect its events. ``on_text`` is called with each
    :class:`TextDelta`'s text as it arrives (synchronously: it must not block)."""
    text: list[str] = []
    calls: list[ToolCall] = []
    finished: Finished | None = None
    async for event in provider.stream(request):
        if finished is not None:
            raise ProtocolViolation("a provider sent events after Finished")
        if isinstance(event, TextDelta):
            text.append(event.text)
            if on_text is not None:
                on_text(event.text)
        elif isinstance(event, ToolCallEvent):
            calls.append(event.call)
        else:
            finished = event
    if finished is None:
        raise ProtocolViolation("a provider stream ended without Finished")
    return ModelResponse(
        text="".join(text),
        tool_calls=tuple(calls),
        finish_reason=finished.finish_reason,
        usage=finished.usage,
    )


class ProtocolViolation(Exception):
    """A provider broke the streaming protocol."""


class ProviderError(Exception):
    """A model call failed at its provider, for good: a refusal no retry can change (bad
    request, bad key), or a failure that outlasted the retry budget. The turn ends with outcome
    ``error``; the message is the provider's own, so the settlement shows it."""

    def __init__(self, message: str, *, status: int | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.attempts = attempts
