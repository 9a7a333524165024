"""What a tool is, and how the standard ones are told apart from same-name look-alikes."""

from __future__ import annotations

import enum
import hashlib
import json
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol, final

from dsh_mesh.core import AbortSignal, AgentRef, ToolCall, ToolDescriptor


@final
class ToolIdentity:
    """A process-stable identity compared by ``is``: two tools with the same name and schema but
    different identities are different tools. Only the standard definitions hold the standard
    identities; a scoped tool that reuses a name gets an identity of its own."""

    __slots__ = ("_label",)

    def __init__(self, label: str) -> None:
        self._label = label

    def __repr__(self) -> str:
        return f"ToolIdentity({self._label!r})"


class Replay(enum.Enum):
    """Whether a call a stopped host left without a result may be run again.

    ``SAFE``: the tool's effect is idempotent under the call's idempotency key (it finds what
    an earlier run under that key did, or has no effect worth keeping once), so the resume runs
    the call again under the same key. ``UNSAFE`` (the default of every user tool): the resume
    answers the call "outcome unknown" and never runs it a second time."""

    SAFE = "safe"
    UNSAFE = "unsafe"


@final
class Heartbeat:
    """The last sign of life of one running call. A tool calls :meth:`beat` when it makes
    progress (an MCP progress notification does it for MCP tools); the call's idle limit runs
    from the last beat. Safe to call from any thread."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = time.monotonic()

    def beat(self) -> None:
        self.last = time.monotonic()  # one store: atomic for the reader on the loop


_CALL_ID_IN_KEY = 200
"""The longest call id a call's idempotency key holds as it is: with a step's seq and an index
(at most 20 digits each) the key stays within ``MAX_KEY_CHARS`` (256)."""


@dataclass(frozen=True, kw_only=True)
class ToolInvocation:
    """One call of a tool by one agent: who calls (its exact live ref), the call, the signal,
    and where the call stands in the caller's transcript: ``step_seq`` is the seq of the
    assistant step that asked for it, ``index`` its place among that step's calls.

    ``heartbeat`` is the call's own (see :class:`Heartbeat`); ``executor`` runs a blocking
    tool's function (None: the event loop's default executor)."""

    caller: AgentRef
    call: ToolCall
    signal: AbortSignal
    step_seq: int = 0
    index: int = 0
    heartbeat: Heartbeat = field(default_factory=Heartbeat, compare=False)
    executor: Executor | None = field(default=None, compare=False)

    @property
    def idempotency_key(self) -> str:
        """A key no other call of the caller's session shares: the step's seq and the call's
        place in it (a model may reuse call ids across steps), plus the model's call id, or
        its SHA-256 when it is longer than :data:`_CALL_ID_IN_KEY` characters, so that the
        key always fits the wire's bound on keys (``MAX_KEY_CHARS``). A real provider's call
        ids are far shorter: their keys are what they always were."""
        call_id = self.call.call_id
        if len(call_id) > _CALL_ID_IN_KEY:
            call_id = "sha256:" + hashlib.sha256(call_id.encode("utf-8", "replace")).hexdigest()
        return f"{self.step_seq}.{self.index}.{call_id}"


@dataclass(frozen=True, kw_only=True)
class ToolOutput:
    """What is recorded as the tool's result and shown to the model."""

    content: str
    is_error: bool = False


class Tool(Protocol):
    """A tool an agent may call. ``invoke`` must not raise for bad model input: it returns an
    error output instead, so the step can record a result for every call."""

    @property
    def identity(self) -> ToolIdentity: ...

    @property
    def descriptor(self) -> ToolDescriptor: ...

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput: ...


def is_standard_tool(tool: object) -> bool:
    """Whether ``tool`` is a standard tool (``send_message``, ``spawn_agent``...): its call is
    answered exactly from durable state and never abandoned half-way (an interrupt lets it
    find its own answer), and it never waits for approval. A user tool's call runs under its
    limits and is cancelled by an interrupt."""
    return getattr(tool, "idempotent_by_key", False) is True


def is_idempotent_by_key(tool: Tool) -> bool:
    """Whether a call of ``tool`` may be carried out again under its idempotency key with one
    effect at most: the standard tools (their class says ``idempotent_by_key = True``) and a
    user tool declared ``replay = Replay.SAFE``. A call that a stopped host left without a
    result is then answered by carrying it out again under the same key: the repeat finds what
    the first try did, or does it now. Any other tool's call is answered by
    :func:`outcome_unknown`, never run a second time."""
    return getattr(tool, "idempotent_by_key", False) is True or replay_of(tool) is Replay.SAFE


def canonical_name(tool: Tool) -> str:
    """The name a preset's ``approve_tools`` patterns match (docs/approvals.md): a tool that
    declares a ``canonical_name`` (an MCP tool: ``mcp:<server>/<tool>``, the spelling a preset's
    ``tools`` selects it by) is known by it; any other tool by its descriptor's name (a Python
    tool's own name). Never the model-visible ``<server>__<tool>`` of an MCP tool."""
    declared = getattr(tool, "canonical_name", None)
    return declared if isinstance(declared, str) else tool.descriptor.name


def replay_of(tool: Tool) -> Replay:
    """What ``tool`` declares (``replay``); a tool that declares nothing is unsafe to re-run."""
    replay = getattr(tool, "replay", Replay.UNSAFE)
    return replay if isinstance(replay, Replay) else Replay.UNSAFE


def outcome_unknown(call: ToolCall) -> ToolOutput:
    """The answer to a call of a tool that is not idempotent by key, left without a result by
    a host that stopped while the call ran: it may or may not have taken effect."""
    return ToolOutput(
        content=json.dumps(
            {
                "outcome": "unknown",
                "tool": call.name,
                "detail": "the host running this call stopped before it returned, so it may or"
                " may not have taken effect; it was not run again. Check its effect before"
                " calling it again.",
            }
        ),
        is_error=True,
    )
