"""The adjacency decision of a send, from the registry's lineage and activations."""

from __future__ import annotations

import asyncio

from dsh_mesh import telemetry
from dsh_mesh.core import (
    Activation,
    AgentRef,
    Authorized,
    Refused,
    RejectionReason,
    SessionHeader,
    SessionId,
    authorize,
)
from dsh_mesh.runtime._store import SessionStore

MAX_TREE_DEPTH = 64
LIVENESS_REASONS = frozenset(
    {RejectionReason.STALE_SENDER, RejectionReason.PARENT_NOT_LIVE, RejectionReason.PARENT_REBOUND}
)
"""Refusals that hinge on which activations are live."""
ADOPTION_WAIT = 1.0
"""Seconds a child's reply refused ``PARENT_REBOUND`` waits, re-checked, for its parent's new
activation to adopt it (ADR 0043) before the refusal stands."""
_FIRST_RECHECK = 0.02
_LAST_RECHECK = 0.2


class Authorizer:
    """Reads the sender's and target's lineage and live activations and decides the edge
    (contract rule 2). Stateless beyond its store: safe to call concurrently."""

    def __init__(self, store: SessionStore, *, adoption_wait: float = ADOPTION_WAIT) -> None:
        self._store = store
        self._adoption_wait = adoption_wait

    async def authorize(self, sender: AgentRef, target: SessionId) -> Authorized | Refused:
        """The decision for ``sender`` sending to ``target``. A refusal that hinges on liveness
        is confirmed against etcd itself: the store may answer from a watch-fed cache a moment
        behind."""
        with telemetry.span(
            "dsh.authorize",
            attributes={
                "dsh.sender.session_id": sender.session_id,
                "dsh.target.session_id": target,
            },
        ) as authorizing:
            decision = await self._decide(sender, target, fresh=False)
            if isinstance(decision, Refused) and decision.reason in LIVENESS_REASONS:
                authorizing.set("dsh.authorize.rechecked", True)
                decision = await self._decide(sender, target, fresh=True)
            if isinstance(decision, Refused) and decision.reason is RejectionReason.PARENT_REBOUND:
                decision = await self._await_adoption(sender, target, decision)
            if isinstance(decision, Refused):
                authorizing.set_many(
                    {
                        "dsh.authorize.decision": "refused",
                        "dsh.authorize.reason": decision.reason.value,
                    }
                )
            else:
                authorizing.set_many(
                    {
                        "dsh.authorize.decision": "accepted",
                        "dsh.authorize.direction": decision.direction.value,
                    }
                )
            return decision

    async def _await_adoption(
        self, sender: AgentRef, target: SessionId, refused: Refused
    ) -> Authorized | Refused:
        """The decision once the parent's new activation has adopted the child, re-checked
        fresh for up to :data:`ADOPTION_WAIT`: a resumed parent re-binds its live children a
        moment after it wins (ADR 0043), and a reply sent in that moment is not the model's to
        retry. ``refused`` stands if no adoption comes (etcd failed it; the parent's next
        message re-binds the child, as before)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._adoption_wait
        pause = _FIRST_RECHECK
        decision: Authorized | Refused = refused
        while loop.time() < deadline:
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, _LAST_RECHECK)
            decision = await self._decide(sender, target, fresh=True)
            if not (
                isinstance(decision, Refused) and decision.reason is RejectionReason.PARENT_REBOUND
            ):
                return decision
        return decision

    async def _decide(
        self, sender: AgentRef, target: SessionId, *, fresh: bool
    ) -> Authorized | Refused:
        headers: dict[SessionId, SessionHeader] = {}
        activations: dict[SessionId, Activation] = {}
        for session in (sender.session_id, target):
            await self._load_lineage(session, headers)
            current = await self._store.current_activation(session, fresh=fresh)
            if current is not None:
                activations[session] = current
        return authorize(sender, target, headers, activations)

    async def _load_lineage(self, session: SessionId, into: dict[SessionId, SessionHeader]) -> None:
        next_id: SessionId | None = session
        for _ in range(MAX_TREE_DEPTH):
            if next_id is None or next_id in into:
                return
            header = await self._store.get_header(next_id)
            if header is None:
                return
            into[next_id] = header
            next_id = header.parent_session
