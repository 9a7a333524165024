"""Acceptance: the durable append of an inbound entry and its delivery, once, into the agent."""

from __future__ import annotations

import dataclasses
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from dsh_mesh import telemetry
from dsh_mesh.agent import Agent, AgentState
from dsh_mesh.core import (
    AgentMessageEntry,
    Delivery,
    DeliveryKind,
    InboundEntry,
    NodeFenced,
    Record,
    RegistryUnavailable,
)
from dsh_mesh.runtime._admission import Reservation
from dsh_mesh.runtime._store import Acceptance, IdempotencyKey, SessionStore, duplicate_of


class AcceptanceRule(Protocol):
    """What one kind of inbound entry asks of its acceptance beyond the append and the
    delivery every entry gets: how its target is held meanwhile, a check before the append,
    and which refusals of the append leave the target's copy in doubt. The rule of a kind
    lives where that kind is handled; :data:`PLAIN_ACCEPTANCE` is every other kind's."""

    @property
    def in_doubt_after(self) -> tuple[type[Exception], ...]:
        """The store's refusals of the append, beyond an outage's, that mean it holds a record
        the target's copy does not: the target doubts its copy (:meth:`Agent.doubt`)."""
        ...

    def held(self, agent: Agent) -> AbstractAsyncContextManager[None]:
        """Hold ``agent`` while the entry is checked, appended and delivered: at least its step
        boundary held off (:meth:`Agent.accepting`)."""
        ...

    async def check(self, agent: Agent, key: IdempotencyKey | None) -> Delivery | None:
        """Within :meth:`held`, before the append: the answer to a repeat, or None to append
        the entry; raises to refuse it (nothing is appended)."""
        ...


class _PlainAcceptance:
    """The rule of an entry that asks nothing more: its append and delivery hold off the
    target's step boundary (docs/adr/0007), and its key answers a repeat at the append."""

    in_doubt_after: tuple[type[Exception], ...] = ()

    def held(self, agent: Agent) -> AbstractAsyncContextManager[None]:
        return agent.accepting()

    async def check(self, agent: Agent, key: IdempotencyKey | None) -> Delivery | None:
        return None


PLAIN_ACCEPTANCE: AcceptanceRule = _PlainAcceptance()
"""The acceptance of every inbound entry whose kind has no rule of its own."""


class Acceptor:
    """Makes an inbound entry durable in a resident target's transcript (under its idempotency
    key, if any) and hands the record to the target exactly once. Stateless beyond its store."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store

    async def accept(
        self,
        agent: Agent,
        entry: InboundEntry,
        kind: DeliveryKind,
        key: IdempotencyKey | None,
        acceptance: Acceptance | None,
        reservation: Reservation,
        rule: AcceptanceRule = PLAIN_ACCEPTANCE,
    ) -> Delivery:
        """Append ``entry`` for ``agent`` and deliver it, under the ``rule`` of its kind.
        ``reservation`` holds the target awake: it ends when the driver admits the record, or
        here when nothing was handed to the agent. Call detached: once begun, acceptance runs
        to its end."""
        session = agent.session_id
        if isinstance(entry, AgentMessageEntry):
            entry = dataclasses.replace(entry, delivery=kind)
        with reservation:
            # The append and the delivery hold off the target's step boundary: it cannot write
            # a ConsumedEntry past this record without reading it (docs/adr/0007).
            async with rule.held(agent):
                answer = await rule.check(agent, key)
                if answer is not None:
                    return answer
                try:
                    record, known = await self._store.append(
                        session,
                        entry,
                        writer=agent.activation.activation_id,
                        idempotency=None
                        if key is None or acceptance is None
                        else (key, acceptance),
                    )
                except (RegistryUnavailable, NodeFenced):
                    agent.doubt()  # it may have landed: the next boundary looks
                    raise
                except rule.in_doubt_after:
                    agent.doubt()  # the store holds a record this agent's copy does not
                    raise
                if known is not None and key is not None:
                    duplicate = duplicate_of(key, known, session, known.fingerprint)
                    if (
                        known.target_activation == agent.activation.activation_id
                        and not agent.holds(known.seq)
                        and agent.state is not AgentState.SETTLED
                    ):
                        # The first try landed under this activation, and the agent does not
                        # hold its record: that try's answer was lost (an etcd outage) or is
                        # still on its way. Whichever of the two delivers first delivers;
                        # never both.
                        read = await self._store.read(session, after_seq=known.seq - 1, limit=1)
                        deliver_once(agent, read[0], reservation)
                    return duplicate
                # Nothing handed over only when a retry of this very write delivered it while
                # this answer was on its way: this is still the acceptance (the retry was told
                # "duplicate").
                deliver_once(agent, record, reservation)
        if isinstance(entry, AgentMessageEntry):
            telemetry.message_accepted(kind.value)
        return Delivery(
            target=session,
            target_activation=agent.activation.activation_id,
            kind=kind,
            accepted_seq=record.seq,
        )


def deliver_once(agent: Agent, record: Record, reservation: Reservation) -> bool:
    """Hand an accepted record to its resident target unless it already holds it (a retry and
    the try it repeats can both find the record); True when this call handed it, and then
    ``reservation`` ends with the record's admission. Synchronous: nothing runs between the
    check and the delivery."""
    if agent.holds(record.seq) or agent.state is AgentState.SETTLED:
        return False
    reservation.admit_on(record.seq)
    agent.deliver(record)
    return True
