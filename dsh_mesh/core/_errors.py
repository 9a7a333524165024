"""One error hierarchy for the mesh, rooted at :class:`MeshError`.

Every rejection carries a :class:`RejectionReason` so that callers (and gRPC clients in other
languages) branch on a value, never on prose. Each reason has exactly one exception class
(:func:`rejection_class`), used both where a rejection is raised and where a client rebuilds it
from the wire; :data:`RETRYABLE_REASONS` says which ones a caller may simply send again. The
mapping to gRPC status codes lives at the transport edge (``dsh_mesh.transport``); the reasons
mirror ``dsh.mesh.v1.RejectionReason`` one to one. The whole table is ``docs/errors.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar


class RejectionReason(enum.Enum):
    """Why a message (or a request for one) was refused. Values mirror the proto enum names."""

    SELF_TARGET = "SELF_TARGET"
    """The sender named its own session."""
    SIBLING_TARGET = "SIBLING_TARGET"
    """The target shares the sender's parent: siblings are not an alternate route."""
    ANCESTOR_BEYOND_EDGE = "ANCESTOR_BEYOND_EDGE"
    """The target is an ancestor more than one edge up (a grandparent or above)."""
    DESCENDANT_BEYOND_EDGE = "DESCENDANT_BEYOND_EDGE"
    """The target is a descendant more than one edge down (a grandchild or below)."""
    UNRELATED_TARGET = "UNRELATED_TARGET"
    """The target is in another branch or another tree (cousin, other root...)."""
    UNKNOWN_TARGET = "UNKNOWN_TARGET"
    """No session header exists for the target id."""
    UNKNOWN_SENDER = "UNKNOWN_SENDER"
    """No session header exists for the sender id."""
    STALE_SENDER = "STALE_SENDER"
    """The sender's activation is not the session's current one (a stale Agent object)."""
    ONE_SHOT_TARGET = "ONE_SHOT_TARGET"
    """The target is a one-shot child: it runs its task once and takes no messages."""
    ONE_SHOT_SENDER = "ONE_SHOT_SENDER"
    """A one-shot child tried to message its parent: only continuable children have that edge."""
    PARENT_NOT_LIVE = "PARENT_NOT_LIVE"
    """The child's parent has no live activation; there is no offline mailbox. Retry later."""
    PARENT_REBOUND = "PARENT_REBOUND"
    """The parent is live under a newer activation than the one this child answers to; the
    child is re-bound when that parent next messages it."""
    FORGED_SENDER = "FORGED_SENDER"
    """The calling node's authenticated identity does not host the claimed sender."""
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    """The request is malformed (bad id, empty or over-long message, bad tool arguments)."""
    IDEMPOTENCY_CONFLICT = "IDEMPOTENCY_CONFLICT"
    """The idempotency key was already used by this sender for different content."""
    UNAUTHENTICATED = "UNAUTHENTICATED"
    """The calling node presented no cluster credential, or a wrong one."""
    REGISTRY_UNAVAILABLE = "REGISTRY_UNAVAILABLE"
    """etcd could not be reached or timed out, so the request could not be decided. Retryable."""
    PEER_UNAVAILABLE = "PEER_UNAVAILABLE"
    """The node hosting the target could not be reached, is draining, or no longer holds the
    target's activation. Retryable: a retry is routed afresh."""
    NODE_FENCED = "NODE_FENCED"
    """The serving node lost its etcd lease and accepts nothing until it re-registers. Retryable."""
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    """The caller's deadline passed before acceptance (a forwarded call may still have been
    accepted by the target: retry with the same idempotency key to learn it)."""
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    """A control-plane call (or a store read) named a session that has no header."""
    TARGET_ELSEWHERE = "TARGET_ELSEWHERE"
    """The called node does not host the target: another node holds its activation (named in
    the metadata ``node_id``). Nodes follow it themselves; nothing was accepted."""
    INBOX_FULL = "INBOX_FULL"
    """The target holds as many unread messages and prompts as its node allows. Retryable."""
    NODE_OVERLOADED = "NODE_OVERLOADED"
    """The serving node is at a capacity limit (metadata ``limit``: ``inflight_sends`` or
    ``resident_sessions``). Retryable."""
    TOOLS_UNAVAILABLE = "TOOLS_UNAVAILABLE"
    """The node that would resume the target cannot serve a tool its header records: the tool
    is not deployed there, or its descriptor differs (metadata ``tool``, ``problem``). A
    session's tools mean the same on every node; nothing was accepted."""

    TREE_LIMIT = "TREE_LIMIT"
    """A spawn would take its tree past a limit of the node's (metadata ``limit``: ``depth`` or
    ``live_descendants``; ``max`` the limit, ``root`` the tree). Nothing was created."""
    RATE_LIMITED = "RATE_LIMITED"
    """Sessions are being created faster than allowed (metadata ``limit``:
    ``spawns_per_minute`` of one tree; ``retry_after_ms`` when to try again). Retryable."""
    TREE_CLOSED = "TREE_CLOSED"
    """The session is in a subtree that was stopped and closed (metadata ``stopped``: the
    session the stop named). Nothing was accepted; it takes work again once reopened."""
    NAMESPACE_DENIED = "NAMESPACE_DENIED"
    """The caller holds no grant of the namespace it named (metadata ``namespace``): a root's
    creation or a listing of that namespace. A session the caller may not see is
    ``UNKNOWN_SESSION`` instead, so its id does not leak."""
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    """A namespace is at a quota (metadata ``limit``: ``live_sessions``; ``max`` the quota,
    ``namespace``). Nothing was created. Retryable once some of its sessions end."""
    APPROVAL_STALE = "APPROVAL_STALE"
    """A decision names no request now waiting: the call was decided already (by someone
    else, by expiry, by an interrupt or a stop), or the request it was shown is not the one
    waiting (metadata ``call_id``). Nothing was accepted."""
    STORE_REFUSED = "STORE_REFUSED"
    """The log store refused the request for a reason that does not pass by itself: the
    node's database user lacks a privilege, a table is missing, the database does not exist
    (metadata ``store``, ``code``: the database's own error code). The message carries the
    database's words. Nothing was accepted; an operator must fix the database."""


RETRYABLE_REASONS: frozenset[RejectionReason] = frozenset(
    {
        RejectionReason.PARENT_NOT_LIVE,
        RejectionReason.REGISTRY_UNAVAILABLE,
        RejectionReason.PEER_UNAVAILABLE,
        RejectionReason.NODE_FENCED,
        RejectionReason.INBOX_FULL,
        RejectionReason.NODE_OVERLOADED,
        RejectionReason.RATE_LIMITED,
        RejectionReason.QUOTA_EXCEEDED,
    }
)
"""Reasons after which the same request (same idempotency key) may be sent again unchanged and
is expected to succeed once a transient condition passes. They are exactly the reasons sent with
status UNAVAILABLE (something is down) or RESOURCE_EXHAUSTED (something is full: back off), and
only they carry a ``google.rpc.RetryInfo`` on the wire. Everything else
fails again unless the request or the world changes (DEADLINE_EXCEEDED: retry only with a fresh
deadline, by the caller's own choice)."""

MAY_FOLLOW_AN_ACCEPTANCE: frozenset[RejectionReason] = frozenset(
    {
        RejectionReason.STALE_SENDER,
        RejectionReason.PARENT_NOT_LIVE,
        RejectionReason.PARENT_REBOUND,
        RejectionReason.FORGED_SENDER,
    }
)
"""Refusals a send's edge can earn only after the tree changed (or its sender moved node), so
a retry refused so may be of a send accepted before the change. The node looks the retry's key
up first; the standard ``send_message`` tool, after an outage, says such a refusal may have
landed (an earlier try may still be on its way)."""


class MeshError(Exception):
    """Root of every error the mesh raises on purpose."""


class Rejected(MeshError):
    """A request was refused before anything was accepted; nothing durable changed.

    ``reason`` is the machine-readable cause; ``detail`` and the message are for humans only.
    ``metadata`` holds a few structured fields (string to string, for example
    ``target_session_id``) that travel in the ``google.rpc.ErrorInfo`` on the wire; it is empty
    unless the raiser knows them. ``Rejected.of(reason, detail)`` builds the one class
    :func:`rejection_class` names for ``reason``.
    """

    reason: RejectionReason
    detail: str
    metadata: Mapping[str, str]

    def __init__(
        self,
        reason: RejectionReason,
        detail: str,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.metadata = dict(metadata or {})

    @property
    def retryable(self) -> bool:
        """Whether the same request may be sent again unchanged (see :data:`RETRYABLE_REASONS`)."""
        return self.reason in RETRYABLE_REASONS

    @classmethod
    def of(
        cls,
        reason: RejectionReason,
        detail: str,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> Rejected:
        """An instance of ``rejection_class(reason)`` with this reason, detail and metadata.

        Always builds the class of the table, whichever class it is called on; the transport
        uses it to rebuild a rejection received from another node.
        """
        kind = rejection_class(reason)
        if issubclass(kind, _FixedRejected):
            return kind(detail, metadata=metadata)
        return kind(reason, detail, metadata=metadata)


class _FixedRejected(Rejected):
    """A rejection whose class implies its reason (one reason, one class)."""

    fixed_reason: ClassVar[RejectionReason]

    def __init__(self, detail: str, *, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(self.fixed_reason, detail, metadata=metadata)


class AdjacencyRejected(Rejected):
    """The sender and target are not the two ends of one authorized parent-child edge.

    Also the class of UNKNOWN_SENDER and FORGED_SENDER: the claimed sender end of the edge does
    not exist or is not hosted by the authenticated calling node.
    """


class TargetUnknown(_FixedRejected):
    """The named target has no session header."""

    fixed_reason = RejectionReason.UNKNOWN_TARGET


class StaleSender(_FixedRejected):
    """The sending Agent's activation is no longer current; it must not speak for its session."""

    fixed_reason = RejectionReason.STALE_SENDER


class ParentNotLive(Rejected):
    """A child addressed a parent with no live activation (PARENT_NOT_LIVE, retryable later) or
    a parent live under a newer activation than the one the child answers to (PARENT_REBOUND)."""


class InvalidArgument(_FixedRejected):
    """Malformed input; the caller must fix the request, retrying it unchanged will fail."""

    fixed_reason = RejectionReason.INVALID_ARGUMENT


class IdempotencyConflict(_FixedRejected):
    """An idempotency key was reused for a different message."""

    fixed_reason = RejectionReason.IDEMPOTENCY_CONFLICT


class Unauthenticated(_FixedRejected):
    """The calling node presented no cluster credential, or a wrong one; nothing was examined."""

    fixed_reason = RejectionReason.UNAUTHENTICATED


class RegistryUnavailable(_FixedRejected):
    """etcd could not be reached or timed out before the request could be decided; nothing was
    accepted. Retryable: send the same request (same idempotency key) again after a short delay."""

    fixed_reason = RejectionReason.REGISTRY_UNAVAILABLE


class StoreRefused(_FixedRejected):
    """The log store refused the request for a reason that does not pass by itself (a missing
    privilege or table: ``metadata["code"]`` is the database's error code,
    ``metadata["store"]`` where the store is): nothing was accepted. Not retryable as such: an
    operator must fix the database. The node stays up; its agents wait at their step
    boundary, and go on once the store accepts their writes again."""

    fixed_reason = RejectionReason.STORE_REFUSED


class PeerUnavailable(_FixedRejected):
    """The node hosting the target could not be reached, is draining, or no longer holds the
    target's activation. Retryable: a retry is routed afresh. If the connection broke mid-call
    the target may have accepted; the retry (same idempotency key) then returns that acceptance.
    """

    fixed_reason = RejectionReason.PEER_UNAVAILABLE


class InboxFull(_FixedRejected):
    """The target holds as many unread messages and prompts as its node allows: nothing was
    accepted. Retryable once it has read some (``google.rpc.RetryInfo`` says when to try)."""

    fixed_reason = RejectionReason.INBOX_FULL


class NodeOverloaded(_FixedRejected):
    """The serving node is at a capacity limit (``metadata["limit"]`` names it): nothing was
    accepted. Retryable after a back-off."""

    fixed_reason = RejectionReason.NODE_OVERLOADED


class ToolsUnavailable(_FixedRejected):
    """The node cannot serve a tool the session's header records (``metadata["tool"]`` names
    it, ``metadata["problem"]`` says ``missing`` or ``descriptor``): resuming it here would
    change what its tools mean. Nothing was accepted; fix the deployment (every node imports
    the same tool modules) and send again. At creation also: an MCP server that cannot be
    listed (``unreachable``), or an ``approve_tools`` pattern that matches none of the
    preset's listed tools (``approval``, ``tool`` names the pattern): it would gate nothing."""

    fixed_reason = RejectionReason.TOOLS_UNAVAILABLE


class TreeLimitReached(_FixedRejected):
    """A spawn would take its tree past one of the node's tree limits (``metadata["limit"]``
    says which: ``depth`` or ``live_descendants``; ``metadata["max"]`` is the limit). Nothing
    was created. Not retryable as such: the tree must change first (live children settle)."""

    fixed_reason = RejectionReason.TREE_LIMIT


class TreeClosed(_FixedRejected):
    """The session is in a subtree that was stopped and closed (``metadata["stopped"]`` names
    the session the stop named): no turn, resume, spawn, prompt or message until it is
    reopened. Nothing was accepted."""

    fixed_reason = RejectionReason.TREE_CLOSED


class ApprovalStale(_FixedRejected):
    """A decision on a call that no longer waits for one, or on another request than the one
    waiting (``metadata["call_id"]``): nothing was accepted. Read the session's pending
    requests again before deciding."""

    fixed_reason = RejectionReason.APPROVAL_STALE


class RateLimited(_FixedRejected):
    """Sessions are being created faster than allowed (``metadata["limit"]`` names the rate,
    ``metadata["retry_after_ms"]`` when a retry may pass). Nothing was created. Retryable
    after that delay."""

    fixed_reason = RejectionReason.RATE_LIMITED


class NamespaceDenied(_FixedRejected):
    """The caller holds no grant of the namespace it named (``metadata["namespace"]``).
    Nothing was created or read."""

    fixed_reason = RejectionReason.NAMESPACE_DENIED


class QuotaExceeded(_FixedRejected):
    """A namespace is at one of its quotas (``metadata["limit"]``: ``live_sessions``;
    ``metadata["max"]`` the quota). Nothing was created. Retryable once some of the
    namespace's sessions end their activations."""

    fixed_reason = RejectionReason.QUOTA_EXCEEDED


class NodeFenced(_FixedRejected):
    """This node lost its etcd lease: it accepts nothing until it has registered again.
    Retryable: another node (or this one, re-registered) can take the request."""

    fixed_reason = RejectionReason.NODE_FENCED


class DeadlineExceeded(_FixedRejected):
    """The caller's deadline passed before the request was accepted.

    If it ran out on a call forwarded to the target's node, the target may still have accepted.
    Not retryable as such: a retry needs a fresh deadline; with the same idempotency key it is
    safe and returns the acceptance if there was one."""

    fixed_reason = RejectionReason.DEADLINE_EXCEEDED


class TargetElsewhere(_FixedRejected):
    """The session is resident on another node (``node_id``, under ``activation_id``): a node
    that lost a cold-resume race, or was handed a send for a session it does not host, answers
    with this so the sender's node sends there itself. Nothing was accepted."""

    fixed_reason = RejectionReason.TARGET_ELSEWHERE

    @classmethod
    def held_by(cls, session: str, node_id: str, activation_id: str) -> TargetElsewhere:
        """The redirect to the node holding ``session``'s activation."""
        return cls(
            f"{session} is resident on node {node_id}",
            metadata={"node_id": node_id, "activation_id": activation_id},
        )

    @property
    def node_id(self) -> str:
        """The node holding the target's activation."""
        return self.metadata.get("node_id", "")

    @property
    def activation_id(self) -> str:
        """The target's current activation."""
        return self.metadata.get("activation_id", "")


class SessionExists(MeshError):
    """A session header with this id already exists; headers are create-only."""


class SessionUnknown(_FixedRejected):
    """An operation named a session that has no header (control plane, store reads).

    A rejection (reason UNKNOWN_SESSION, status NOT_FOUND): nothing changed. Raised with the
    session id (or a short explanation) as its detail.
    """

    fixed_reason = RejectionReason.UNKNOWN_SESSION


class ActivationFenced(MeshError):
    """A write was attempted under an activation that is no longer current; nothing was written.

    Node-local, not a rejection: if it reaches a remote caller it travels as PEER_UNAVAILABLE
    (the target's activation moved away from this node; a retry is routed to the new one).
    """


class NotResident(MeshError):
    """The session has no live activation here, so a control operation cannot reach it.

    Node-local, not a rejection: if it reaches a remote caller it travels as PEER_UNAVAILABLE
    (the caller routed on a stale view of where the session lives; a retry re-resolves it).
    """


class TurnFailed(MeshError):
    """A model call failed; the turn ends with outcome ``error``."""


class TokensExhausted(MeshError):
    """The model ran out of its token budget; the turn ends with outcome ``token_exhaustion``."""


class ContextOverflow(TokensExhausted):
    """A provider refused a request longer than its model's context window. The agent compacts
    its context and retries the step (docs/context.md); only when even the summary cannot fit
    does the turn end with ``token_exhaustion``."""


_CLASS_OF_REASON: Mapping[RejectionReason, type[Rejected]] = MappingProxyType(
    {
        RejectionReason.SELF_TARGET: AdjacencyRejected,
        RejectionReason.SIBLING_TARGET: AdjacencyRejected,
        RejectionReason.ANCESTOR_BEYOND_EDGE: AdjacencyRejected,
        RejectionReason.DESCENDANT_BEYOND_EDGE: AdjacencyRejected,
        RejectionReason.UNRELATED_TARGET: AdjacencyRejected,
        RejectionReason.UNKNOWN_TARGET: TargetUnknown,
        RejectionReason.UNKNOWN_SENDER: AdjacencyRejected,
        RejectionReason.STALE_SENDER: StaleSender,
        RejectionReason.ONE_SHOT_TARGET: AdjacencyRejected,
        RejectionReason.ONE_SHOT_SENDER: AdjacencyRejected,
        RejectionReason.PARENT_NOT_LIVE: ParentNotLive,
        RejectionReason.PARENT_REBOUND: ParentNotLive,
        RejectionReason.FORGED_SENDER: AdjacencyRejected,
        RejectionReason.INVALID_ARGUMENT: InvalidArgument,
        RejectionReason.IDEMPOTENCY_CONFLICT: IdempotencyConflict,
        RejectionReason.UNAUTHENTICATED: Unauthenticated,
        RejectionReason.REGISTRY_UNAVAILABLE: RegistryUnavailable,
        RejectionReason.PEER_UNAVAILABLE: PeerUnavailable,
        RejectionReason.NODE_FENCED: NodeFenced,
        RejectionReason.DEADLINE_EXCEEDED: DeadlineExceeded,
        RejectionReason.UNKNOWN_SESSION: SessionUnknown,
        RejectionReason.TARGET_ELSEWHERE: TargetElsewhere,
        RejectionReason.INBOX_FULL: InboxFull,
        RejectionReason.NODE_OVERLOADED: NodeOverloaded,
        RejectionReason.TOOLS_UNAVAILABLE: ToolsUnavailable,
        RejectionReason.TREE_LIMIT: TreeLimitReached,
        RejectionReason.TREE_CLOSED: TreeClosed,
        RejectionReason.RATE_LIMITED: RateLimited,
        RejectionReason.NAMESPACE_DENIED: NamespaceDenied,
        RejectionReason.QUOTA_EXCEEDED: QuotaExceeded,
        RejectionReason.APPROVAL_STALE: ApprovalStale,
        RejectionReason.STORE_REFUSED: StoreRefused,
    }
)


def rejection_class(reason: RejectionReason) -> type[Rejected]:
    """The one exception class a rejection for ``reason`` is raised (and rebuilt) as.

    Total over :class:`RejectionReason`; the server and the client side of the wire share it.
    """
    return _CLASS_OF_REASON[reason]
