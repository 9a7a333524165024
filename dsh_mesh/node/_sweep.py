"""The sweep: a node finishes what ended activations left, with nobody prompting (ADR 0043).

Two kinds of activation ended without a clean release: those this node's manager released
so (a notice it could not deliver, a driver that failed), and those of a lease that died (its
node killed, fenced or drained). Every ``sweep_interval`` the node finishes its own, and the
markers of each dead lease for which it is the chosen live node (the highest hash of lease
and node id among the nodes its directory lists: one node sweeps a lease, another takes over
if it dies). Finishing one is :meth:`ContinuationManager.recover`: the notice, then a resume
if the session needs a reader. A marker goes only once that is done. Sessions created and
never activated are started the same way once two sweeps in a row found them so.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Iterable
from datetime import timedelta

from dsh_mesh.core import Activation, MeshError, NodeId
from dsh_mesh.registry import HeldIndex, Holder
from dsh_mesh.runtime import ContinuationManager

_log = logging.getLogger(__name__)


class Sweep:
    """One node's sweep of ended activations, run while it holds a lease."""

    def __init__(
        self,
        held: HeldIndex,
        *,
        node_id: NodeId,
        interval: timedelta,
        live_nodes: Callable[[], Iterable[NodeId]],
    ) -> None:
        self._held = held
        self._node_id = node_id
        self._interval = interval.total_seconds()
        self._live_nodes = live_nodes
        self._unstarted: dict[bytes, int] = {}
        """Unstarted sessions seen by the last sweep, by key, with their revisions."""

    async def run(self, manager: ContinuationManager, lease: int) -> None:
        """Sweep every interval until cancelled; a sweep that fails is tried again next time."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.once(manager, lease)
            except MeshError as failure:
                _log.warning("sweep: not finished this time (%s)", failure)

    async def once(self, manager: ContinuationManager, lease: int) -> int:
        """One sweep; returns how many ended activations it finished."""
        finished = 0
        for ended in manager.unfinished():
            if await self._finish(manager, ended):
                marker = await self._held.marker_of(lease, ended)
                if marker is not None:
                    await self._held.forget(marker)
                manager.finished(ended)
                finished += 1
        for holder in await self._held.holders():
            if holder.lease != lease and self._chosen(f"{holder.lease:x}"):
                finished += await self._sweep_dead(manager, holder)
        return finished + await self._start_unstarted(manager)

    async def _start_unstarted(self, manager: ContinuationManager) -> int:
        """Start the sessions found unstarted by two sweeps in a row, unchanged (the one
        before gave their creator a sweep interval to activate them)."""
        seen, self._unstarted = self._unstarted, {}
        started = 0
        for unstarted in await self._held.unstarted():
            if not self._chosen(unstarted.session):
                continue
            if seen.get(unstarted.key) != unstarted.revision:
                self._unstarted[unstarted.key] = unstarted.revision
                continue
            try:
                done = await manager.start_unstarted(unstarted.session)
            except MeshError as failure:
                _log.warning("sweep: %s not started yet: %s", unstarted.session, failure)
                done = False
            if done:
                await self._held.forget(unstarted)
                started += 1
            else:
                self._unstarted[unstarted.key] = unstarted.revision
        return started

    def _chosen(self, name: str) -> bool:
        """Whether this node sweeps what ``name`` names: the live node ranked first for it."""
        live = set(self._live_nodes()) | {self._node_id}
        return max(live, key=lambda node: _rank(name, node)) == self._node_id

    async def _sweep_dead(self, manager: ContinuationManager, holder: Holder) -> int:
        if await self._held.alive(holder.lease):
            return 0
        finished = 0
        while True:
            markers = await self._held.markers(holder.lease)
            done = 0
            for marker in markers:
                ended = marker.activation
                if ended is None:
                    _log.warning("sweep: dropping a marker that does not decode: %r", marker.key)
                elif not await self._finish(manager, ended):
                    continue
                await self._held.forget(marker)
                done += 1
            finished += done
            if not markers or not done:
                break
        if await self._held.retire(holder):
            _log.info("sweep: lease %x of %s swept", holder.lease, holder.node_id)
        return finished

    async def _finish(self, manager: ContinuationManager, ended: Activation) -> bool:
        """``manager.recover(ended)``; a failure leaves it for the next sweep."""
        try:
            return await manager.recover(ended)
        except MeshError as failure:
            _log.warning("sweep: %s not finished yet: %s", ended, failure)
            return False


def _rank(name: str, node: NodeId) -> bytes:
    """Rendezvous hashing: each (name, node) pair's rank, the same on every node."""
    return hashlib.sha256(f"{name}/{node}".encode()).digest()
