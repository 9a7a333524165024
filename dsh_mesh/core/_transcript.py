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

from dsh_mesh.core._approval import ApprovalDecisionEntry, ApprovalRequestEntry
from dsh_mesh.core._chat import ChatMessage, ToolCall, Usage
from dsh_mesh.core._delivery import DeliveryKind
from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._header import SessionKind
from dsh_mesh.core._ids import ActivationId, NodeId, SessionId, TurnId
from dsh_mesh.core._source import AgentMessageSource, SettlementOutcome
from dsh_mesh.core._text import ValidText, bounded_quote

# W3C Trace Context, version 00: lowercase hex only; an all-zero trace or span id is invalid.
_TRACEPARENT: Final = re.compile(r"00-(?P<trace>[0-9a-f]{32})-(?P<span>[0-9a-f]{16})-[0-9a-f]{2}")


def _is_traceparent(text: str) -> bool:
    """Whether ``text`` is a well-formed W3C ``traceparent`` (version ``00``)."""
    match = _TRACEPARENT.fullmatch(text)
    return match is not None and match["trace"] != "0" * 32 and match["span"] != "0" * 16


def _check_trace(trace: str) -> None:
    if trace and not _is_traceparent(trace):
        raise InvalidArgument(f"trace {bounded_quote(trace)} is not a W3C traceparent")


class TurnOutcome(enum.Enum):
    """How one turn ended."""

    COMPLETED = "completed"
    ERROR = "error"
    CANCELLED = "cancelled"
    TOKEN_EXHAUSTION = "token-exhaustion"
    LOST = "lost"
    """The turn's host stopped before the turn ended; written by the session's next activation
    after it answered every call of the turn's last step (docs/adr/0007)."""
    AWAITING_APPROVAL = "awaiting-approval"
    """The turn stopped at a call that waits for a person's decision (docs/approvals.md): that
    call and the ones after it in its step have no result yet. The decision starts the turn
    that goes on from there. Not an end of the agent's run: it settles nothing."""


@dataclass(frozen=True, kw_only=True)
class TaskEntry(ValidText):
    """A child's initial user task (manager-written), including any return instruction."""

    _PROSE = frozenset({"content"})

    content: str


@dataclass(frozen=True, kw_only=True)
class HumanPromptEntry(ValidText):
    """A human prompt, delivered by Queue: it always starts a turn of its own.

    ``idempotency_key`` is the key the prompt was submitted with (``""`` when none was given,
    or for an entry written before the field existed); retries are matched by the store's
    idempotency record, not by this copy, which is there for readers of the transcript."""

    _PROSE = frozenset({"content"})

    content: str
    idempotency_key: str = ""


@dataclass(frozen=True, kw_only=True)
class AgentMessageEntry(ValidText):
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

    _PROSE = frozenset({"content"})

    source: AgentMessageSource
    content: str
    trace: str = ""
    delivery: DeliveryKind | None = None
    idempotency_key: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_trace(self.trace)


@dataclass(frozen=True, kw_only=True)
class SettlementNoticeEntry(ValidText):
    """The manager-owned ``subagent-settled`` notice: how a child's Activation ended.

    ``trace`` is the W3C ``traceparent`` (``00-<32 hex trace id>-<16 hex span id>-<2 hex
    flags>``) of the child's final turn span, or ``""`` when none was recorded (tracing off, or a
    ``lost`` notice written for a child that could not cooperate). It is observability data only:
    it never changes delivery, ordering, authorization or rendering. Raises
    :class:`InvalidArgument` for a non-empty malformed ``trace``.
    """

    _PROSE = frozenset({"terminal_output", "detail"})

    child_session: SessionId
    child_activation: ActivationId
    child_kind: SessionKind
    outcome: SettlementOutcome
    terminal_output: str
    detail: str = ""
    trace: str = ""
    output_json: str = ""
    """The child's answer as its output schema's JSON value (canonical JSON), when its session
    names a schema and its last turn completed with an answer that matched; ``""`` otherwise
    (ADR 0052)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_trace(self.trace)


@dataclass(frozen=True, kw_only=True)
class ForkPrefixEntry:
    """A fork child's inherited completed-turn prefix, exactly as its parent rendered it."""

    messages: tuple[ChatMessage, ...]


_UNRECORDED_NODE: Final = NodeId("")
_UNRECORDED_ACTIVATION: Final = ActivationId("")


@dataclass(frozen=True, kw_only=True)
class TurnStartedEntry(ValidText):
    """A turn began: everything until the matching `TurnEndedEntry` belongs to it.

    ``node_id`` and ``activation_id`` say where the turn ran: the node hosting the activation
    that wrote this entry (fenced writes: only the session's current activation can). Both are
    ``""`` on an entry written before the fields existed. ``trace`` is the W3C ``traceparent``
    of the turn's span (its steps and tool calls are spans of the same trace); ``""`` when
    tracing is off or for an entry written before the field existed. Raises
    :class:`InvalidArgument` for a non-empty malformed ``trace``."""

    turn_id: TurnId
    node_id: NodeId = _UNRECORDED_NODE
    activation_id: ActivationId = _UNRECORDED_ACTIVATION
    trace: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_trace(self.trace)


@dataclass(frozen=True, kw_only=True)
class ConsumedEntry:
    """Inbound entries (by seq, in FIFO order) shown to the model at this step boundary."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AssistantStepEntry(ValidText):
    """One model call's answer: text and the tool calls it asked for."""

    _PROSE = frozenset({"text"})

    text: str
    tool_calls: tuple[ToolCall, ...]
    usage: Usage


@dataclass(frozen=True, kw_only=True)
class ToolResultEntry(ValidText):
    """The recorded result of one tool call, keyed by the call id the model gave it.

    ``duration_ms`` is how long the call ran on its node, rounded up (so at least 1 for a call
    that ran; 0: it did not run there, e.g. an answer "outcome unknown" or "not run"); it is
    not part of the entry's identity."""

    _PROSE = frozenset({"content"})

    call_id: str
    name: str
    content: str
    is_error: bool = False
    duration_ms: int = field(default=0, compare=False)


@dataclass(frozen=True, kw_only=True)
class CompactionEntry(ValidText):
    """The agent's context was compacted: from here on the model sees ``summary`` in place of
    every entry up to ``through_seq`` (docs/context.md).

    ``from_seq`` is the first seq the summary covers directly: 1, or the first after the range
    of the compaction it replaces (whose summary it covers in turn). What the contract keeps
    verbatim is never summarised away:

    - ``task``: the session's initial task (a child's includes its parent's id and the return
      instruction; a root's is its first prompt; ``""`` for a session with none); the model
      sees it before the summary;
    - ``pending``: the seqs in the range of inbound entries no step had read yet; each is still
      shown where a later :class:`ConsumedEntry` names it, exactly as without compaction;
    - ``open_turn``: the start of the turn in progress when it was written (``None`` between
      turns), so a resume knows that turn without reading the range.

    ``usage`` is that of the model call that wrote the summary, with ``model``'s name. Written
    only by the agent, at a step boundary, where every call of the range has its result."""

    _PROSE = frozenset({"summary", "task"})

    summary: str
    from_seq: int
    through_seq: int
    task: str = ""
    pending: tuple[int, ...] = ()
    open_turn: TurnStartedEntry | None = None
    model: str = ""
    usage: Usage = field(default_factory=Usage)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.from_seq <= self.through_seq:
            raise InvalidArgument(
                f"a compaction covers seqs {self.from_seq}..{self.through_seq}: not a range"
            )
        if any(not 1 <= seq <= self.through_seq for seq in self.pending):
            raise InvalidArgument("a compaction's pending seqs lie outside what it covers")


@dataclass(frozen=True, kw_only=True)
class ToolOutputsClearedEntry:
    """The outputs of the tool results at ``seqs`` were cleared from the model's context: each
    is shown from here on as a short stub naming the call, its size and how to get it again.
    The results themselves stay in the transcript, whole. Cheaper than a compaction, and tried
    first (docs/context.md)."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class TurnEndedEntry(ValidText):
    """A turn ended, with its outcome (completed, error, cancelled, token exhaustion) and detail."""

    _PROSE = frozenset({"detail"})

    turn_id: TurnId
    outcome: TurnOutcome
    detail: str = ""
    output_json: str = ""
    """The turn's answer as its session's output schema's JSON value (canonical JSON), when the
    session names a schema and the turn completed; ``""`` otherwise (ADR 0052)."""


@dataclass(frozen=True, kw_only=True)
class AnswerRejectedEntry(ValidText):
    """The final answer of the step before did not match its session's output schema
    (``schema``, canonical JSON): ``reason`` says why. The model sees both, as a correction
    that asks again (:func:`~dsh_mesh.core.frame_answer_rejected`, ADR 0052)."""

    _PROSE = frozenset({"reason"})

    reason: str
    schema: str


InboundEntry = (
    TaskEntry | HumanPromptEntry | AgentMessageEntry | SettlementNoticeEntry | ApprovalDecisionEntry
)
SteerEntry = TaskEntry | AgentMessageEntry | SettlementNoticeEntry | ApprovalDecisionEntry
Entry = (
    InboundEntry
    | ForkPrefixEntry
    | TurnStartedEntry
    | ConsumedEntry
    | AssistantStepEntry
    | ToolResultEntry
    | TurnEndedEntry
    | AnswerRejectedEntry
    | CompactionEntry
    | ToolOutputsClearedEntry
    | ApprovalRequestEntry
)

INBOUND_TYPES = (
    TaskEntry,
    HumanPromptEntry,
    AgentMessageEntry,
    SettlementNoticeEntry,
    ApprovalDecisionEntry,
)


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


def pending_inbound(records: Sequence[Record], *, through: int | None = None) -> list[Record]:
    """Inbound records no ``ConsumedEntry`` has delivered yet, in acceptance order; with
    ``through``, those up to that seq that none up to it delivered. ``records`` may be a
    session's context (:func:`context_of`): the inbound entries a compaction kept pending are
    among them."""
    upto = [r for r in records if through is None or r.seq <= through]
    consumed: set[int] = set()
    for record in upto:
        if isinstance(record.entry, ConsumedEntry):
            consumed.update(record.entry.seqs)
    return [r for r in upto if isinstance(r.entry, INBOUND_TYPES) and r.seq not in consumed]


def unended_turn(records: Sequence[Record]) -> TurnStartedEntry | None:
    """The start of the transcript's last turn if that turn never ended (its host stopped during
    it), else None."""
    for record in reversed(records):
        if isinstance(record.entry, TurnEndedEntry):
            return None
        if isinstance(record.entry, TurnStartedEntry):
            return record.entry
        if isinstance(record.entry, CompactionEntry):
            return record.entry.open_turn
    return None


def latest_compaction(records: Sequence[Record]) -> Record | None:
    """The record of the last :class:`CompactionEntry` among ``records``, if any."""
    for record in reversed(records):
        if isinstance(record.entry, CompactionEntry):
            return record
    return None


def context_of(records: Sequence[Record]) -> list[Record]:
    """What an agent needs of a transcript (``records`` in seq order, whole or from any point
    at or before its latest compaction's range): with no compaction, all of it; else the
    records that compaction kept pending, then every record after its range. Rendering it
    gives the same conversation as rendering the whole transcript."""
    latest = latest_compaction(records)
    if latest is None:
        return list(records)
    assert isinstance(latest.entry, CompactionEntry)
    kept = set(latest.entry.pending)
    through = latest.entry.through_seq
    return [r for r in records if r.seq > through or r.seq in kept]
