"""Recovery: what an activation that ended without a clean release still owes (ADR 0043).

An activation ends cleanly when its settlement notice was delivered and it left nothing
unread. Any other end (its host killed, fenced or drained, its driver failed) leaves its held
marker in the registry, and whoever finds the end calls :meth:`Recovery.recover`: the parent
gets the notice of that activation, derived from the child's durable transcript, and a session
that still needs a reader is resumed, with nobody prompting it. Both are safe to repeat: the
notice is keyed by the child activation, and a resume races for the session's lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dsh_mesh.core import (
    Activation,
    ActivationId,
    AssistantStepEntry,
    MeshError,
    NodeId,
    Record,
    SessionHeader,
    SessionId,
    SettlementNoticeEntry,
    TargetElsewhere,
    TreeClosed,
    TurnStartedEntry,
    pending_inbound,
    unended_turn,
)
from dsh_mesh.runtime._cache import LruCache
from dsh_mesh.runtime._children import ChildLedger
from dsh_mesh.runtime._notices import derived_notice
from dsh_mesh.runtime._placement import Placement
from dsh_mesh.runtime._residency import Residency
from dsh_mesh.runtime._settlement import Settlements
from dsh_mesh.runtime._store import SessionStore

_log = logging.getLogger(__name__)

_PAGE = 100
"""Records read at a time, from the end back, to find an activation's last turn."""
_PAGES = 20
"""Pages read back at most: an activation whose turn is not among the last 2,000 records ran
none (its successor would have to write that many in the seconds a sweep takes to come)."""
_WAKE_BACKOFF = (2.0, 300.0)
"""Seconds before a session this node woke is woken again, doubling from the first up to the
second: a session whose every activation fails (a defect, a tool that crashes its driver)
is retried, never resumed in a loop."""
_WAKES_KEPT = 4096
"""Sessions whose wake-ups are remembered for their back-off (least recent forgotten)."""


class Recovery:
    """Finishes what ended activations left: their notices and their unread entries."""

    def __init__(
        self,
        *,
        store: SessionStore,
        settlements: Settlements,
        residency: Residency,
        children: ChildLedger,
        placement: Placement,
    ) -> None:
        self._store = store
        self._settlements = settlements
        self._residency = residency
        self._children = children
        self._placement = placement
        self._woken: LruCache[SessionId, tuple[float, float]] = LruCache(_WAKES_KEPT)
        """Per session woken here: its last back-off and when it may be woken again."""

    async def recover(self, ended: Activation) -> bool:
        """Finish what ``ended`` left: its parent gets its notice (if it ran a turn), and its
        session, if absent, is resumed when it still needs a reader: entries nothing read, a
        turn that never ended, or children that are live (and may message it). False when
        ``ended`` is still its session's activation: nothing ended yet."""
        session = ended.session_id
        current = await self._store.current_activation(session, fresh=True)
        if current is not None and current.activation_id == ended.activation_id:
            return False
        header = await self._store.get_header(session)
        if header is None:
            return True  # deleted since (retention): nothing is owed any more
        if header.parent_session is not None and not self._children.noticed(ended.activation_id):
            notice = await self.notice_of(header, ended)
            if notice is not None:
                await self._settlements.notify(header.parent_session, notice)
        if current is None and await self._needs_reader(session):
            return await self._wake(session)
        return True

    async def start(self, session: SessionId) -> bool:
        """A session created and never activated (its creator died, or activating it failed):
        it is resumed if it holds work (its task). False while it is resident now (nothing to
        do yet) or its wake is backing off; True once done, or when it has no header (deleted:
        nothing is owed)."""
        if await self._store.get_header(session) is None:
            return True
        if await self._store.current_activation(session, fresh=True) is not None:
            return False
        if await self._needs_reader(session):
            return await self._wake(session)
        return True

    async def reopened(self, session: SessionId) -> int:
        """The subtree under ``session`` was reopened: each of its absent sessions holding
        what its stop left unread is resumed to read it. Returns how many were."""
        woken = 0
        for member in await self._store.subtree(session):
            if await self._store.current_activation(member, fresh=True) is not None:
                continue
            if await self._needs_reader(member):
                await self._resume_somewhere(member)
                woken += 1
        return woken

    async def activation_ended(self, ended: Activation) -> None:
        """An activation key vanished from the registry. If it was a child of a parent resident
        here and no notice was delivered for it, its host went away (or its notice failed):
        the parent gets the notice of that activation now, without waiting for a sweep."""
        if ended.parent_activation is None or self._children.noticed(ended.activation_id):
            # A root's, or a child's bound to no activation of its parent (its parent was
            # absent when it won): no parent here waits on it, and the sweep finishes what
            # it left. No read for it: a whole node's agents may end at once.
            return
        own = self._residency.agent(ended.session_id)
        if own is not None and own.activation.activation_id == ended.activation_id:
            return  # settling here; it sends its notice itself
        header = await self._store.get_header(ended.session_id)
        if header is None or header.parent_session is None:
            return
        if self._residency.live(header.parent_session) is None:
            return
        notice = await self._settlements.waiting_out_outages(
            lambda: self.notice_of(header, ended), f"the notice of {ended.activation_id}"
        )
        if notice is not None and not self._children.noticed(ended.activation_id):
            await self._settlements.notify(header.parent_session, notice)

    async def notice_of(
        self, child: SessionHeader, activation: Activation
    ) -> SettlementNoticeEntry | None:
        """The notice of ``activation`` of ``child``, as its durable transcript tells it."""
        records = await self._tail_of(child.session_id, activation.activation_id)
        return derived_notice(child, activation, records)

    async def _tail_of(self, session: SessionId, activation: ActivationId) -> list[Record]:
        """The transcript from ``activation``'s last turn and the last assistant text before
        it on, or the last pages read when no turn of it is among them."""

        def enough(tail: list[Record]) -> bool:
            turns = [
                i
                for i, r in enumerate(tail)
                if isinstance(r.entry, TurnStartedEntry) and r.entry.activation_id == activation
            ]
            return bool(turns) and any(
                isinstance(r.entry, AssistantStepEntry) and r.entry.text for r in tail
            )

        return await self._read_back(session, enough)

    async def _read_back(
        self, session: SessionId, enough: Callable[[list[Record]], bool], pages: int = _PAGES
    ) -> list[Record]:
        """The end of ``session``'s transcript, read back a page at a time until ``enough``
        holds of what was read, or ``pages`` were read."""
        last = await self._store.last(session)
        end = 0 if last is None else last.seq
        tail: list[Record] = []
        for _ in range(pages):
            if end <= 0:
                break
            start = max(0, end - _PAGE)
            tail[:0] = await self._store.read(session, after_seq=start, limit=end - start)
            if enough(tail):
                break
            end = start
        return tail

    async def _needs_reader(self, session: SessionId) -> bool:
        """Whether ``session`` holds what only a resident agent reads: entries no step read, a
        turn that never ended, or a live child (it stays available to it, ADR 0004). Read
        from its context, as a cold resume reads it (bounded by compaction)."""
        context = await self._store.read_context(session)
        if pending_inbound(context) or unended_turn(context) is not None:
            return True
        return bool(await self._store.live_children(session))

    async def _wake(self, session: SessionId) -> bool:
        """Resume ``session`` where placement puts it (here when that node cannot be reached).
        Another node winning the race resumed it: that is as good. False (nothing done) while
        the session's last wake from here is too recent (:data:`_WAKE_BACKOFF`)."""
        now = time.monotonic()
        woken = self._woken.get(session)
        if woken is not None and now < woken[1]:
            return False
        delay = _WAKE_BACKOFF[0] if woken is None else min(woken[0] * 2, _WAKE_BACKOFF[1])
        if woken is not None and now > woken[1] + _WAKE_BACKOFF[1]:
            delay = _WAKE_BACKOFF[0]  # quiet for long: start over
        self._woken[session] = (delay, now + delay)
        await self._resume_somewhere(session)
        return True

    async def _resume_somewhere(self, session: SessionId) -> None:
        try:
            elsewhere = await self._placement.elsewhere(session, place=True, fresh=True)
            if elsewhere is not None and elsewhere.activation_id:
                return  # resident again meanwhile
            if elsewhere is not None:
                try:
                    await self._placement.router.activate(NodeId(elsewhere.node_id), session, None)
                    return
                except MeshError as unreachable:
                    _log.warning("%s: %s; resuming it here instead", session, unreachable)
            await self._residency.resume(session)
        except TargetElsewhere:
            return
        except TreeClosed:
            return  # its subtree is stopped: reopening it reads what it holds
        _log.info("%s: resumed to read what its last activation left", session)
