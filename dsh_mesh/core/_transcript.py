"""The entries of a session's durable, append-only transcript.

Inbound entries (task, human prompt, agent message, settlement notice) are written when they are
*accepted*; a later :class:`ConsumedEntry` records the step boundary at which the model was shown
them. Rendering places inbound content at its ``Consumed`` point, so every tool call in a rendered
conversation has its result before any steered message, and an accepted message that no turn has
consumed yet is still pending on the next activation.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from dsh_mesh.core._chat import ChatMessage, ToolCall, Usage
from dsh_mesh.core._delivery import DeliveryKind
from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._header import SessionKind
from dsh_mesh.core._ids import ActivationId, NodeId, SessionId, TurnId
from dsh_mesh.core._source import AgentMessageSource, SettlementOutcome

# W3C Trace Context, version 00: lowercase hex only; an all-zero trace or span id is invalid.
_TRACEPARENT: Final = re.compile(r"00-(?P<trace>[0-9a-f]{32})-(?P<span>[0-9a-f]{16})-[0-9a-f]{2}")


def _is_traceparent(text: str) -> bool:
    """Whether ``text`` is a well-formed W3C ``traceparent`` (version ``00``)."""
    match = _TRACEPARENT.fullmatch(text)
    return match is not None and match["trace"] != "0" * 32 and match["span"] != "0" * 16


def _check_trace(trace: str) -> None:
    if trace and not _is_traceparent(trace):
        raise InvalidArgument(f"trace {trace!r} is not a W3C traceparent")


class TurnOutcome(enum.Enum):
    """How one turn ended."""

    COMPLETED = "completed"
    ERROR = "error"
    CANCELLED = "cancelled"
    TOKEN_EXHAUSTION = "token-exhaustion"
    LOST = "lost"
    """The turn's host stopped before the turn ended; written by the session's next activation
    after it answered every call of the turn's last step (docs/adr/0007)."""


@dataclass(frozen=True, kw_only=True)
class TaskEntry:
    """A child's initial user task (manager-written), including any return instruction."""

    content: str


@dataclass(frozen=True, kw_only=True)
class HumanPromptEntry:
    """A human prompt, delivered by Queue: it always starts a turn of its own.

    ``idempotency_key`` is the key the prompt was submitted with (``""`` when none was given,
    or for an entry written before the field existed); retries are matched by the store's
    idempotency record, not by this copy, which is there for readers of the transcript."""

    content: str
    idempotency_key: str = ""


@dataclass(frozen=True, kw_only=True)
class AgentMessageEntry:
    """An accepted agent message. ``source`` is derived from the authorized sender.

    ``trace`` is the W3C ``traceparent`` (``00-<32 hex trace id>-<16 hex span id>-<2 hex
    flags>``) of the sender's span, stored with the message so the step that consumes it, even
    after a cold resume on another host, can link to it; ``""`` when none was recorded (tracing
    off). It is observability data only: it never changes delivery, ordering, authorization or
    rendering. Raises :class:`InvalidArgument` for a non-empty malformed ``trace``.

    ``delivery`` is how the message was delivered when it was accepted (steered into a running
    turn, started a turn, or cold-resumed its target), so watchers of the session can see it;
    ``None`` for entries written before this field existed. Like ``trace`` it is observability
    data only: it never changes rendering, ordering or authorization.

    ``idempotency_key`` is the key the sender's node sent it with (``""`` when none, or for an
    entry written before the field existed). Retries are matched by the store's idempotency
    record, not by this copy, which is there for readers of the transcript.
    """

    source: AgentMessageSource
    content: str
    trace: str = ""
    delivery: DeliveryKind | None = None
    idempotency_key: str = ""

    def __post_init__(self) -> None:
        _check_trace(self.trace)


@dataclass(frozen=True, kw_only=True)
class SettlementNoticeEntry:
    """The manager-owned ``subagent-settled`` notice: how a child's Activation ended.

    ``trace`` is the W3C ``traceparent`` (``00-<32 hex trace id>-<16 hex span id>-<2 hex
    flags>``) of the child's final turn span, or ``""`` when none was recorded (tracing off, or a
    ``lost`` notice written for a child that could not cooperate). It is observability data only:
    it never changes delivery, ordering, authorization or rendering. Raises
    :class:`InvalidArgument` for a non-empty malformed ``trace``.
    """

    child_session: SessionId
    child_activation: ActivationId
    child_kind: SessionKind
    outcome: SettlementOutcome
    terminal_output: str
    detail: str = ""
    trace: str = ""

    def __post_init__(self) -> None:
        _check_trace(self.trace)


@dataclass(frozen=True, kw_only=True)
class ForkPrefixEntry:
    """A fork child's inherited completed-turn prefix, exactly as its parent rendered it."""

    messages: tuple[ChatMessage, ...]


_UNRECORDED_NODE: Final = NodeId("")
_UNRECORDED_ACTIVATION: Final = ActivationId("")


@dataclass(frozen=True, kw_only=True)
class TurnStartedEntry:
    """A turn began: everything until the matching `TurnEndedEntry` belongs to it.

    ``node_id`` and ``activation_id`` say where the turn ran: the node hosting the activation
    that wrote this entry (fenced writes: only the session's current activation can). Both are
    ``""`` on an entry written before the fields existed."""

    turn_id: TurnId
    node_id: NodeId = _UNRECORDED_NODE
    activation_id: ActivationId = _UNRECORDED_ACTIVATION


@dataclass(frozen=True, kw_only=True)
class ConsumedEntry:
    """Inbound entries (by seq, in FIFO order) shown to the model at this step boundary."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AssistantStepEntry:
    """One model call's answer: text and the tool calls it asked for."""

    text: str
    tool_calls: tuple[ToolCall, ...]
    usage: Usage


@dataclass(frozen=True, kw_only=True)
class ToolResultEntry:
    """The recorded result of one tool call, keyed by the call id the model gave it.

    ``duration_ms`` is how long the call ran on its node (0: it did not run there, e.g. an
    answer "outcome unknown" or "not run"); it is not part of the entry's identity."""

    call_id: str
    name: str
    content: str
    is_error: bool = False
    duration_ms: int = field(default=0, compare=False)


@dataclass(frozen=True, kw_only=True)
class TurnEndedEntry:
    """A turn ended, with its outcome (completed, error, cancelled, token exhaustion) and detail."""

    turn_id: TurnId
    outcome: TurnOutcome
    detail: str = ""


InboundEntry = TaskEntry | HumanPromptEntry | AgentMessageEntry | SettlementNoticeEntry
SteerEntry = TaskEntry | AgentMessageEntry | SettlementNoticeEntry
Entry = (
    InboundEntry
    | ForkPrefixEntry
    | TurnStartedEntry
    | ConsumedEntry
    | AssistantStepEntry
    | ToolResultEntry
    | TurnEndedEntry
)

INBOUND_TYPES = (TaskEntry, HumanPromptEntry, AgentMessageEntry, SettlementNoticeEntry)


@dataclass(frozen=True, kw_only=True)
class Record:
    """An entry as stored: ``seq`` is the session's own strictly increasing sequence (from 1).

    ``recorded_at`` is when the store wrote it (UTC, by the writing node's clock); ``None``
    for a record not read back from a store that keeps it, or written before it did. It is not
    part of the record's identity: two records that differ only in it are equal."""

    seq: int
    entry: Entry
    recorded_at: datetime | None = field(default=None, compare=False)


def is_queue_delivery(entry: InboundEntry) -> bool:
    """Human prompts go by Queue (one turn each); everything else inbound goes by Steer."""
    return isinstance(entry, HumanPromptEntry)


def pending_inbound(records: Sequence[Record]) -> list[Record]:
    """Inbound records no ``ConsumedEntry`` has delivered yet, in acceptance order."""
    consumed: set[int] = set()
    for record in records:
        if isinstance(record.entry, ConsumedEntry):
            consumed.update(record.entry.seqs)
    return [r for r in records if isinstance(r.entry, INBOUND_TYPES) and r.seq not in consumed]


def unended_turn(records: Sequence[Record]) -> TurnStartedEntry | None:
    """The start of the transcript's last turn if that turn never ended (its host stopped during
    it), else None."""
    for record in reversed(records):
        if isinstance(record.entry, TurnEndedEntry):
            return None
        if isinstance(record.entry, TurnStartedEntry):
            return record.entry
    return None
