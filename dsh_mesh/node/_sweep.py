"""The sweep: a node finishes what ended activations left, with nobody prompting (ADR 0043).

Two kinds of activation ended without a clean release: those this node's manager released
so (a notice it could not deliver, a driver that failed), and those of a lease that died (its
node killed, fenced or drained). Every ``sweep_interval`` the node finishes its own, and the
markers of each dead lease for which it is the chosen live node (the highest hash of lease
and node id among the nodes its directory lists: one node sweeps a lease, another takes over
if it dies). Finishing one is :meth:`ContinuationManager.recover`: the notice, then a resume
if the session needs a reader. A marker goes only once that is done. Sessions created and
never activated are started the same way once two sweeps in a row found them so. A resumed
activation whose adoption of its live children failed (etcd away) adopts them again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta

from dsh_mesh.core import MeshError, NodeId
from dsh_mesh.registry import HeldIndex, Holder
from dsh_mesh.runtime import ContinuationManager

_log = logging.getLogger(__name__)

ITEM_TIMEOUT = timedelta(seconds=30)
"""The longest one ended activation may take to finish in a sweep (a notice's parent resumed,
the session resumed): past it, it is left for the next sweep, so that one that cannot be
finished now (its parent's node overloaded, the log store refusing) holds up no other."""


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
        """Sweep every interval until cancelled; a sweep that fails is tried again next time,
        and nothing it meets ends it (a defect is logged with its trace)."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.once(manager, lease)
            except MeshError as failure:
                _log.warning("sweep: not finished this time (%s)", failure)
            except Exception:
                _log.exception("sweep: not finished this time")

    async def once(self, manager: ContinuationManager, lease: int) -> int:
        """One sweep; returns how many ended activations (and unstarted sessions) it
        finished."""
        finished = 0
        await manager.adopt_again()
        for ended in manager.unfinished():
            if await self._item(manager.finish(ended), ended):
                marker = await self._held.marker_of(lease, ended)
                if marker is not None:
                    await self._held.forget(marker)
                manager.finished(ended)
                finished += 1
        for holder in await self._held.holders():
            if holder.lease != lease and self.chooses(f"{holder.lease:x}"):
                finished += await self._sweep_dead(manager, holder)
        return finished + await self._start_unstarted(manager)

    async def _start_unstarted(self, manager: ContinuationManager) -> int:
        """Start the sessions found unstarted by two sweeps in a row, unchanged (the one
        before gave their creator a sweep interval to activate them)."""
        seen, self._unstarted = self._unstarted, {}
        started = 0
        after: bytes | None = None
        while page := await self._held.unstarted(after=after):
            after = page[-1].key
            for unstarted in page:
                if not self.chooses(unstarted.session):
                    continue
                if seen.get(unstarted.key) == unstarted.revision and await self._item(
                    manager.start_unstarted(unstarted.session), unstarted.session
                ):
                    await self._held.forget(unstarted)
                    started += 1
                else:
                    self._unstarted[unstarted.key] = unstarted.revision
        return started

    def chooses(self, name: str) -> bool:
        """Whether this node sweeps what ``name`` names: the live node ranked first for it."""
        live = set(self._live_nodes()) | {self._node_id}
        return max(live, key=lambda node: _rank(name, node)) == self._node_id

    async def _sweep_dead(self, manager: ContinuationManager, holder: Holder) -> int:
        """Finish every marker of ``holder``'s lease if it is dead, page by page (a marker not
        finished now stays, and the pages go on past it); retire the holder once none is
        left."""
        if await self._held.alive(holder.lease):
            return 0
        finished = 0
        after: bytes | None = None
        while markers := await self._held.markers(holder.lease, after=after):
            after = markers[-1].key
            for marker in markers:
                ended = marker.activation
                if ended is None:
                    _log.warning("sweep: dropping a marker that does not decode: %r", marker.key)
                elif not await self._item(manager.recover(ended), ended):
                    continue
                await self._held.forget(marker)
                finished += 1
        if await self._held.retire(holder):
            _log.info("sweep: lease %x of %s swept", holder.lease, holder.node_id)
        return finished

    async def _item(self, finishing: Awaitable[bool], what: object) -> bool:
        """``await finishing``, within :data:`ITEM_TIMEOUT`; a failure or a timeout leaves
        the item for the next sweep (and the sweep goes on with the others)."""
        try:
            async with asyncio.timeout(ITEM_TIMEOUT.total_seconds()):
                return await finishing
        except (MeshError, TimeoutError) as failure:
            _log.warning("sweep: %s not finished yet: %s", what, failure or "timed out")
            return False


def _rank(name: str, node: NodeId) -> bytes:
    """Rendezvous hashing: each (name, node) pair's rank, the same on every node."""
    return hashlib.sha256(f"{name}/{node}".encode()).digest()
