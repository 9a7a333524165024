"""RSS of one node before and after its idle roots passivate (ADR 0044): a measurement, not a
test. ``python -m bench.idle_rss [ROOTS [CYCLES]]`` starts etcd and one node
(``idle_passivate_after`` 60 s), creates ROOTS roots (2,000 by default) with an empty task,
each idle at once, reads the node's ``VmRSS`` once they are resident, waits until the node's
published load is 0 (every one passivated), and reads it again; CYCLES times (3 by default) in
the same process, to tell memory the node keeps for good from memory its allocator keeps for
reuse."""

from __future__ import annotations

import asyncio
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench._cluster import UNTHROTTLED
from bench.memory import vm_rss_kib
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.testing import EtcdServer, LocalCluster, MeshReader

NODE = "node-a"
IDLE_AFTER = 60.0
IN_FLIGHT = 32


async def _measure(roots: int, cycles: int, log_dir: Path) -> None:
    namespaces = log_dir / "namespaces.toml"
    namespaces.write_text(UNTHROTTLED)
    with (
        EtcdServer() as etcd,
        LocalCluster(
            etcd_endpoint=etcd.endpoint,
            scenario="bench.scenarios:IDLE_ROOTS",
            nodes=(NODE,),
            lease_ttl=10.0,
            log_dir=log_dir,
            env={
                "DSH_IDLE_PASSIVATE_AFTER": str(IDLE_AFTER),
                "DSH_NAMESPACES_FILE": str(namespaces),
            },
        ) as cluster,
    ):
        async with MeshReader(cluster.settings) as reader:
            await _run(cluster, reader, roots, cycles)


async def _run(cluster: LocalCluster, reader: MeshReader, roots: int, cycles: int) -> None:
    pid = cluster[NODE].pid
    empty = vm_rss_kib(pid)
    print(f"node RSS with no agent: {empty / 1024:.1f} MiB")
    async with cluster.channel(NODE) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        for cycle in range(1, cycles + 1):
            remaining = iter(range(roots))

            async def creator(remaining: Iterator[int] = remaining) -> None:
                for _ in remaining:
                    await stub.CreateRootSession(
                        mesh_pb2.CreateRootSessionRequest(
                            preset="lead", initial_task="", request_id=secrets.token_hex(8)
                        ),
                        metadata=cluster.metadata("tester"),
                        timeout=60,
                    )

            started = time.monotonic()
            await asyncio.gather(*(creator() for _ in range(IN_FLIGHT)))
            created_in = time.monotonic() - started
            await reader.wait_for(
                lambda: reader.node_load(NODE), lambda load: load == roots, what="all resident"
            )
            resident = vm_rss_kib(pid)
            await reader.wait_for(
                lambda: reader.node_load(NODE),
                lambda load: load == 0,
                within=IDLE_AFTER * 3 + created_in,
                what="all passivated",
            )
            after = vm_rss_kib(pid)
            live = await reader.live_sessions()
            print(
                f"cycle {cycle}: {roots} idle roots resident {resident / 1024:.1f} MiB"
                f" ({(resident - empty) / roots:.1f} KiB each over the empty node);"
                f" after they passivated {after / 1024:.1f} MiB ({live} live sessions;"
                f" created in {created_in:.1f} s, gone by {time.monotonic() - started:.1f} s)"
            )


def main() -> None:
    roots = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    cycles = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with tempfile.TemporaryDirectory() as log_dir:
        asyncio.run(_measure(roots, cycles, Path(log_dir)))


if __name__ == "__main__":
    main()
