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

- ``mcp-kill`` (issue 30): SIGKILL a fault MCP server (:mod:`~dsh_mesh.testing.fault_mcp_server`)
  in the middle of a call, found by its busy marker (waiting up to 15 s for a call in flight);
  the call it was serving is answered with an error, the next use starts the server again;
- ``db-read-only`` (issue 30): make the cluster's database read-only for 1.5 leases (as a
  standby is before its promotion), ending every connection so the nodes' pools reconnect into
  read-only sessions, then writable again, ending them once more. Meanwhile every write is
  refused: the nodes answer ``REGISTRY_UNAVAILABLE`` and running turns wait at their step
  boundary; nothing ends a node.

For ``kill``, ``cut``, ``pause`` and ``etcd-cut`` the driver times the failover: from the fault
until a root the stricken node hosted accepts a prompt through another node (a cold resume
elsewhere). ``db-kill``, ``etcd-cut`` and ``db-read-only`` need a bed with a database host
(the default).

Only ``kill`` ends a node process. The driver watches the others (:meth:`FaultDriver.watch`):
a node process that ends without the driver ending it is recorded in :attr:`FaultDriver.deaths`,
which the history checker counts as a violation (whatever the faults, no node may die of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from dsh_mesh.core import MeshError, SessionId
from dsh_mesh.testing._history import Outcome
from dsh_mesh.testing._proxy import TcpProxy
from dsh_mesh.testing._testbed import BedCluster, MultiHostBed
from dsh_mesh.testing._workload import Workload
from dsh_mesh.testing.fault_mcp_server import forget, servers_mid_call

FAULT_KINDS: tuple[str, ...] = (
    "kill",
    "cut",
    "pause",
    "etcd-member",
    "etcd-cluster",
    "slow-link",
    "db-kill",
    "etcd-cut",
    "mcp-kill",
    "db-read-only",
)
"""Every fault the driver knows, by name."""


_MID_CALL_WAIT = 15.0
"""Seconds ``mcp-kill`` waits for a fault MCP server to be in a call."""
_WATCH_EVERY = 0.25


class FaultDriver:
    """Injects faults into ``cluster`` on ``bed`` while ``workload`` runs; counts them in
    :attr:`injected` and records failover times (seconds) in :attr:`failovers`. ``mcp_busy``
    is the directory of the fault MCP servers' busy markers (the nodes' ``DSH_FAULT_MCP_DIR``;
    None: ``mcp-kill`` kills nothing)."""

    def __init__(
        self,
        bed: MultiHostBed,
        cluster: BedCluster,
        workload: Workload,
        *,
        ttl: float,
        proxy: TcpProxy | None = None,
        log: list[str] | None = None,
        mcp_busy: Path | None = None,
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
        self.mcp_busy = mcp_busy
        self.mcp_kills_mid_call = 0
        """Fault MCP servers the driver killed with a call in flight."""
        self.deaths: list[str] = []
        """Node processes that ended without the driver ending them, one line each."""
        self._ended: set[int] = set()
        """Pids of the node processes the driver ended on purpose."""
        self._mourned: set[int] = set()
        self.failed_failovers = 0
        """Fail-over probes no node acknowledged in time."""
        self._read_only = False

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
        else:
            # Not a violation (the checker judges the history), but a fail-over that did not
            # come is worth a line of its own: without it the run only looks slower.
            self.failed_failovers += 1
            reason = "" if send.reason is None else f" ({send.reason.value})"
            self._note(
                f"failover of {root} off {avoid}: none within 30 s, {send.outcome.value}{reason}"
            )

    async def _kill(self) -> None:
        node, root = await self._victim()
        self._note(f"kill {node} (hosting {root})")
        self._ended.add(self.cluster[node].pid)
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
        self._note("the database is back")
        await self._recovered(since=time.monotonic())

    async def _recovered(self, *, since: float) -> None:
        """Prompt a root and note how long after ``since`` it took the prompt."""
        if self.workload.roots:
            root = self.workload.rng.choice(self.workload.roots)
            probe = f"Recovery probe {secrets.token_hex(4)}"
            send = await self.workload.prompt(root, probe, within=30.0)
            if send.outcome is Outcome.ACKED:
                self._note(f"{root} took a prompt {time.monotonic() - since:.2f} s after")

    async def _db_read_only(self) -> None:
        database = self.cluster.database
        if database is None:
            return
        self._note(f"make the database {database} read-only")
        self._read_only = True
        try:
            await self.bed.set_read_only(database, True)
            await asyncio.sleep(self.ttl * 1.5)
        finally:
            await self.bed.set_read_only(database, False)
            self._read_only = False
        self._note("the database is writable again")
        await self._recovered(since=time.monotonic())

    async def _mcp_kill(self) -> None:
        busy = self.mcp_busy
        if busy is None:
            return
        deadline = time.monotonic() + _MID_CALL_WAIT
        # A marker file is all there is to wait for: no event to await.
        while not (pids := servers_mid_call(busy)) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if not pids:
            self._note(f"no fault MCP server was in a call for {_MID_CALL_WAIT:g} s; none killed")
            return
        pid = pids[0]  # not a seeded choice: which server is busy is the cluster's timing
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            self.mcp_kills_mid_call += 1
            self._note(f"killed fault MCP server pid {pid} mid-call")
        forget(busy, pid)

    async def _slow_link(self) -> None:
        if self.proxy is None:
            return
        self._note("slow the link to the fronted node")
        self.proxy.shape(delay=0.03, jitter=0.02, loss=0.05)
        try:
            await asyncio.sleep(self.ttl * 2)
        finally:
            self.proxy.shape(delay=0.0, jitter=0.0, loss=0.0)

    def check_nodes(self) -> None:
        """Record in :attr:`deaths` each node process that has ended without the driver ending
        it (once each), with its exit status and its log's last lines."""
        for node in self.cluster:
            code = node.exit_code
            if code is None:
                continue
            pid = node.pid
            if pid in self._ended or pid in self._mourned:
                continue
            self._mourned.add(pid)
            last = " | ".join(line for line in node.log_tail(5).splitlines() if line.strip())
            death = f"{node.node_id} (pid {pid}) exited with status {code}; its log ends: {last}"
            self.deaths.append(death)
            self._note(f"a node died unbidden: {death}")

    async def watch(self, stop: asyncio.Event) -> None:
        """Check the nodes (:meth:`check_nodes`) every quarter second until ``stop`` is set."""
        while not stop.is_set():
            self.check_nodes()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _WATCH_EVERY)
        self.check_nodes()

    async def heal(self) -> None:
        """Undo anything left: hosts restored (also from an isolation from etcd), the database
        (running and writable), etcd members and nodes running. A node found dead that the
        driver did not kill is recorded in :attr:`deaths` first."""
        self.check_nodes()
        await asyncio.to_thread(self.bed.restore_all)
        if self.bed.database is not None and not self.bed.database.running:
            await asyncio.to_thread(self.bed.restart_database)
        if self._read_only and self.cluster.database is not None:
            await self.bed.set_read_only(self.cluster.database, False)
            self._read_only = False
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
