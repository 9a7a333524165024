"""Stopping subtrees (ADR 0031): one node writes the stop, every node applies it.

A stop is durable state in the session store (etcd: ``stops/<session>``), seen by every node
through its watch. The node that makes it applies it at once; each other node applies it when
its watch brings it. Applying cancels every turn of the subtree running on that node; a closed
stop also halts the subtree's agents there (no turn starts, each ends its activation) and from
then on refuses, before anything is accepted, any resume, spawn, prompt or message for a session
under it: so a node that restarts, or missed the stop, does not wake the subtree.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from dsh_mesh.agent import Agent
from dsh_mesh.core import (
    ApprovalRequestEntry,
    IdFactory,
    SessionHeader,
    SessionId,
    SessionUnknown,
    TreeClosed,
    TreeStop,
    TurnId,
)
from dsh_mesh.runtime._cache import ANCESTRY_CACHE_SIZE, LruCache
from dsh_mesh.runtime._denials import deny_absent
from dsh_mesh.runtime._residency import Residency
from dsh_mesh.runtime._store import SessionStore

_log = logging.getLogger(__name__)


class Stops:
    """Owns this node's view of which subtrees are stopped: the stops it applied, and each
    session's chain of ancestors (headers never change, so neither do chains). Every method is
    safe to call concurrently from one event loop."""

    def __init__(
        self,
        *,
        store: SessionStore,
        residency: Residency,
        ids: IdFactory,
        cached: int = ANCESTRY_CACHE_SIZE,
    ) -> None:
        self._store = store
        self._residency = residency
        self._ids = ids
        self._lineages: LruCache[SessionId, tuple[SessionId, ...]] = LruCache(cached)
        """The chains of the last ``cached`` sessions walked (an LRU, ADR 0044)."""
        self._applied: set[str] = set()

    async def stop(
        self, session: SessionId, *, close: bool, reason: str = ""
    ) -> tuple[TreeStop, int]:
        """Stop the subtree under ``session``: durable when this returns, and applied to the
        agents resident here (how many running turns that cancelled comes back with it).
        Idempotent in effect: a second stop cancels whatever runs now again (nothing, after
        a closed one). Raises :class:`SessionUnknown`."""
        stop = TreeStop(
            session_id=session,
            stop_id=self._ids.activation_id(),
            closed=close,
            at=datetime.now(UTC),
            reason=reason,
        )
        await self._store.record_stop(stop)
        cancelled = await self.apply(stop)
        if close:
            await self._deny_waiting(stop)
        return stop, len(cancelled)

    async def _deny_waiting(self, stop: TreeStop) -> None:
        """A closed stop answers, as denied, every approval request of the subtree whose agent
        is absent (a resident one denies its own when its node halts it). Nothing can resume
        such an agent meanwhile (the subtree is closed): the decision is appended with no
        activation, under the request's key, and read when the subtree is reopened and the
        agent goes on."""
        reason = f"the turn was cancelled (stopped: the subtree of {stop.session_id} was stopped"
        reason += f", {stop.reason})" if stop.reason else ")"
        for session, record in await self._store.waiting_in_subtree(stop.session_id):
            assert isinstance(record.entry, ApprovalRequestEntry)
            if await self._store.current_activation(session) is None:
                await deny_absent(self._store, session, record.entry, reason)

    async def reopen(self, session: SessionId) -> bool:
        """Clear the stop of the subtree under ``session``; True when there was one. Its
        sessions take work again; what waited in their transcripts is read by their next
        activation. Idempotent. Raises :class:`SessionUnknown`."""
        if await self._store.get_header(session) is None:
            raise SessionUnknown(session)
        return await self._store.clear_stop(session)

    async def apply(self, stop: TreeStop) -> list[TurnId]:
        """Apply ``stop`` to the agents resident here (once per stop): cancel every running
        turn of its subtree and, when it is closed, halt its agents. Returns the turns
        cancelled."""
        if stop.stop_id in self._applied:
            return []
        self._applied.add(stop.stop_id)
        detail = f"stopped: the subtree of {stop.session_id} was stopped"
        detail += " and closed" if stop.closed else ""
        detail += f" ({stop.reason})" if stop.reason else ""
        cancelled = []
        for agent in self._residency.agents:
            if stop.session_id not in await self._lineage(agent.header):
                continue
            turn = agent.halt(detail) if stop.closed else agent.interrupt(detail)
            if turn is not None:
                cancelled.append(turn)
        if cancelled:
            _log.info("%s: stopped %d running turn(s) here", stop.session_id, len(cancelled))
        return cancelled

    async def closing(self, header: SessionHeader) -> TreeStop | None:
        """The closed stop whose subtree holds ``header``'s session, if any."""
        closed = {s: stop for s, stop in self._store.stops().items() if stop.closed}
        if not closed:
            return None  # the common case: nothing is closed anywhere, nothing to walk
        for session in await self._lineage(header):
            if session in closed:
                return closed[session]
        return None

    async def check_open(self, session: SessionId) -> None:
        """Raise :class:`TreeClosed` when ``session`` is in a closed subtree; return for an
        open one or an unknown one (its caller refuses that as it always did)."""
        if not any(stop.closed for stop in self._store.stops().values()):
            return
        header = await self._store.get_header(session)
        if header is None:
            return
        stop = await self.closing(header)
        if stop is not None:
            raise TreeClosed(
                f"{session} is in the subtree of {stop.session_id}, stopped and closed at"
                f" {stop.at.isoformat(timespec='seconds')}: reopen it first",
                metadata={"stopped": stop.session_id},
            )

    async def is_closed(self, agent: Agent) -> bool:
        """Whether ``agent``'s session is in a closed subtree."""
        return await self.closing(agent.header) is not None

    async def _lineage(self, header: SessionHeader) -> tuple[SessionId, ...]:
        """``header``'s session, its parent, ..., its root: walked up once, then known."""
        walked: list[SessionId] = []
        current: SessionHeader | None = header
        above: tuple[SessionId, ...] = ()
        while current is not None:
            known = self._lineages.get(current.session_id)
            if known is not None:
                above = known
                break
            walked.append(current.session_id)
            parent = current.parent_session
            if parent is None:
                break
            current = await self._store.get_header(parent)
            if current is None:
                raise SessionUnknown(parent)
        for index in range(len(walked) - 1, -1, -1):
            above = (walked[index], *above)
            self._lineages[walked[index]] = above
        return above
