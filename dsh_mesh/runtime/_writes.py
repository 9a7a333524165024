"""An agent's own writes, carried through an etcd outage."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import timedelta

from dsh_mesh.agent import Agent
from dsh_mesh.core import (
    INBOUND_TYPES,
    Entry,
    NodeFenced,
    Record,
    RegistryUnavailable,
    SessionId,
    StoreRefused,
)
from dsh_mesh.runtime._store import SessionStore

_log = logging.getLogger(__name__)


WAITED_OUT = (RegistryUnavailable, StoreRefused)
"""What an agent's own write waits out: an outage of etcd or the log store, and a refusal of
the log store that an operator must fix (a revoked privilege): the agent goes on by itself
once the store accepts again, and the node never needs a restart."""


class OutageTolerantWriter:
    """Writes that wait out a registry outage (or a refusal of the log store) instead of
    failing the turn.

    The back-off starts at ``backoff`` and doubles up to ``backoff_max``; each pause ends in
    :class:`NodeFenced` once ``stopped()`` holds (the node fenced itself or shut down), so no
    wait outlives the activation it writes for."""

    def __init__(
        self,
        store: SessionStore,
        *,
        backoff: timedelta,
        backoff_max: timedelta,
        stopped: Callable[[], bool],
        node_id: str,
    ) -> None:
        self._store = store
        self._backoff = backoff.total_seconds()
        self._backoff_max = backoff_max.total_seconds()
        self._stopped = stopped
        self._node_id = node_id

    @property
    def first_delay(self) -> float:
        """The first pause of a write that meets an outage, in seconds."""
        return self._backoff

    async def append(self, agent: Agent, entry: Entry) -> Record:
        """The agent's own write. While the registry is away the turn waits here, at its step
        boundary, and goes on when it answers again; a write whose answer was lost is looked
        up, not written twice. The wait ends with the activation: fenced (another took over)
        or :class:`NodeFenced` (this node stopped)."""
        session = agent.session_id
        writer = agent.activation.activation_id
        known = agent.records[-1].seq if agent.records else 0
        delay = self._backoff
        while True:
            try:
                record, _ = await self._store.append(session, entry, writer=writer)
                return record
            except WAITED_OUT as away:
                _log.warning("%s: waiting at a step boundary: %s", session, away)
            while True:
                delay = await self.pause(delay, f"{session} waited")
                try:
                    landed = await self._landed(session, entry, after_seq=known)
                except WAITED_OUT:
                    continue
                if landed is not None:
                    return landed
                break

    async def pause(self, delay: float, waiting: str) -> float:
        """One back-off of a write waiting out a registry outage: sleep ``delay`` seconds, then
        raise :class:`NodeFenced` if the node stopped meanwhile (``waiting`` says what waited);
        else return the next, doubled delay (at most the configured maximum)."""
        await asyncio.sleep(delay)
        if self._stopped():
            raise NodeFenced(f"node {self._node_id} stopped while {waiting}")
        return min(delay * 2, self._backoff_max)

    async def _landed(self, session: SessionId, entry: Entry, *, after_seq: int) -> Record | None:
        """The record of ``entry`` if a write of it that lost its answer landed after
        ``after_seq``. Only the agent itself writes entries that are not inbound, one at a
        time, so an equal one there is this one."""
        for record in await self._store.read(session, after_seq=after_seq):
            if not isinstance(record.entry, INBOUND_TYPES) and record.entry == entry:
                return record
        return None
