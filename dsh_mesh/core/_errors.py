"""One error hierarchy for the mesh, rooted at :class:`MeshError`.

Every rejection carries a :class:`RejectionReason` so that callers (and, later, gRPC clients in
other languages) branch on a value, never on prose. The mapping to gRPC status codes lives at the
transport edge; the reasons mirror ``dsh.mesh.v1.RejectionReason`` one to one.
"""

from __future__ import annotations

import enum


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


class MeshError(Exception):
    """Root of every error the mesh raises on purpose."""


class Rejected(MeshError):
    """A request was refused before anything was accepted; nothing durable changed.

    ``reason`` is the machine-readable cause; the message is for humans only.
    """

    reason: RejectionReason

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class AdjacencyRejected(Rejected):
    """The sender and target are not the two ends of one authorized parent-child edge."""


class TargetUnknown(Rejected):
    """The named target has no session header."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectionReason.UNKNOWN_TARGET, detail)


class StaleSender(Rejected):
    """The sending Agent's activation is no longer current; it must not speak for its session."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectionReason.STALE_SENDER, detail)


class ParentNotLive(Rejected):
    """A child addressed a parent with no live activation (or a superseded one)."""


class InvalidArgument(Rejected):
    """Malformed input; the caller must fix the request, retrying it unchanged will fail."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectionReason.INVALID_ARGUMENT, detail)


class IdempotencyConflict(Rejected):
    """An idempotency key was reused for a different message."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectionReason.IDEMPOTENCY_CONFLICT, detail)


class SessionExists(MeshError):
    """A session header with this id already exists; headers are create-only."""


class SessionUnknown(MeshError):
    """An operation named a session that has no header (control plane, store reads)."""


class ActivationFenced(MeshError):
    """A write was attempted under an activation that is no longer current; nothing was written."""


class NotResident(MeshError):
    """The session has no live activation here, so a control operation cannot reach it."""


class TurnFailed(MeshError):
    """A model call failed; the turn ends with outcome ``error``."""


class TokensExhausted(MeshError):
    """The model ran out of its token budget; the turn ends with outcome ``token_exhaustion``."""
