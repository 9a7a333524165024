"""The control plane's reads of one small tree while more and more agents are resident.

One node process runs the ``FANOUT`` scenario: a root with six resident children (a tree of
seven sessions, all stalled in a model call). Resident filler roots are then registered
straight into etcd under the cluster's prefix (``warm.register_fillers``: the keys
``EtcdSessionStore.create_header`` writes for a root without entries, and the activation and
namespace-census keys a win writes, under a lease the bench holds: issue 34) until
``control_sessions`` are resident, and at each size these ``MeshControl`` calls to the node
are timed, one at a time, over one channel:

- ``ListAgents`` of the tree (``root_session_id``: its seven sessions);
- ``WatchSession`` of the tree (``tree = true``): from the call until its first event (the
  residency of a watched session), then the stream is cancelled;
- ``GetSession`` of the root: its first page (the server's default page size);
- ``ListAgents`` of every session: its first page (100);
- ``ListAgents`` of the namespace the tree and the fillers are in: its first page (100);
- ``ListAgents`` of roots, as the web view's root list asks: its first page (50) and the count
  (ADR 0046).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

from bench._cluster import children, node_processes
from bench._common import Bed, Sizes
from bench._measure import Load, bounded, cpu_seconds
from bench._report import Figure
from bench.scenarios import FANOUT_CHILDREN
from bench.warm import register_fillers, remove_fillers
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.registry import Etcd, Keys
from dsh_mesh.testing import MeshReader, create_root

NODE = "node-b"
LIST_TREE = "ListAgents of a 7-session tree"
WATCH = "WatchSession of a 7-session tree, until its first event"
GET = "GetSession of the root, first page"
LIST_ALL = "ListAgents of every session, first page"
LIST_NAMESPACE = "ListAgents of one namespace, first page"
LIST_ROOTS = "ListAgents of roots, first page of 50 and the count (the web view's root list)"
TARGETED = (LIST_TREE, WATCH, GET, LIST_ALL, LIST_NAMESPACE, LIST_ROOTS)
"""The reads whose p50 at the most sessions has a target (against the same at the fewest)."""
_WARMUP = 10
_MAINTENANCE = timedelta(minutes=5)
"""The bench's own etcd calls' deadline: a compaction or a defragmentation of a million
revisions takes etcd longer than a node's call deadline."""
_LEASE_TTL = 30.0
"""The node's lease: longer than a defragmentation stalls etcd, so it keeps its activations."""
_QUIET_SHARE = 0.05
"""CPU seconds per second under which a process counts as quiet."""
_QUIET_AT_MOST = 120.0
_FILLER_LEASE = timedelta(hours=2)
"""The lease resident fillers are held under: longer than any run, revoked at its end."""


async def measure_control(bed: Bed) -> None:
    """p50 and p99 of each read at each of ``sizes.control_sessions``."""
    sizes, report = bed.sizes, bed.report
    results: dict[int, dict[str, Load]] = {}
    write_seconds: dict[str, float] = {}
    quiet_seconds: dict[str, float] = {}
    report.run["control_write_seconds"] = write_seconds
    report.run["control_quiet_seconds"] = quiet_seconds
    with node_processes(bed, "FANOUT", (NODE,), lease_ttl=_LEASE_TTL) as cluster:
        async with (
            MeshReader(cluster.settings) as reader,
            Etcd(
                dataclasses.replace(cluster.settings.etcd_config(), call_timeout=_MAINTENANCE)
            ) as etcd,
            cluster.channel(NODE) as channel,
        ):
            root = await create_root(cluster, on=NODE, task="Lead.", preset="lead")
            tree = await children(reader, root, FANOUT_CHILDREN)
            template = await reader.header(root)
            assert template is not None
            keys = Keys(cluster.settings.key_prefix.encode())
            reads = _reads(
                mesh_pb2_grpc.MeshControlStub(channel),
                cluster.metadata("bench"),
                root,
                template.namespace,
            )
            listed = await mesh_pb2_grpc.MeshControlStub(channel).ListAgents(
                mesh_pb2.ListAgentsRequest(root_session_id=root),
                metadata=cluster.metadata("bench"),
                timeout=10,
            )
            if len(listed.agents) != 1 + len(tree):
                raise RuntimeError(f"ListAgents of the tree gave {len(listed.agents)} sessions")
            registered = 1 + len(tree)
            lease = await etcd.grant(_FILLER_LEASE)  # revoked at the end: they all end at once
            for total in sizes.control_sessions:
                started = time.perf_counter()
                await register_fillers(etcd, keys, template, registered, total, lease=lease)
                write_seconds[str(total)] = round(time.perf_counter() - started, 2)
                registered = max(registered, total)
                # As etcd's auto-compaction would (docs/operations.md), at every size alike:
                # the history of this run's other sections and of the registration is
                # compacted away, so each size is timed on an etcd holding what it holds now.
                await _compact(etcd)
                # Let etcd and the node settle after the burst of writes (etcd's backend
                # commits and Go heap, the node's caches following 700,000 keys): the figure
                # is what a read costs with this many sessions registered, not while they are
                # being registered. At least the same wait at every size, then until both are
                # quiet (the wait is in the report).
                await asyncio.sleep(sizes.control_settle)
                quiet_seconds[str(total)] = await _quiet(
                    [pid for pid in (bed.etcd_pid, cluster[NODE].pid) if pid is not None]
                )
                results[total] = await _time(reads, sizes)
            # The smallest size again, at the end: a figure that moved as much between the
            # two timings of it moved with the run (the processes' age, the machine), not
            # with the sessions registered.
            await etcd.revoke(lease)
            await remove_fillers(etcd, keys)
            # Until a compaction, etcd's ranges still walk the deleted keys (the cache's tail
            # reads among them).
            await _compact(etcd)
            await asyncio.sleep(sizes.control_settle)
            quiet_seconds["again"] = await _quiet(
                [pid for pid in (bed.etcd_pid, cluster[NODE].pid) if pid is not None]
            )
            again = await _time(reads, sizes)
    _record(bed, results, again)


async def _compact(etcd: Etcd) -> None:
    """Compact etcd's history up to now and defragment it, as a maintained etcd is
    (docs/operations.md): without it, a section timed after others reads from a database
    grown by their history (about 1.5x slower at every read of this section, measured)."""
    await etcd.compact(int((await etcd.range(b"/")).header.revision), physical=True)
    await etcd.defragment()


async def _quiet(pids: list[int]) -> float:
    """Wait until each of ``pids`` used under ``_QUIET_SHARE`` of a core over one second
    (at most ``_QUIET_AT_MOST``); returns the seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < _QUIET_AT_MOST:
        before = [cpu_seconds(pid) for pid in pids]
        await asyncio.sleep(1.0)
        if all(cpu_seconds(pid) - b < _QUIET_SHARE for pid, b in zip(pids, before, strict=True)):
            break
    return round(time.perf_counter() - started, 1)


async def _time(
    reads: dict[str, Callable[[int], Awaitable[None]]], sizes: Sizes
) -> dict[str, Load]:
    """Each read ``control_calls`` times, one at a time, taking the reads in turn call by call:
    a read timed in a block of its own, first, would take alone whatever the machine still
    does after the writes."""
    for read in reads.values():
        for n in range(_WARMUP):
            await bounded(read, n, sizes.call_timeout)
    samples: dict[str, list[float]] = {name: [] for name in reads}
    spent = dict.fromkeys(reads, 0.0)
    for n in range(sizes.control_calls):
        for name, read in reads.items():
            started = time.perf_counter()
            await bounded(read, n, sizes.call_timeout)
            took = time.perf_counter() - started
            samples[name].append(took * 1000)
            spent[name] += took
    return {name: Load.of(1, samples[name], spent[name]) for name in reads}


def _reads(
    stub: mesh_pb2_grpc.MeshControlStub,
    metadata: tuple[tuple[str, str], ...],
    root: str,
    namespace: str,
) -> dict[str, Callable[[int], Awaitable[None]]]:
    async def list_tree(_: int) -> None:
        await stub.ListAgents(
            mesh_pb2.ListAgentsRequest(root_session_id=root), metadata=metadata, timeout=10
        )

    async def watch(_: int) -> None:
        stream = stub.WatchSession(
            mesh_pb2.WatchSessionRequest(session_id=root, tree=True), metadata=metadata, timeout=10
        )
        try:
            await stream.read()
        finally:
            stream.cancel()

    async def get(_: int) -> None:
        await stub.GetSession(
            mesh_pb2.GetSessionRequest(session_id=root), metadata=metadata, timeout=10
        )

    async def list_all(_: int) -> None:
        await stub.ListAgents(mesh_pb2.ListAgentsRequest(), metadata=metadata, timeout=10)

    async def list_namespace(_: int) -> None:
        await stub.ListAgents(
            mesh_pb2.ListAgentsRequest(namespace=namespace), metadata=metadata, timeout=10
        )

    async def list_roots(_: int) -> None:
        await stub.ListAgents(
            mesh_pb2.ListAgentsRequest(roots_only=True, page_size=50, count=True),
            metadata=metadata,
            timeout=10,
        )

    return {
        LIST_TREE: list_tree,
        WATCH: watch,
        GET: get,
        LIST_ALL: list_all,
        LIST_NAMESPACE: list_namespace,
        LIST_ROOTS: list_roots,
    }


def _record(bed: Bed, results: dict[int, dict[str, Load]], again: dict[str, Load]) -> None:
    report = bed.report
    baseline, most = min(results), max(results)
    curve = report.curve(
        "control",
        "control-plane reads by resident agents (p50)",
        "resident agents (sessions registered, each holding an activation)",
        "ms",
        log_x=True,
    )
    for total, loads in results.items():
        for name, load in loads.items():
            report.add(
                Figure(
                    f"{name}, {total} resident: p50",
                    load.p50,
                    "ms",
                    None if total == baseline else results[baseline][name].p50,
                ),
                Figure(f"{name}, {total} resident: p99", load.p99, "ms"),
            )
            curve.add(name, total, load.p50)
    for name in TARGETED:
        report.add(
            Figure(
                f"{name}: p50 at {most} resident / at {baseline}",
                results[most][name].p50,
                "ms",
                results[baseline][name].p50,
                target=1.1,
                better="lower",
            )
        )
        report.add(
            Figure(
                f"{name}: p50 at {baseline} resident again, at the end / at the start",
                again[name].p50,
                "ms",
                results[baseline][name].p50,
            )
        )
