"""Memory per idle resident agent: N roots, each created with an empty task through
``MeshControl.CreateRootSession``, stay resident and idle in ONE node process (never settled, no
model call, no transcript). Per agent: the growth of the node's resident set (``VmRSS``) over
its value before them, divided by N. The steps are cumulative, in one process."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

from bench._cluster import node_processes, unthrottled
from bench._common import Bed
from bench._report import Figure
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.node import stop_timeout

NODE = "node-a"
_IN_FLIGHT = 64
_WARMUP_ROOTS = 50
_LEASE_TTL = 10.0
"""Creating tens of thousands of roots keeps the node busy: a longer lease than the default, so
its keepalive never lapses meanwhile."""
TARGET_KIB = 8.0
"""Issue 35's target at 100,000 idle agents on one node (ADR 0047)."""
_DRAIN_AT_MOST = 120.0
"""How long the section waits for the drain it times before it kills the node."""


def vm_rss_kib(pid: int) -> int:
    """The process's resident set size in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


async def measure_memory(bed: Bed) -> None:
    """KiB per idle resident agent at each step of ``sizes.agents``."""
    sizes, report = bed.sizes, bed.report
    settle = 0.3 if sizes.name == "quick" else 1.5
    per_agent: dict[int, float] = {}
    with node_processes(
        bed,
        "IDLE_ROOTS",
        (NODE,),
        lease_ttl=_LEASE_TTL,
        env={"DSH_NAMESPACES_FILE": str(unthrottled(bed))},
    ) as cluster:
        try:
            pid = cluster[NODE].pid
            async with cluster.channel(NODE) as channel:
                stub = mesh_pb2_grpc.MeshControlStub(channel)
                metadata = cluster.metadata("bench")

                async def create(count: int) -> None:
                    remaining = iter(range(count))

                    async def creator() -> None:
                        for _ in remaining:
                            await stub.CreateRootSession(
                                mesh_pb2.CreateRootSessionRequest(
                                    preset="lead", initial_task="", request_id=secrets.token_hex(8)
                                ),
                                metadata=metadata,
                                timeout=60,
                            )

                    await asyncio.gather(*(creator() for _ in range(min(_IN_FLIGHT, count))))

                # Warm-up: the first calls allocate what every later call reuses (channels,
                # caches, code paths); those roots are not counted.
                await create(_WARMUP_ROOTS)
                await asyncio.sleep(settle)
                baseline = vm_rss_kib(pid)
                created = 0
                for total in sizes.agents:
                    started = time.perf_counter()
                    await create(total - created)
                    elapsed = time.perf_counter() - started
                    created = total
                    await asyncio.sleep(settle)
                    rss = vm_rss_kib(pid)
                    # A few dozen agents can grow the set less than the allocator gives back
                    # meanwhile: a fall is noise at that size, kept in the run's data below and
                    # shown as no growth (a figure is never negative).
                    per_agent[total] = max(0.0, (rss - baseline) / total)
                    report.run.setdefault("memory", {})[str(total)] = {
                        "rss_kib": rss,
                        "baseline_rss_kib": baseline,
                        "create_seconds": round(elapsed, 2),
                    }
            # The drain of every agent created (ADR 0046): SIGTERM until the process exits,
            # within the time `dsh-mesh up` waits for a node (its grace, here 0, the drain's
            # release budget and a margin to exit).
            started = time.perf_counter()
            cluster[NODE].terminate(timeout=_DRAIN_AT_MOST)
            drained = time.perf_counter() - started
        finally:
            cluster[NODE].kill()  # a no-op once it has exited
    curve = report.curve(
        "memory", "memory per idle resident agent", "idle resident agents", "KiB", log_x=True
    )
    for total, kib in per_agent.items():
        report.add(Figure(f"idle resident agent, {total} on one node: memory each", kib, "KiB"))
        curve.add("RSS growth / agents", total, kib)
        curve.add(f"target: {TARGET_KIB:g} KiB", total, TARGET_KIB)
    most = max(per_agent)
    report.add(
        Figure(
            f"drain of {most + _WARMUP_ROOTS} idle resident agents on one node, SIGTERM to exit",
            drained,
            "s",
            None,
            stop_timeout(0.0),
            "lower",
        )
    )
    report.add(
        Figure(
            f"idle resident agent memory each, {most} on one node (transcript excluded)",
            per_agent[most],
            "KiB",
            None,
            TARGET_KIB,
            "lower",
        )
    )
