"""The mesh's own decision on an approval request of an absent agent (docs/approvals.md): a
stop of its subtree, or its expiry while no agent held it."""

from __future__ import annotations

from dsh_mesh.core import (
    ActivationFenced,
    ActivationId,
    ApprovalRequestEntry,
    ApprovalStale,
    DeliveryKind,
    IdempotencyConflict,
    SessionId,
    mesh_denial,
)
from dsh_mesh.runtime._store import Acceptance, IdempotencyKey, SessionStore, fingerprint


def decision_key(session: SessionId, call_id: str, request_digest: str) -> IdempotencyKey:
    """The one idempotency key of the decisions on one request: a repeat of a decision is
    answered by it, a different one refused; a call asked again is a new request."""
    return IdempotencyKey(principal=f"approval:{session}", key=f"{call_id}:{request_digest}")


async def deny_absent(
    store: SessionStore, session: SessionId, request: ApprovalRequestEntry, reason: str
) -> bool:
    """Append the mesh's denial of ``request`` to ``session``, which no activation holds (the
    append is fenced so: if one holds it now, its agent decides, and this appends nothing).
    The agent reads it when it next runs. True when this decision was appended; False when
    the session is resident or the request was decided already (the store refuses a second
    decision, whoever wrote the first: the agent's own, say, after this sweep read the
    index)."""
    decision = mesh_denial(request, reason)
    acceptance = Acceptance(
        target=session,
        seq=0,
        target_activation=ActivationId(""),
        kind=DeliveryKind.STEERED,
        fingerprint=fingerprint(session, decision),
    )
    key = decision_key(session, request.call_id, request.digest)
    try:
        _, known = await store.append(session, decision, writer=None, idempotency=(key, acceptance))
    except (ActivationFenced, ApprovalStale, IdempotencyConflict):
        return False
    return known is None
