"""How a decision on an approval request is accepted (docs/approvals.md): the rule
:class:`~dsh_mesh.runtime._acceptance.Acceptor` applies to it, beside the decision path of
:class:`~dsh_mesh.runtime._delivery.Deliveries`."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from dsh_mesh.agent import Agent
from dsh_mesh.core import ApprovalDecisionEntry, ApprovalStale, Delivery
from dsh_mesh.runtime._store import IdempotencyKey, SessionStore, duplicate_of, fingerprint


class DecisionAcceptance:
    """The acceptance rule of one decision on an approval request of a resident agent. It is
    checked against the agent's transcript, then appended, as one step: it holds off every
    other decision on that agent's requests as well as its step boundary. A repeat is answered
    by its key, whatever the agent did since (the call ran, the turn went on); anything else is
    checked against the transcript. Stateless beyond its store and its decision."""

    in_doubt_after: tuple[type[Exception], ...] = (ApprovalStale,)
    """The store refused a decision the agent's copy let through: it holds one this copy does
    not."""

    def __init__(self, store: SessionStore, decision: ApprovalDecisionEntry) -> None:
        self._store = store
        self._decision = decision

    def held(self, agent: Agent) -> AbstractAsyncContextManager[None]:
        return agent.deciding()

    async def check(self, agent: Agent, key: IdempotencyKey | None) -> Delivery | None:
        known = None if key is None else await self._store.lookup(key)
        if known is not None and key is not None:
            session = agent.session_id
            return duplicate_of(key, known, session, fingerprint(session, self._decision))
        await agent.check_decision(self._decision)
        return None
