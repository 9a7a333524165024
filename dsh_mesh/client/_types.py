"""What a :class:`~dsh_mesh.client.MeshClient` returns: frozen dataclasses that mirror the
``dsh.mesh.v1`` control-plane messages, so a caller never touches a ``*_pb2`` message.

They reuse the core vocabulary where the wire means exactly the same thing (ids, activations,
tool descriptors, session kinds, outcomes, delivery kinds, tool calls, usage and a session's usage
summary). Wherever the proto
says "UNSPECIFIED: treat as unknown", the field here is ``None``: a value sent by a newer server
that this client does not know yet is never guessed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime

from dsh_mesh.core import (
    Activation,
    ActivationId,
    ApprovalDecision,
    ChatMessage,
    Cost,
    DeliveryKind,
    ForkOrigin,
    NodeId,
    SessionId,
    SessionKind,
    SessionUsage,
    SettlementOutcome,
    ToolCall,
    ToolDescriptor,
    TurnId,
    TurnOutcome,
    Usage,
)


class AgentState(enum.Enum):
    """The live state of a session when it was read (``dsh.mesh.v1.AgentState``)."""

    IDLE = "idle"
    """Resident with no turn running: a message or prompt starts a turn."""
    RUNNING = "running"
    """Resident with a turn running: agent messages are steered in at the next step boundary."""
    ABSENT = "absent"
    """No live activation: an authorized message (or a prompt) activates it first."""
    RESIDENT = "resident"
    """Resident on another node than the one that answered a listing (``GetSession``, which
    asks the host, says idle or running)."""


@dataclass(frozen=True, kw_only=True)
class StoreHealth:
    """What a node says of its log store (``MeshClient.log_store_health``)."""

    status: HealthStatus
    """``SERVING`` while the store accepts; ``NOT_SERVING`` while it refuses."""
    degraded: str | None
    """Why the store counts as refusing: its last refusal's reason and words (``None``: it
    accepts)."""


class HealthStatus(enum.Enum):
    """A node's answer to ``grpc.health.v1.Health/Check`` for the server as a whole."""

    SERVING = "SERVING"
    """The node holds its lease, is registered and runs its manager."""
    NOT_SERVING = "NOT_SERVING"
    """Starting, fenced after a lost lease, or draining."""
    UNKNOWN = "UNKNOWN"
    """The node answered with a status this client does not know."""
    SERVICE_UNKNOWN = "SERVICE_UNKNOWN"
    """The node does not know the service name asked for."""


@dataclass(frozen=True, kw_only=True)
class RootSession:
    """A root session created by ``CreateRootSession`` (or found again by a retry with the same
    ``request_id``). Durable when returned."""

    session_id: SessionId
    activation_id: ActivationId
    node_id: NodeId
    request_id: str
    """The idempotency key it was created with: a retry with it returns this same session."""


@dataclass(frozen=True, kw_only=True)
class PromptAccepted:
    """A human prompt durably stored at ``accepted_seq`` of ``session_id`` (Queue delivery:
    it runs as its own turn)."""

    session_id: SessionId
    accepted_seq: int
    duplicate: bool
    """True when this was a retry of an already accepted ``idempotency_key``."""
    idempotency_key: str


@dataclass(frozen=True, kw_only=True)
class InterruptResult:
    """What ``Interrupt`` did: ``interrupted`` is true when a running turn was cancelled by
    this call (``turn_id`` names it); false when the session was idle or absent."""

    session_id: SessionId
    interrupted: bool
    turn_id: TurnId | None = None


@dataclass(frozen=True, kw_only=True)
class PendingApproval:
    """A call of ``session_id`` that waits for a person's decision: its request (at ``seq``,
    written at ``requested_at``)."""

    session_id: SessionId
    seq: int
    requested_at: datetime | None
    request: ApprovalRequest


@dataclass(frozen=True, kw_only=True)
class DecisionResult:
    """A durable decision on an approval request: its seq in the session's transcript, whether
    it repeated one already accepted, and who it is recorded as made by."""

    session_id: SessionId
    accepted_seq: int
    duplicate: bool
    decided_by: str


@dataclass(frozen=True, kw_only=True)
class StopResult:
    """What ``StopTree`` recorded: the stop of the subtree under ``session_id``, whether it is
    ``closed`` until reopened, and how many running turns the serving node cancelled itself
    (the other nodes cancel theirs as the stop reaches them)."""

    session_id: SessionId
    stop_id: str
    closed: bool
    turns_cancelled_here: int


@dataclass(frozen=True, kw_only=True)
class SessionInfo:
    """A session's durable, write-once header as read over the wire.

    ``kind`` is ``None`` when the server sent a kind this client does not know;
    ``parent_session`` is ``None`` exactly for roots; ``created_at`` is ``None`` if not sent.
    """

    session_id: SessionId
    kind: SessionKind | None
    parent_session: SessionId | None
    preset: str
    model: str
    tools: tuple[ToolDescriptor, ...] = ()
    fork_origin: ForkOrigin | None = None
    created_at: datetime | None = None
    namespace: str = "default"
    """The namespace of the session's tree."""
    output_schema: str = ""
    """The JSON schema (canonical JSON) its answers must match; ``""``: none."""


# -- transcript entry bodies (the ``TranscriptEntry.body`` oneof) --------------------------------


@dataclass(frozen=True, kw_only=True)
class Task:
    """The session's initial user task (for a child: written by its parent's manager, with any
    return instruction)."""

    content: str


@dataclass(frozen=True, kw_only=True)
class HumanPrompt:
    """A human prompt accepted over ``SubmitPrompt`` (Queue delivery)."""

    content: str
    idempotency_key: str


@dataclass(frozen=True, kw_only=True)
class AgentMessage:
    """An accepted agent message (Steer delivery). ``sender`` is derived by the server from the
    authorized sender; ``delivery`` is ``None`` when not recorded or unknown to this client."""

    sender: SessionId
    content: str
    idempotency_key: str
    delivery: DeliveryKind | None
    trace: str = ""


@dataclass(frozen=True, kw_only=True)
class SettlementNotice:
    """The manager-owned ``subagent-settled`` notice: how a child's activation ended.
    ``outcome`` is ``None`` when unknown to this client."""

    child_session: SessionId
    child_activation: ActivationId
    outcome: SettlementOutcome | None
    terminal_output: str
    detail: str = ""
    output_json: str = ""
    """The child's answer as its output schema's JSON value (canonical JSON), when its session
    names a schema and its last turn completed with a matching answer; ``""`` otherwise."""


@dataclass(frozen=True, kw_only=True)
class AssistantStep:
    """One model call's output: text and the tool calls it asked for (first half of a step)."""

    text: str
    tool_calls: tuple[ToolCall, ...]
    usage: Usage


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    """The result of one tool call, keyed by the model's call id. ``duration_ms``: how long
    the call ran on its node, rounded up (0: it did not run there, or the server did not
    record it)."""

    call_id: str
    name: str
    content: str
    is_error: bool = False
    duration_ms: int = 0


@dataclass(frozen=True, kw_only=True)
class TurnStarted:
    """A turn began, on node ``node_id`` under activation ``activation_id`` (each ``None``
    when the server did not record it: an entry older than the fields)."""

    turn_id: TurnId
    node_id: NodeId | None = None
    activation_id: ActivationId | None = None
    trace: str = ""
    """The turn span's W3C ``traceparent`` (``""``: tracing off): its trace holds the turn's
    steps, model calls and tool calls."""


@dataclass(frozen=True, kw_only=True)
class TurnEnded:
    """A turn ended; ``outcome`` is ``None`` when unknown to this client."""

    turn_id: TurnId
    outcome: TurnOutcome | None
    detail: str = ""
    output_json: str = ""
    """The turn's answer as the session's output schema's JSON value (canonical JSON), when
    the session names a schema and the turn completed; ``""`` otherwise."""


@dataclass(frozen=True, kw_only=True)
class AnswerRejected:
    """The final answer of the step before did not match the session's output schema
    (``schema_json``): ``reason`` says why; the model is asked again."""

    reason: str
    schema_json: str


@dataclass(frozen=True, kw_only=True)
class Consumed:
    """Inbound entries (by seq, in the FIFO order the model saw them) were delivered to the
    model here: at turn start or at a step boundary."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Compaction:
    """The agent's context was compacted: from here its model sees ``summary`` (after the
    kept ``task``, if any) in place of every entry up to ``through_seq``; those entries stay in
    the transcript. ``pending`` are inbound entries of that range not yet read, shown to the
    model where they are consumed. ``usage`` is the summary call's, made with ``model``."""

    summary: str
    from_seq: int
    through_seq: int
    task: str = ""
    pending: tuple[int, ...] = ()
    model: str = ""
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True, kw_only=True)
class ToolOutputsCleared:
    """The outputs of the tool results at ``seqs`` were replaced in the model's context by a
    short stub; the results stay whole in the transcript."""

    seqs: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ApprovalRequest:
    """A tool call waits for a person's decision before it runs (docs/approvals.md). Decide
    with :meth:`MeshClient.approve` / :meth:`MeshClient.deny`, naming ``request_digest``."""

    call_id: str
    tool: str
    arguments_json: str
    descriptor_digest: str
    request_digest: str
    expires_at: datetime | None = None
    step_seq: int = 0
    """Seq of the step that made the call."""


@dataclass(frozen=True, kw_only=True)
class ApprovalDecided:
    """A decision on the request of call ``call_id``; ``decision`` is ``None`` when unknown to
    this client. ``by`` is who decided, as the node authenticated them."""

    call_id: str
    decision: ApprovalDecision | None
    request_digest: str
    arguments_json: str = ""
    reason: str = ""
    by: str = ""


@dataclass(frozen=True, kw_only=True)
class ForkPrefix:
    """A fork child's first entry: its parent's completed turns as the messages its parent's
    model saw, oldest first (a role this client does not know reads as ``user``)."""

    messages: tuple[ChatMessage, ...]


@dataclass(frozen=True, kw_only=True)
class UnknownEntry:
    """An entry body this client does not know (a newer server added one): nothing to show but
    its position."""


EntryBody = (
    Task
    | HumanPrompt
    | AgentMessage
    | SettlementNotice
    | AssistantStep
    | ToolResult
    | TurnStarted
    | TurnEnded
    | AnswerRejected
    | Consumed
    | Compaction
    | ToolOutputsCleared
    | ApprovalRequest
    | ApprovalDecided
    | ForkPrefix
    | UnknownEntry
)


@dataclass(frozen=True, kw_only=True)
class TranscriptEntry:
    """One durable, append-only transcript record: ``seq`` starts at 1 per session, strictly
    increasing, no gaps."""

    seq: int
    recorded_at: datetime | None
    body: EntryBody


@dataclass(frozen=True, kw_only=True)
class SessionPage:
    """One ``GetSession`` read: the header, the residency and live state when read, and one
    page of the transcript. ``next_page_token`` is ``""`` on the last page.

    ``usage`` sums the session's model calls over its whole transcript (not only this page) as
    it was when this page was read: on the last page, exactly the calls up to its end. ``None``
    when the server did not send one (a server older than the field)."""

    info: SessionInfo
    activation: Activation | None
    state: AgentState | None
    transcript: tuple[TranscriptEntry, ...]
    next_page_token: str = ""
    usage: SessionUsage | None = None
    cost: Cost | None = None
    """What ``usage``'s calls cost at the cluster's prices, every call priced at the session's
    model (``None``: a node that did not say, older than the field);
    :meth:`MeshClient.prices` prices each call at the model that made it."""


@dataclass(frozen=True, kw_only=True)
class AgentSummary:
    """One ``ListAgents`` line: header, current activation (``None`` when absent), state."""

    info: SessionInfo
    activation: Activation | None
    state: AgentState | None
    awaiting_approval: bool | None = None
    """Whether a call of it waits for a person's decision; ``None`` unless the listing was
    asked ``with_approvals``."""


@dataclass(frozen=True, kw_only=True)
class AgentPage:
    """One ``ListAgents`` page. A filtered page may hold fewer agents than asked, even none,
    and still have a ``next_page_token`` (the server looks at a bounded part of its index per
    page); only ``""`` ends the listing. ``total`` is the number of sessions the listing walks
    in all (the filters other than root, namespace and roots-only aside) when it was asked
    to count, else ``None``."""

    agents: tuple[AgentSummary, ...]
    next_page_token: str = ""
    total: int | None = None


@dataclass(frozen=True, kw_only=True)
class TextDelta:
    """A piece of a session's model text while a step of ``turn_id`` is being written (a watch
    with ``deltas=True``): ephemeral, never stored. ``dropped``: how many pieces of this
    session the watch lost right before this one (the text is then not whole). The
    :class:`AssistantStep` entry that follows is the record."""

    turn_id: TurnId
    text: str
    dropped: int = 0


@dataclass(frozen=True, kw_only=True)
class SessionEvent:
    """One item of a watch: a transcript entry of a watched session (``entry``), a change of
    its residency (``activated`` / ``deactivated``), or (a watch with ``deltas=True``) a piece
    of its model text as it is generated (``delta``). ``event_seq`` is strictly increasing
    along a watch's entries; residency events and deltas repeat the one before. Resuming after
    it neither repeats nor skips an entry; deltas are never replayed."""

    session_id: SessionId
    event_seq: int
    entry: TranscriptEntry | None = None
    activated: Activation | None = None
    deactivated: Activation | None = None
    delta: TextDelta | None = None
