"""Warm sends to resident targets: on the sender's node, on another node (both also with the
cluster's log store in PostgreSQL), spread over 1, 2 or 3 nodes, and with many sessions
registered in etcd. Each is reported against the etcd floors and against its log store's.

Every send is made by the in-process sender node (``node-a``) exactly as an agent's
``send_message`` tool makes it, and each carries its own idempotency key, so each is a durable
acceptance. A cross-node send is also timed "hop only": the benchmark acting as ``node-a`` calls
the target's node directly (what ``python -m bench.warm_send`` times), which leaves out what the
sender's own node does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import UTC, datetime

import grpc
from aetcd import rpc

from bench._cluster import (
    SENDER,
    children,
    create_root,
    in_process_node,
    node_processes,
    resident,
)
from bench._common import POSTGRES, SQLITE, Bed
from bench._measure import Load, Processes, run_load, run_loads
from bench._report import Figure
from bench.floors import append_alone, etcd_singles, hop_and_append, log_floors, record_loads
from bench.scenarios import FANOUT_CHILDREN
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentRef,
    NodeId,
    SessionHeader,
    SessionId,
    SessionKind,
)
from dsh_mesh.registry import Etcd, Keys
from dsh_mesh.registry._codec import encode_activation, encode_header
from dsh_mesh.registry._etcd import delete, put
from dsh_mesh.registry._keys import prefix_end
from dsh_mesh.testing import LocalCluster, MeshReader

SAME_NODE = "warm send, same node"
CROSS_NODE = "warm send, cross-node"
HOP_ONLY = "warm send, cross-node, hop only"
_OTHER_NODES = ("node-b", "node-c", "node-d")
_OPERATIONS_PER_TXN = 126
"""Puts per filler transaction (etcd allows 128 operations in one by default)."""
_FILLER = "bench-filler-"
FILLER_NODE = NodeId("bench-fillers")
"""The node resident fillers are held on: no node process, so no send ever reaches one."""
_WRITERS = 4
_BENCH = "bench process"


async def measure_same_node(bed: Bed) -> None:
    """Warm sends from a root to its resident child on the same node: floor one etcd txn, and
    one append to the cluster's log store (SQLite, ``LocalCluster``'s default)."""
    sizes, floors = bed.sizes, bed.floors
    loads = await _same_node_loads(bed, None)
    record_loads(
        bed.report,
        SAME_NODE,
        loads,
        latency_floor={n: floors.txn[n].p50 for n in sizes.levels},
        throughput_floor={n: floors.txn[n].throughput for n in sizes.levels},
    )
    _same_node_against_log(bed, SQLITE, loads, SAME_NODE)


async def _same_node_loads(bed: Bed, log_store: str | None) -> list[Load]:
    """Warm same-node sends at every load level, on a cluster whose log store is
    ``log_store`` (None: a SQLite file)."""
    sizes = bed.sizes
    with node_processes(bed, "RESIDENT_CHILD", (), log_store=log_store) as cluster:
        async with (
            in_process_node(cluster.settings) as node,
            MeshReader(cluster.settings) as reader,
        ):
            root = await create_root(node)
            [child] = await children(reader, root.session_id, 1)
            host = (await resident(reader, child)).node_id
            if host != SENDER:
                raise RuntimeError(f"the child went to {host}, not to the sender's node")
            manager = node.manager()

            async def send(i: int) -> None:
                await manager.send_message(root, child, f"m{i}", idempotency_key=f"k{i}")

            return await run_loads(
                send,
                levels=sizes.levels,
                calls=sizes.calls,
                warmup=sizes.warmup,
                hung_after=sizes.call_timeout,
                watch={f"{_BENCH} (node-a: sender and target)": None, "etcd": bed.etcd_pid},
            )


def _same_node_against_log(bed: Bed, backend: str, loads: list[Load], label: str) -> None:
    """Same-node sends against the floors of the log store they append to."""
    log = bed.floors.log[backend]
    by_level = {load.in_flight: load for load in loads}
    most = max(bed.sizes.levels)
    bed.report.add(
        Figure(
            f"{label}: p50 / {append_alone(backend)} p50",
            by_level[1].p50,
            "ms",
            log.alone[1].p50,
        ),
        Figure(
            f"{label}: throughput at {most} in flight / {backend} appends per second at"
            f" {most} in flight",
            by_level[most].throughput,
            "calls/s",
            log.alone[most].throughput,
            better="higher",
        ),
    )


async def measure_cross_node(bed: Bed) -> None:
    """Warm sends from a root on node-a to its resident child on a node process: floor one
    gRPC hop plus one etcd txn, and one gRPC hop plus one append to the cluster's log store
    (SQLite). Then the same target timed hop only."""
    sizes, floors, report = bed.sizes, bed.floors, bed.report
    loads, hop_only = await _cross_node_loads(bed, None, hop_only=True)
    hop_floor = {n: floors.echo[n].p50 + floors.txn[n].p50 for n in sizes.levels}
    echo_rate = {n: floors.echo[n].throughput for n in sizes.levels}
    record_loads(report, CROSS_NODE, loads, latency_floor=hop_floor, throughput_floor=echo_rate)
    record_loads(report, HOP_ONLY, hop_only, latency_floor=hop_floor, throughput_floor=echo_rate)
    for n, floor in hop_floor.items():
        report.curves["latency"].add("floor: echo + txn", n, floor)
    by_level = {load.in_flight: load for load in loads}
    most = max(sizes.levels)
    report.add(
        Figure(
            "warm cross-node send p50 / (one gRPC hop + one etcd txn)",
            by_level[1].p50,
            "ms",
            floors.hop_and_txn_p50,
            target=1.3,
            better="lower",
        ),
        Figure(
            f"warm send throughput, {most} in flight to one node / bare echo",
            by_level[most].throughput,
            "calls/s",
            floors.echo[most].throughput,
        ),
        # Every accepted send is one durable append on the target's node: since the
        # transcripts left etcd (ADR 0026) that append costs the target's own CPU, which the
        # bare echo does not do. Its floor is the echo whose handler makes that append.
        Figure(
            f"warm send throughput, {most} in flight to one node / ({hop_and_append(SQLITE)})",
            by_level[most].throughput,
            "calls/s",
            floors.log[SQLITE].hop[most].throughput,
            target=0.7,
            better="higher",
        ),
    )
    _cross_node_against_log(bed, SQLITE, loads, CROSS_NODE)


async def _cross_node_loads(
    bed: Bed, log_store: str | None, *, hop_only: bool
) -> tuple[list[Load], list[Load]]:
    """Warm cross-node sends at every load level, on a cluster whose log store is
    ``log_store`` (None: a SQLite file); with ``hop_only``, then the same timed hop only
    (else no such loads)."""
    sizes = bed.sizes
    with node_processes(bed, "RESIDENT_CHILD", _OTHER_NODES[:2], log_store=log_store) as cluster:
        async with (
            in_process_node(cluster.settings) as node,
            MeshReader(cluster.settings) as reader,
        ):
            root = await create_root(node)
            [child] = await children(reader, root.session_id, 1)
            host = (await resident(reader, child)).node_id
            manager = node.manager()

            async def send(i: int) -> None:
                await manager.send_message(root, child, f"m{i}", idempotency_key=f"k{i}")

            loads = await run_loads(
                send,
                levels=sizes.levels,
                calls=sizes.calls,
                warmup=sizes.warmup,
                hung_after=sizes.call_timeout,
                watch={
                    f"{_BENCH} (node-a: sender)": None,
                    f"{host} (target)": cluster[host].pid,
                    "etcd": bed.etcd_pid,
                },
            )
            if not hop_only:
                return loads, []
            watch = {
                f"{_BENCH} (client as node-a)": None,
                f"{host} (target)": cluster[host].pid,
                "etcd": bed.etcd_pid,
            }
            return loads, await _hop_only(cluster, host, root, child, bed, watch)


def _cross_node_against_log(bed: Bed, backend: str, loads: list[Load], label: str) -> None:
    """Cross-node sends against the floor of one gRPC hop plus one append to their log store."""
    log = bed.floors.log[backend]
    by_level = {load.in_flight: load for load in loads}
    bed.report.add(
        Figure(
            f"{label}: p50 / ({hop_and_append(backend)})",
            by_level[1].p50,
            "ms",
            log.hop[1].p50,
        )
    )
    latency = bed.report.curves["latency"]
    for n, load in log.hop.items():
        latency.add(f"floor: {hop_and_append(backend)}", n, load.p50)


async def measure_postgres_hot_path(bed: Bed) -> None:
    """Warm same-node and cross-node sends with the cluster's log store in PostgreSQL (fsync
    on), against PostgreSQL's own floors: one gRPC hop plus one append, and the appends per
    second one store object makes at 64 in flight."""
    sizes, floors, report = bed.sizes, bed.floors, bed.report
    await log_floors(bed, POSTGRES)
    same = await _same_node_loads(bed, await bed.postgres_store("same-node"))
    cross, _ = await _cross_node_loads(bed, await bed.postgres_store("cross-node"), hop_only=False)
    same_label, cross_label = f"{SAME_NODE} ({POSTGRES})", f"{CROSS_NODE} ({POSTGRES})"
    log = floors.log[POSTGRES]
    record_loads(
        report,
        same_label,
        same,
        latency_floor={n: log.alone[n].p50 for n in sizes.levels},
        throughput_floor={n: log.alone[n].throughput for n in sizes.levels},
    )
    record_loads(
        report,
        cross_label,
        cross,
        latency_floor={n: log.hop[n].p50 for n in sizes.levels},
        throughput_floor={n: floors.echo[n].throughput for n in sizes.levels},
    )
    _same_node_against_log(bed, POSTGRES, same, same_label)
    _cross_node_against_log(bed, POSTGRES, cross, cross_label)


async def _hop_only(
    cluster: LocalCluster,
    host: str,
    root: AgentRef,
    child: SessionId,
    bed: Bed,
    watch: Processes,
) -> list[Load]:
    """The benchmark acts as node-a and calls the child's node itself: one hop, then the
    target node's authorization and append."""
    sender = mesh_pb2.AgentRef(session_id=root.session_id, activation_id=root.activation_id)
    metadata = cluster.metadata(SENDER)
    address = cluster[host].address
    assert address is not None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = mesh_pb2_grpc.AgentMeshStub(channel)

        async def send(i: int) -> None:
            await stub.SendMessage(
                mesh_pb2.SendMessageRequest(
                    sender=sender, agent_id=child, message=f"h{i}", idempotency_key=f"h{i}"
                ),
                metadata=metadata,
                timeout=10,
            )

        return await run_loads(
            send,
            levels=bed.sizes.levels,
            calls=bed.sizes.calls,
            warmup=bed.sizes.warmup,
            hung_after=bed.sizes.call_timeout,
            watch=watch,
        )


async def measure_node_scaling(bed: Bed) -> None:
    """The same load (``scaling_in_flight`` sends in flight, round-robin over the
    FANOUT_CHILDREN children of one root on node-a) to children resident on 1, 2 or 3 node
    processes."""
    sizes, report = bed.sizes, bed.report
    in_flight = sizes.scaling_in_flight
    echo = bed.floors.echo[in_flight]
    curve = report.curve(
        "nodes",
        f"throughput, {in_flight} in flight over {FANOUT_CHILDREN} targets",
        "nodes hosting the targets",
        "calls/s",
    )
    for count in sizes.nodes:
        load, hosts = await _spread_load(bed, count)
        label = f"warm sends over {FANOUT_CHILDREN} targets on {count} node(s) ({', '.join(hosts)})"
        report.add(
            Figure(
                f"{label}: throughput at {in_flight} in flight",
                load.throughput,
                "calls/s",
                echo.throughput,
                better="higher",
            ),
            Figure(f"{label}: p50 at {in_flight} in flight", load.p50, "ms"),
        )
        curve.add("warm sends", count, load.throughput)
        curve.add(f"floor: bare echo at {in_flight} in flight", count, echo.throughput)


async def _spread_load(bed: Bed, count: int) -> tuple[Load, list[str]]:
    """The scaling load on a cluster whose root's children live on ``count`` node processes;
    returns it and the nodes that host them."""
    with node_processes(bed, "FANOUT", _OTHER_NODES[:count]) as cluster:
        async with (
            in_process_node(cluster.settings) as node,
            MeshReader(cluster.settings) as reader,
        ):
            root = await create_root(node)
            targets = await children(reader, root.session_id, FANOUT_CHILDREN)
            hosts = sorted({str((await resident(reader, t)).node_id) for t in targets})
            manager = node.manager()

            async def send(i: int) -> None:
                target = targets[i % len(targets)]
                await manager.send_message(root, target, f"m{i}", idempotency_key=f"k{i}")

            load = await run_load(
                send,
                calls=bed.sizes.scaling_calls,
                in_flight=bed.sizes.scaling_in_flight,
                warmup=bed.sizes.warmup,
                hung_after=bed.sizes.call_timeout,
            )
    return load, hosts


async def measure_registered_sessions(bed: Bed) -> None:
    """Warm cross-node sends, one at a time, while more and more sessions are registered in
    etcd (headers written directly, in batched transactions, under the cluster's prefix)."""
    sizes, report = bed.sizes, bed.report
    results: dict[int, Load] = {}
    etcd_loads: dict[int, tuple[Load, Load]] = {}
    write_seconds: dict[str, float] = {}
    report.run["sessions_write_seconds"] = write_seconds
    with node_processes(bed, "RESIDENT_CHILD", _OTHER_NODES[:2]) as cluster:
        async with (
            in_process_node(cluster.settings) as node,
            MeshReader(cluster.settings) as reader,
            Etcd(cluster.settings.etcd_config()) as etcd,
        ):
            root = await create_root(node)
            [child] = await children(reader, root.session_id, 1)
            await resident(reader, child)
            template = await reader.header(root.session_id)
            assert template is not None
            keys = Keys(cluster.settings.key_prefix.encode())
            manager = node.manager()

            async def send(i: int) -> None:
                await manager.send_message(root, child, f"m{i}", idempotency_key=f"k{i}")

            registered = 2  # the root and its child
            for total in sizes.sessions:
                started = time.perf_counter()
                await register_fillers(etcd, keys, template, registered, total)
                write_seconds[str(total)] = round(time.perf_counter() - started, 2)
                registered = max(registered, total)
                await asyncio.sleep(0.5)  # let etcd's backend commit settle
                results[total] = await run_load(
                    send,
                    calls=sizes.session_calls,
                    in_flight=1,
                    warmup=sizes.warmup,
                    hung_after=sizes.call_timeout,
                )
                # etcd itself at this size: does what etcd does grow, or what the nodes do?
                etcd_loads[total] = await etcd_singles(
                    etcd, calls=min(500, sizes.session_calls), hung_after=sizes.call_timeout
                )
    baseline = sizes.sessions[0]
    curve = report.curve(
        "sessions",
        "warm cross-node send by sessions registered",
        "sessions registered in etcd",
        "ms",
        log_x=True,
    )
    for total, load in results.items():
        report.add(
            Figure(
                f"warm cross-node send, {total} sessions registered: p50",
                load.p50,
                "ms",
                None if total == baseline else results[baseline].p50,
            ),
            Figure(f"warm cross-node send, {total} sessions registered: p99", load.p99, "ms"),
        )
        txn, read = etcd_loads[total]
        report.add(
            Figure(f"one etcd txn, {total} sessions registered: p50", txn.p50, "ms"),
            Figure(f"one etcd read (Range), {total} sessions registered: p50", read.p50, "ms"),
        )
        curve.add("warm send p50", total, load.p50)
        curve.add("warm send p99", total, load.p99)
        curve.add("one etcd txn p50", total, txn.p50)
        curve.add("one etcd read p50", total, read.p50)
    most = max(results)
    report.add(
        Figure(
            f"warm cross-node send p50 at {most} sessions / at {baseline}",
            results[most].p50,
            "ms",
            results[baseline].p50,
            target=1.1,
            better="lower",
        )
    )


async def register_fillers(
    etcd: Etcd,
    keys: Keys,
    template: SessionHeader,
    start: int,
    end: int,
    *,
    lease: int | None = None,
) -> None:
    """Write filler roots ``start`` .. ``end - 1`` with no transcript, as
    ``EtcdSessionStore.create_header`` writes a root without entries: its header (the
    template's, re-keyed, created now), its listing key, its namespace's listing and roots keys
    and its tree-index key. With ``lease``, each is also resident (issue 34): its activation key, on
    a node of its own (``bench-fillers``, which no send reaches), and its namespace's census
    key, both under ``lease``, as a node's win writes them. As many per transaction as fit
    etcd's 128 operations. Transcripts are in the log store, not etcd."""
    per_txn = _OPERATIONS_PER_TXN // (5 if lease is None else 7)
    batches = iter(range(start, end, per_txn))

    async def writer() -> None:
        for first in batches:
            operations = []
            for number in range(first, min(end, first + per_txn)):
                session = SessionId(f"{_FILLER}{number:07d}")
                created = datetime.now(UTC)
                header = dataclasses.replace(
                    template, session_id=session, parent_session=None, created_at=created
                )
                operations.append(put(keys.header(session), encode_header(header)))
                operations.append(put(keys.listed(created, session), b""))
                operations.append(
                    put(keys.namespace_listed(header.namespace, created, session), b"")
                )
                operations.append(put(keys.member(session, created, session), b""))
                operations.append(put(keys.namespace_root(header.namespace, created, session), b""))
                if lease is not None:
                    resident = Activation(
                        session_id=session,
                        activation_id=ActivationId(f"a-{session}"),
                        node_id=FILLER_NODE,
                    )
                    operations.append(
                        put(keys.activation(session), encode_activation(resident), lease=lease)
                    )
                    operations.append(
                        put(
                            keys.namespace_live_member(header.namespace, session),
                            b"",
                            lease=lease,
                        )
                    )
            await etcd.txn([], operations)

    await asyncio.gather(*(writer() for _ in range(_WRITERS)))


async def register_children(
    etcd: Etcd, keys: Keys, parent: SessionHeader, start: int, end: int
) -> None:
    """Write filler children ``start`` .. ``end - 1`` of the root ``parent``, absent, as
    ``EtcdSessionStore.create_header`` writes a child without entries: its header, its listing
    keys, its place in its root's tree index (valued with its parent) and its root record."""
    per_txn = _OPERATIONS_PER_TXN // 5
    root = parent.session_id
    for first in range(start, end, per_txn):
        operations = []
        for number in range(first, min(end, first + per_txn)):
            session = SessionId(f"{_FILLER}c{number:07d}")
            created = datetime.now(UTC)
            header = dataclasses.replace(
                parent,
                session_id=session,
                kind=SessionKind.CONTINUABLE_CHILD,
                parent_session=root,
                created_at=created,
            )
            operations += [
                put(keys.header(session), encode_header(header)),
                put(keys.listed(created, session), b""),
                put(keys.namespace_listed(header.namespace, created, session), b""),
                put(keys.member(root, created, session), root.encode()),
                put(keys.root_of(session), root.encode()),
            ]
        await etcd.txn([], operations)


async def remove_fillers(etcd: Etcd, keys: Keys) -> None:
    """Delete every filler :func:`register_fillers` wrote (headers, listing keys and tree
    indexes), so a later size times the same cluster with its own sessions only."""
    fillers = SessionId(_FILLER)
    for prefix in (keys.header(fillers), keys.tree(fillers).removesuffix(b"/")):
        end = prefix_end(prefix)
        await etcd.txn(
            [],
            [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=prefix, range_end=end))],
        )
    for listing in (keys.listing, keys.prefix + b"ns/", keys.prefix + b"ns-roots/"):
        start: bytes | None = None
        while True:  # in pages (an unpaged read of 100k keys is over gRPC's limit)
            listed = await etcd.get_prefix(listing, start=start, limit=1000, keys_only=True)
            doomed = [delete(kv.key) for kv in listed.kvs if fillers.encode() in kv.key]
            for first in range(0, len(doomed), 100):
                await etcd.txn([], doomed[first : first + 100])
            if not listed.more:
                break
            start = listed.kvs[-1].key + b"\0"
