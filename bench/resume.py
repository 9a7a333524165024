"""Cold resume of an absent child by a message from its parent's node: after the child settled
cleanly, and after SIGKILL of the node hosting it (against the lease TTL)."""

from __future__ import annotations

import asyncio
import statistics
import time

from bench._cluster import (
    absent,
    children,
    create_root,
    in_process_node,
    node_processes,
    resident,
)
from bench._common import SQLITE, Bed
from bench._measure import percentile
from bench._report import Figure
from bench.failover import measure_root_failover
from bench.floors import hop_and_append
from dsh_mesh.core import ActivationId, AgentMessageEntry, DeliveryKind, MeshError, SessionId
from dsh_mesh.testing import MeshReader

_RETRY_SECONDS = 0.01
_CRASH_DEADLINE = 30.0
_AFTER_THE_KILL = frozenset(
    {DeliveryKind.COLD_RESUMED, DeliveryKind.STEERED, DeliveryKind.STARTED_TURN}
)
_SETTLE_MARGIN = 0.05
"""After etcd shows the child absent: time for the sender node's directory to see it too."""


async def measure_clean_resume(bed: Bed) -> None:
    """A continuable child settles (absent, its activation released); its parent's node sends
    to it: the time to acceptance includes placing it, winning its activation, loading its
    transcript and the append. Repeated: after each message the child answers and settles."""
    sizes, report = bed.sizes, bed.report
    samples: list[float] = []
    with node_processes(bed, "SETTLING_CHILD", ("node-b", "node-c")) as cluster:
        async with (
            in_process_node(cluster.settings) as node,
            MeshReader(cluster.settings) as reader,
        ):
            root = await create_root(node)
            [child] = await children(reader, root.session_id, 1)
            manager = node.manager()
            attempts = 0
            while len(samples) < sizes.cold_resumes:
                attempts += 1
                if attempts > 3 * sizes.cold_resumes + 5:
                    raise RuntimeError(f"only {len(samples)} of the sends were cold resumes")
                await absent(reader, child)
                await asyncio.sleep(_SETTLE_MARGIN)
                started = time.perf_counter()
                delivery = await asyncio.wait_for(
                    manager.send_message(
                        root, child, f"Again ({attempts}).", idempotency_key=f"resume-{attempts}"
                    ),
                    sizes.call_timeout,
                )
                elapsed = (time.perf_counter() - started) * 1000
                if delivery.kind is DeliveryKind.COLD_RESUMED:
                    samples.append(elapsed)
    txn = bed.floors.txn[1].p50
    log = bed.floors.log[SQLITE]
    # What a cold resume must do durably: win the activation (one etcd txn), hand the message
    # to the winner (one hop) and raise the session's fence and append the message there (two
    # log-store writes, ADR 0026). Reading the transcript and building the agent come on top.
    floor = txn + log.hop[1].p50 + log.alone[1].p50
    p50 = statistics.median(samples)
    report.add(
        Figure("cold resume after a clean settle / one etcd txn", p50, "ms", txn),
        Figure(
            f"cold resume after a clean settle / (one etcd txn + {hop_and_append(SQLITE)}"
            f" + one {SQLITE} append)",
            p50,
            "ms",
            floor,
            5.0,
            "lower",
        ),
        Figure("cold resume after a clean settle: p99", percentile(samples, 0.99), "ms", floor),
    )
    curve = report.curve("resume", "cold resume, one sample per send", "sample", "ms")
    for index, sample in enumerate(samples, start=1):
        curve.add("after a clean settle", index, sample)
        curve.add("floor: 5 x (etcd txn + hop + 2 appends)", index, 5 * floor)
    report.run["cold_resumes"] = len(samples)


async def measure_crash_resume(bed: Bed) -> None:
    """SIGKILL of the node hosting a child in mid-turn; from the kill, its parent's node keeps
    sending to it (one retry every 10 ms, the same idempotency key) until the message is
    accepted by a new activation of the child on a live node: the send's own cold resume, or
    the sweep's that came first (an unended turn needs a reader, ADR 0043). Also timed: the
    kill until the dead activation is gone from etcd (the lease expired). Then a root's host
    killed while a client retries its prompt (:mod:`bench.failover`)."""
    to_live: list[float] = []
    to_expiry: list[float] = []
    ttl = 0.0
    for rep in range(bed.sizes.crashes):
        ttl, live, gone = await _crash_once(bed, rep)
        to_live.append(live)
        to_expiry.append(gone)
    target = ttl + 0.5
    report = bed.report
    report.add(
        Figure(
            f"SIGKILL of its host until the child is live elsewhere (lease TTL {ttl:g} s)",
            statistics.median(to_live),
            "s",
            None,
            target,
            "lower",
        ),
        Figure("SIGKILL until live elsewhere: worst run", max(to_live), "s"),
        Figure("SIGKILL until the dead activation left etcd", statistics.median(to_expiry), "s"),
    )
    curve = report.curve("crash", "after SIGKILL of the child's host", "run", "s")
    for index, (live, gone) in enumerate(zip(to_live, to_expiry, strict=True), start=1):
        curve.add("kill -> live elsewhere", index, live)
        curve.add("kill -> activation gone", index, gone)
        curve.add(f"floor: lease TTL + 0.5 s = {target:g} s", index, target)
    report.run["crash_runs"] = [round(v, 3) for v in to_live]
    await measure_root_failover(bed)


async def _crash_once(bed: Bed, rep: int) -> tuple[float, float, float]:
    """One crash: returns the lease TTL, the seconds from the kill until the child is live
    elsewhere and until its dead activation left etcd."""
    with node_processes(bed, "CRASHING_CHILD", ("node-b", "node-c")) as cluster:
        async with (
            in_process_node(cluster.settings) as node,
            MeshReader(cluster.settings) as reader,
        ):
            root = await create_root(node)
            [child] = await children(reader, root.session_id, 1)
            await reader.wait_for(
                lambda: reader.transcript(root.session_id),
                lambda records: any(isinstance(r.entry, AgentMessageEntry) for r in records),
                what="the child's first message",
            )
            doomed = await resident(reader, child)
            manager = node.manager()
            killed = time.perf_counter()
            cluster[doomed.node_id].kill()
            expiry = asyncio.create_task(_gone(reader, child, doomed.activation_id, killed))
            try:
                while True:
                    try:
                        delivery = await asyncio.wait_for(
                            manager.send_message(
                                root, child, "Resume.", idempotency_key=f"after-crash-{rep}"
                            ),
                            bed.sizes.call_timeout,
                        )
                        break
                    except MeshError:
                        if time.perf_counter() - killed > _CRASH_DEADLINE:
                            raise
                        await asyncio.sleep(_RETRY_SECONDS)
                live = time.perf_counter() - killed
                gone = await asyncio.wait_for(expiry, _CRASH_DEADLINE)
            finally:
                expiry.cancel()
            now = await resident(reader, child)
            # The parent's send cold-resumes the child, or a live node's sweep did first
            # (ADR 0043: an unended turn needs a reader) and the send steered into it.
            if (
                delivery.kind not in _AFTER_THE_KILL
                or now.node_id == doomed.node_id
                or now.activation_id == doomed.activation_id
            ):
                raise RuntimeError(
                    f"after the kill: {delivery.kind.value} on {now.node_id}, "
                    "not a new activation on a live node"
                )
        return cluster.settings.lease_ttl, live, gone


async def _gone(
    reader: MeshReader, child: SessionId, activation: ActivationId, since: float
) -> float:
    """Seconds from ``since`` until the child's activation is no longer ``activation``."""
    while True:
        current = await reader.activation(child)
        if current is None or current.activation_id != activation:
            return time.perf_counter() - since
        await asyncio.sleep(_RETRY_SECONDS)
