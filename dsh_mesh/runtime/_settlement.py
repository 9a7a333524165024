"""Settlement: when an activation may end, and the manager-owned notice of how it ended."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from dsh_mesh import telemetry
from dsh_mesh.agent import Agent, AgentState, Settlement
from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    DeadlineExceeded,
    DeliveryKind,
    DetachedWork,
    NodeId,
    PeerUnavailable,
    SessionId,
    SettlementNoticeEntry,
    TargetElsewhere,
    TreeClosed,
)
from dsh_mesh.runtime._acceptance import Acceptor
from dsh_mesh.runtime._admission import AdmissionLedger, Reservation
from dsh_mesh.runtime._changes import ChangeSignal
from dsh_mesh.runtime._children import ChildLedger
from dsh_mesh.runtime._notices import derived_notice
from dsh_mesh.runtime._placement import Placement
from dsh_mesh.runtime._residency import AlreadyAccepted, Residency
from dsh_mesh.runtime._store import Acceptance, IdempotencyKey, SessionStore
from dsh_mesh.runtime._writes import WAITED_OUT, OutageTolerantWriter

_log = logging.getLogger(__name__)
T = TypeVar("T")


class Settlements:
    """Decides when an activation may end (:meth:`may_settle`) and delivers every settlement
    notice: the child's own when it settles, a ``lost`` one when its host went away.

    One activation gets one notice, whichever node writes it: every notice is written under
    the idempotency key of the child's activation."""

    def __init__(
        self,
        *,
        store: SessionStore,
        residency: Residency,
        admission: AdmissionLedger,
        children: ChildLedger,
        acceptor: Acceptor,
        placement: Placement,
        writer: OutageTolerantWriter,
        work: DetachedWork,
        changes: ChangeSignal,
        attempts: int,
        backoff: timedelta,
    ) -> None:
        self._store = store
        self._residency = residency
        self._admission = admission
        self._children = children
        self._acceptor = acceptor
        self._placement = placement
        self._writer = writer
        self._work = work
        self._changes = changes
        self._attempts = attempts
        self._backoff = backoff.total_seconds()

    def may_settle(self, agent: Agent) -> bool:
        """Whether ``agent``'s activation may end now: no send holds it and (docs/adr/0004) no
        child of it is live, so that child's messages and notice can always reach it."""
        session = agent.session_id
        if agent.halted:
            # Its subtree was closed: it takes nothing more, so a send waiting for it holds it
            # no longer. That send goes to the session's next activation (or is refused).
            return not self._children.has_live(session)
        return self._admission.may_settle(session) and not self._children.has_live(session)

    async def settled(self, agent: Agent, settlement: Settlement | None) -> None:
        """``agent``'s activation ended: its parent gets the notice while the activation is
        still held, then the activation is released (whoever sees the key vanish without a
        notice knows the host went away)."""
        session = agent.session_id
        parent = agent.header.parent_session
        clean = False
        try:
            if settlement is not None and parent is not None:
                notice = SettlementNoticeEntry(
                    child_session=session,
                    child_activation=agent.activation.activation_id,
                    child_kind=agent.header.kind,
                    outcome=settlement.outcome,
                    terminal_output=settlement.terminal_output,
                    detail=settlement.detail,
                    trace=settlement.trace,
                    output_json=settlement.output_json,
                )
                telemetry.settled(notice.outcome.value, notice.child_kind.value)
                await self.notify(parent, notice)
            clean = True
        finally:
            # A notice that could not be delivered stays owed: the activation's held marker
            # stays, and whoever finishes it (this node, or a sweep) delivers it (ADR 0043).
            await self._residency.release(agent.activation, clean=clean)
            self._residency.forget(agent)
            if parent is not None:
                self._child_settled(parent, session, agent.activation.activation_id, noticed=clean)

    async def left_over_turn_lost(self, agent: Agent, activation: Activation) -> None:
        """``agent`` found a turn of its earlier ``activation`` unended: that activation was
        lost with its host. Its parent gets the ``lost`` notice, once."""
        parent = agent.header.parent_session
        if parent is None or self._children.noticed(activation.activation_id):
            return
        notice = derived_notice(agent.header, activation, agent.records)
        if notice is None:
            return
        telemetry.settled(notice.outcome.value, notice.child_kind.value)
        await self.notify(parent, notice)
        self._children.note_noticed(parent, (activation.activation_id,))

    async def waiting_out_outages(self, read: Callable[[], Awaitable[T]], what: str) -> T:
        """``read()``, again after each registry or log-store outage until it answers, as the
        notice's own write waits: a host lost during an outage still gets its ``lost`` notice
        (found by the fault run's database kill, issue 18). Ends when this node stops."""
        delay = self._writer.first_delay
        while True:
            try:
                return await read()
            except WAITED_OUT as away:
                _log.warning("reading %s waits: %s", what, away)
            delay = await self._writer.pause(delay, f"reading {what} waited")

    async def notify(
        self, parent: SessionId, notice: SettlementNoticeEntry, *, handed: bool = False
    ) -> None:
        """Deliver ``notice`` to ``parent`` wherever it is: durable at the parent either way; a
        live parent is steered with it, an absent one reads it on its next activation
        (docs/adr/0003). A second notice of the same child activation writes nothing.

        While the registry is away the notice waits and is written when it answers (under its
        key, so a write whose answer was lost is found, not repeated): a child that completed
        must not be reported ``lost`` for an outage its node outlived. The wait ends when this
        node stops (it fenced itself: then its children's activations are lost indeed)."""
        delay = self._writer.first_delay
        while True:
            try:
                return await self._deliver(parent, notice, handed=handed)
            except WAITED_OUT as away:
                _log.warning("%s: notice of %s waits: %s", parent, notice.child_session, away)
            delay = await self._writer.pause(delay, f"the notice of {notice.child_session} waited")

    async def _deliver(
        self, parent: SessionId, notice: SettlementNoticeEntry, *, handed: bool
    ) -> None:
        key = IdempotencyKey(principal=f"notice:{parent}", key=notice.child_activation)
        for attempt in range(self._attempts):
            if attempt:
                # Residency moved under us: back off, then trust etcd, not the watch-fed view.
                await asyncio.sleep(self._backoff * 2 ** min(attempt, 6))
            agent = self._residency.agent(parent)
            if agent is not None and agent.state is not AgentState.SETTLED:
                if self._children.noticed(notice.child_activation):
                    return  # a retry of a notice this node already delivered
                # Like a send's acceptance, the delivery runs to completion once it began: a
                # caller that goes away (the child's host died mid-call) must not leave a
                # durable notice that its parent never reads and a "lost" one after it.
                await self._admission.reserve(parent).hand_to(
                    self._work, functools.partial(self._accept, agent, notice, key)
                )
                return
            if agent is not None:
                await agent.wait_released()
                continue
            # A notice handed here by another node's placement is taken here if the parent is
            # absent: placed again, it could be handed on for ever.
            elsewhere = await self._placement.elsewhere(parent, place=not handed, fresh=attempt > 0)
            if elsewhere is not None:
                hand_off = functools.partial(self._hand_notice, parent=parent, notice=notice)

                try:
                    # Keyed (a second copy writes nothing), so it may be routed again: a
                    # frozen or cut-off host is given up on once its lease, and with it the
                    # parent's activation, is gone, not at the call's deadline.
                    await self._placement.follow(parent, elsewhere, hand_off, keyed=True)
                except (PeerUnavailable, ActivationFenced, TargetElsewhere, DeadlineExceeded):
                    continue  # that node no longer hosts the parent: look again
                return
            # Absent, and placed here: it is woken to read the notice now, not left for
            # whoever speaks to it next (nobody might: ADR 0043).
            try:
                with self._admission.reserve(parent) as reservation:
                    woken, _ = await self._residency.resident(parent, None, key)
                    await reservation.hand_to(
                        self._work, functools.partial(self._accept, woken, notice, key)
                    )
            except AlreadyAccepted:
                return  # accepted already (by an earlier try whose answer was lost)
            except TargetElsewhere:
                continue  # another node won the parent meanwhile: deliver there
            except TreeClosed:
                # Its subtree is stopped: durable, unread, for its first activation after
                # the subtree is reopened.
                await self._append_absent(parent, notice, key)
            return
        raise ActivationFenced(f"{parent}: kept changing residency while a notice was delivered")

    async def _append_absent(
        self, parent: SessionId, notice: SettlementNoticeEntry, key: IdempotencyKey
    ) -> None:
        try:
            await self._store.append(
                parent, notice, writer=None, idempotency=(key, _notice_acceptance(key, None))
            )
        except ActivationFenced:
            return  # resident again meanwhile: it reads the notice once reopened and written

    async def _hand_notice(
        self, node: NodeId, *, parent: SessionId, notice: SettlementNoticeEntry
    ) -> None:
        await self._placement.router.deliver_notice(node, parent, notice)

    async def _accept(
        self,
        parent: Agent,
        notice: SettlementNoticeEntry,
        key: IdempotencyKey,
        reservation: Reservation,
    ) -> None:
        acceptance = _notice_acceptance(key, parent)
        await self._acceptor.accept(
            parent, notice, DeliveryKind.STEERED, key, acceptance, reservation
        )
        self._child_settled(parent.session_id, notice.child_session, notice.child_activation)

    def _child_settled(
        self, parent: SessionId, child: SessionId, activation: ActivationId, *, noticed: bool = True
    ) -> None:
        """``child``'s ``activation`` ended: live no more; ``noticed`` when its notice was
        delivered (else it is still owed, and whoever finishes the activation delivers it)."""
        if noticed:
            self._children.settled(parent, child, activation)
        else:
            self._children.ended(parent, child, activation)
        parent_agent = self._residency.agent(parent)
        if parent_agent is not None:
            parent_agent.poke()
        self._changes.changed()


def _notice_acceptance(key: IdempotencyKey, parent: Agent | None) -> Acceptance:
    """What a notice's idempotency record remembers. Its fingerprint is the child activation
    alone, so a second notice for it (``lost`` after ``completed``, or the other way round)
    is a duplicate of the first, not a conflict."""
    return Acceptance(
        target=SessionId(key.principal.removeprefix("notice:")),
        seq=0,
        target_activation=ActivationId("") if parent is None else parent.activation.activation_id,
        kind=DeliveryKind.STEERED,
        fingerprint=f"notice {key.key}",
    )
