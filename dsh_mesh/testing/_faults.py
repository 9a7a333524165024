"""The fault driver: breaks a running bed cluster in every way the mesh promises to survive.

Each fault is undone before the next begins, and the driver measures what it can on the way:

- ``kill``: SIGKILL a node, then start it again;
- ``cut``: cut a host off the network for longer than a lease, then restore it (its node finds
  its lease gone and fences itself);
- ``pause``: SIGSTOP a node past its lease, then SIGCONT (it must fence itself, not write);
- ``etcd-member``: crash one etcd member, then start it again;
- ``etcd-cluster``: stop every etcd member (the whole registry is away: sends are refused as
  unavailable, running turns wait at their next step boundary), then start them all;
- ``slow-link``: shape the TCP proxy in front of one node to delay and drop, then clear it.

For ``kill``, ``cut`` and ``pause`` the driver times the failover: from the fault until a root
the stricken node hosted accepts a prompt through another node (a cold resume elsewhere).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from collections.abc import Sequence

from dsh_mesh.core import MeshError, SessionId
from dsh_mesh.testing._history import Outcome
from dsh_mesh.testing._proxy import TcpProxy
from dsh_mesh.testing._testbed import BedCluster, MultiHostBed
from dsh_mesh.testing._workload import Workload

FAULT_KINDS: tuple[str, ...] = (
    "kill",
    "cut",
    "pause",
    "etcd-member",
    "etcd-cluster",
    "slow-link",
)
"""Every fault the driver knows, by name."""


class FaultDriver:
    """Injects faults into ``cluster`` on ``bed`` while ``workload`` runs; counts them in
    :attr:`injected` and records failover times (seconds) in :attr:`failovers`."""

    def __init__(
        self,
        bed: MultiHostBed,
        cluster: BedCluster,
        workload: Workload,
        *,
        ttl: float,
        proxy: TcpProxy | None = None,
        log: list[str] | None = None,
    ) -> None:
        self.bed = bed
        self.cluster = cluster
        self.workload = workload
        self.ttl = ttl
        self.proxy = proxy
        self.injected: Counter[str] = Counter()
        self.failovers: list[float] = []
        self.stuck = 0
        """Times the workload found no node to make a new root for two minutes."""
        self.log = log if log is not None else []

    async def inject(self, kind: str) -> None:
        """Inject one fault of ``kind`` and undo it."""
        start = time.monotonic()
        await getattr(self, "_" + kind.replace("-", "_"))()
        self.injected[kind] += 1
        self._note(f"{kind} done in {time.monotonic() - start:.1f} s")

    def _note(self, text: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {text}")

    async def _victim(self) -> tuple[str, SessionId | None]:
        """A running node, preferably one hosting a root, and that root."""
        rng = self.workload.rng
        homes: dict[str, SessionId] = {}
        for root in self.workload.roots:
            try:
                activation = await self.workload.reader.activation(root)
            except MeshError:
                continue
            if activation is not None:
                homes.setdefault(activation.node_id, root)
        running = self.workload.live_nodes()
        hosting = sorted(n for n in homes if n in running)
        node = rng.choice(hosting or running)
        return node, homes.get(node)

    async def _failover(self, root: SessionId | None, *, avoid: str, since: float) -> None:
        if root is None:
            return
        send = await self.workload.prompt(
            root, f"Failover probe {secrets.token_hex(4)}", within=30.0, avoid=avoid
        )
        if send.outcome is Outcome.ACKED:
            took = time.monotonic() - since
            self.failovers.append(took)
            self._note(f"failover of {root} off {avoid}: {took:.2f} s")

    async def _kill(self) -> None:
        node, root = await self._victim()
        self._note(f"kill {node} (hosting {root})")
        self.cluster[node].kill()
        since = time.monotonic()
        self.workload.forget_channel(node)
        await self._failover(root, avoid=node, since=since)
        await asyncio.to_thread(self.cluster[node].start)
        self.workload.forget_channel(node)

    async def _cut(self) -> None:
        node, root = await self._victim()
        host = self.cluster.host_of(node).name
        self._note(f"cut host {host} ({node}, hosting {root})")
        await asyncio.to_thread(self.bed.cut, host)
        since = time.monotonic()
        try:
            await self._failover(root, avoid=node, since=since)
            await asyncio.sleep(max(0.0, since + 1.5 * self.ttl - time.monotonic()))
        finally:
            await asyncio.to_thread(self.bed.restore, host)

    async def _pause(self) -> None:
        node, root = await self._victim()
        self._note(f"pause {node} (hosting {root})")
        process = self.cluster[node]
        process.pause()
        since = time.monotonic()
        try:
            await self._failover(root, avoid=node, since=since)
            await asyncio.sleep(max(0.0, since + 1.5 * self.ttl - time.monotonic()))
        finally:
            process.resume()

    async def _etcd_member(self) -> None:
        name = self.workload.rng.choice(sorted(self.bed.etcd))
        self._note(f"crash etcd member {name}")
        await asyncio.to_thread(self.bed.kill_etcd, name)
        await asyncio.sleep(self.ttl)
        await asyncio.to_thread(self.bed.start_etcd, name)

    async def _etcd_cluster(self) -> None:
        members = sorted(self.bed.etcd)
        self._note("stop every etcd member")
        for name in members:
            await asyncio.to_thread(self.bed.stop_etcd, name)
        await asyncio.sleep(self.ttl * 1.5)
        await asyncio.to_thread(_start_all, self.bed, members)
        self._note("etcd is back")

    async def _slow_link(self) -> None:
        if self.proxy is None:
            return
        self._note("slow the link to the fronted node")
        self.proxy.shape(delay=0.03, jitter=0.02, loss=0.05)
        try:
            await asyncio.sleep(self.ttl * 2)
        finally:
            self.proxy.shape(delay=0.0, jitter=0.0, loss=0.0)

    async def heal(self) -> None:
        """Undo anything left: hosts restored, etcd members and nodes running."""
        await asyncio.to_thread(self.bed.restore_all)
        stopped = [name for name, member in self.bed.etcd.items() if not member.running]
        if stopped:
            await asyncio.to_thread(_start_all, self.bed, stopped)
        for node in self.cluster:
            node.resume()
            if not node.running:
                await asyncio.to_thread(node.start)
                self.workload.forget_channel(node.node_id)
        if self.proxy is not None:
            self.proxy.shape(delay=0.0, jitter=0.0, loss=0.0)


def _start_all(bed: MultiHostBed, names: Sequence[str]) -> None:
    """Start members together (one alone has no quorum to be healthy), then wait for each."""
    for name in names:
        bed.etcd[name].start()
    for name in names:
        bed.etcd[name].wait_healthy(30.0)
