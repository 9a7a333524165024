"""Acceptance: the durable append of an inbound entry and its delivery, once, into the agent."""

from __future__ import annotations

import dataclasses

from dsh_mesh import telemetry
from dsh_mesh.agent import Agent, AgentState
from dsh_mesh.core import (
    AgentMessageEntry,
    ApprovalDecisionEntry,
    ApprovalStale,
    Delivery,
    DeliveryKind,
    InboundEntry,
    NodeFenced,
    Record,
    RegistryUnavailable,
)
from dsh_mesh.runtime._admission import Reservation
from dsh_mesh.runtime._store import (
    Acceptance,
    IdempotencyKey,
    SessionStore,
    duplicate_of,
    fingerprint,
)


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
    ) -> Delivery:
        """Append ``entry`` for ``agent`` and deliver it. ``reservation`` holds the target
        awake: it ends when the driver admits the record, or here when nothing was handed to
        the agent. Call detached: once begun, acceptance runs to its end."""
        session = agent.session_id
        if isinstance(entry, AgentMessageEntry):
            entry = dataclasses.replace(entry, delivery=kind)
        with reservation:
            # The append and the delivery hold off the target's step boundary: it cannot write
            # a ConsumedEntry past this record without reading it (docs/adr/0007). A decision
            # on an approval request also holds off every other decision on that agent's
            # requests: it is checked against the transcript, then appended, as one step.
            deciding = isinstance(entry, ApprovalDecisionEntry)
            async with agent.deciding() if deciding else agent.accepting():
                if isinstance(entry, ApprovalDecisionEntry):
                    # A repeat is answered by its key, whatever the agent did since (the call
                    # ran, the turn went on); anything else is checked against the transcript.
                    known = None if key is None else await self._store.lookup(key)
                    if known is not None and key is not None:
                        return duplicate_of(key, known, session, fingerprint(session, entry))
                    await agent.check_decision(entry)
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
                except ApprovalStale:
                    agent.doubt()  # the store holds a decision this agent's copy does not
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
