"""The fault driver: breaks a running bed cluster in every way the mesh promises to survive.

Each fault is undone before the next begins, and the driver measures what it can on the way:

- ``kill``: SIGKILL a node, then start it again;
- ``cut``: cut a host off the network for longer than a lease, then restore it (its node finds
  its lease gone and fences itself);
- ``pause``: SIGSTOP a node past its lease, then SIGCONT (it must fence itself, not write);
- ``etcd-member``: crash one etcd member, then start it again;
- ``etcd-cluster``: stop every etcd member (the whole registry is away: sends are refused as
  unavailable, running turns wait at their next step boundary), then start them all;
- ``slow-link``: shape the TCP proxy in front of one node to delay and drop, then clear it;
- ``db-kill``: SIGKILL the PostgreSQL server of the bed's database host (every backend with
  it), wait a lease TTL, and start it again on the same data and port. Meanwhile the log store
  answers ``REGISTRY_UNAVAILABLE``: sends and prompts are refused as unavailable (or left in
  doubt, if their commit was cut off) and running turns wait at their next write; the nodes
  keep their leases (etcd is up). The driver then times how long until a root accepts a prompt;
- ``etcd-cut``: cut the host of a node hosting a root off from every host but the database
  host, for longer than a lease, then restore it. The node loses its etcd quorum and its
  peers, its lease lapses and its sessions resume elsewhere, while it still reaches
  PostgreSQL: the zombie of ADR 0026, whose appends the successor's fence must refuse.

For ``kill``, ``cut``, ``pause`` and ``etcd-cut`` the driver times the failover: from the fault
until a root the stricken node hosted accepts a prompt through another node (a cold resume
elsewhere). ``db-kill`` and ``etcd-cut`` need a bed with a database host (the default).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence

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
    "db-kill",
    "etcd-cut",
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
        await self._cut_off(host, self.bed.cut, node=node, root=root)

    async def _etcd_cut(self) -> None:
        node, root = await self._victim()
        host = self.cluster.host_of(node).name
        self._note(f"cut host {host} from etcd, not from the database ({node}, hosting {root})")
        await self._cut_off(host, self.bed.isolate_from_etcd, node=node, root=root)

    async def _cut_off(
        self, host: str, cut: Callable[[str], None], *, node: str, root: SessionId | None
    ) -> None:
        """``cut(host)`` for 1.5 leases, timing the failover of ``root`` off ``node``."""
        await asyncio.to_thread(cut, host)
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

    async def _db_kill(self) -> None:
        self._note("crash the database")
        await asyncio.to_thread(self.bed.kill_database)
        try:
            await asyncio.sleep(self.ttl)
        finally:
            await asyncio.to_thread(self.bed.restart_database)
        back = time.monotonic()
        self._note("the database is back")
        if self.workload.roots:
            root = self.workload.rng.choice(self.workload.roots)
            probe = f"Recovery probe {secrets.token_hex(4)}"
            send = await self.workload.prompt(root, probe, within=30.0)
            if send.outcome is Outcome.ACKED:
                self._note(f"{root} took a prompt {time.monotonic() - back:.2f} s after")

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
        """Undo anything left: hosts restored (also from an isolation from etcd), the database,
        etcd members and nodes running."""
        await asyncio.to_thread(self.bed.restore_all)
        if self.bed.database is not None and not self.bed.database.running:
            await asyncio.to_thread(self.bed.restart_database)
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
