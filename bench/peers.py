"""dsh-mesh beside the in-memory runtimes a user would pick instead (issue 35): AutoGen's
distributed gRPC runtime and Ray actors, measured in the same run, the order rotated each round.

Every runtime is asked the same: a warm message from an agent's caller in one process to an
agent in another, awaiting its acknowledgement (p50 and p99 one at a time; messages per second
and the CPU time per message of all the runtime's processes at 64 in flight); creating an agent
in another process (p50, one at a time); and an idle agent's memory. Only dsh-mesh's
acknowledgement means the message is durable (an fsync'd append with its idempotency record)
and authorized; the peers keep messages in memory.

The peers run in a virtualenv of their own (``.venv-peers``, ``scripts/install_peers.sh``,
pinned by ``bench/peer_runtimes/requirements.txt``), through the drivers of
:mod:`bench.peer_runtimes`; dsh-mesh's side runs here, on node processes of the run's etcd, its
sender node inside this process (as in ``cross-node``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import statistics
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench._cluster import (
    children,
    create_root,
    in_process_node,
    node_processes,
    resident,
    unthrottled,
)
from bench._common import Bed
from bench._report import Figure
from bench.peer_runtimes import _harness
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.testing import MeshReader

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
"""The peers' interpreter (``scripts/install_peers.sh``); ``DSH_BENCH_PEERS_PYTHON`` overrides."""
DSH_MESH, AUTOGEN, RAY = "dsh-mesh", "AutoGen 0.7.5 gRPC", "Ray 2.60 actors"
IN_FLIGHT = 64
TARGET_NODE = "node-b"
CREATE_TARGET_MS = 2.0
ECHO_SHARE = 0.7
_PEER_TIMEOUT = 600.0

Figures = dict[str, float]


def _peers_python() -> str:
    python = os.environ.get("DSH_BENCH_PEERS_PYTHON") or str(PEERS_PYTHON)
    if not Path(python).exists():
        raise RuntimeError(f"no peers' virtualenv at {python}: run scripts/install_peers.sh")
    return python


async def _peer(module: str, *options: str) -> Figures:
    """Run one peer's driver in the peers' virtualenv; its figures."""
    process = await asyncio.create_subprocess_exec(
        _peers_python(),
        "-m",
        f"bench.peer_runtimes.{module}",
        *options,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)},
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), _PEER_TIMEOUT)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise RuntimeError(f"{module} did not finish within {_PEER_TIMEOUT:g} s") from None
    for line in out.decode().splitlines():
        if line.startswith(_harness.FIGURES):
            values: Figures = json.loads(line.removeprefix(_harness.FIGURES))
            return values
    raise RuntimeError(
        f"{module} printed no figures (exit status {process.returncode}):\n" + err.decode()[-2000:]
    )


async def _dsh_mesh(bed: Bed) -> Figures:
    """dsh-mesh's figures: a root on the in-process node-a sends to its resident child on the
    node process node-b (as its ``send_message`` tool does, each send with its own idempotency
    key); agents are created on node-b by ``CreateRootSession`` from this process."""
    sizes = bed.sizes
    env = {"DSH_NAMESPACES_FILE": str(unthrottled(bed))}
    with node_processes(bed, "RESIDENT_CHILD", (TARGET_NODE,), env=env) as cluster:
        async with (
            in_process_node(cluster.settings) as node,
            MeshReader(cluster.settings) as reader,
            cluster.channel(TARGET_NODE) as channel,
        ):
            root = await create_root(node)
            [child] = await children(reader, root.session_id, 1)
            await resident(reader, child)
            manager = node.manager()

            async def send(serial: int) -> None:
                key = f"k{serial}"
                await manager.send_message(root, child, f"m{serial}", idempotency_key=key)

            control = mesh_pb2_grpc.MeshControlStub(channel)
            metadata = cluster.metadata("bench")

            async def create(serial: int) -> None:
                request = mesh_pb2.CreateRootSessionRequest(
                    preset="sink", initial_task="", request_id=secrets.token_hex(8)
                )
                await control.CreateRootSession(request, metadata=metadata, timeout=30)

            target = cluster[TARGET_NODE].pid
            processes = [os.getpid(), target] + ([bed.etcd_pid] if bed.etcd_pid else [])
            return await _harness.measure(
                send,
                create,
                calls=sizes.peer_calls,
                concurrency=IN_FLIGHT,
                agents=sizes.peer_agents,
                processes=processes,
                host=target,
            )


async def measure_peers(bed: Bed) -> None:
    """Every runtime's figures, the median of ``sizes.peer_rounds`` rounds (the order rotated
    each round), and the targets of issue 35 against the peers and the bare echo."""
    sizes = bed.sizes
    counts = ("--calls", str(sizes.peer_calls), "--in-flight", str(IN_FLIGHT))
    runs: dict[str, Callable[[], Awaitable[Figures]]] = {
        DSH_MESH: lambda: _dsh_mesh(bed),
        AUTOGEN: lambda: _peer("autogen_peer", *counts, "--agents", str(sizes.peer_agents)),
        RAY: lambda: _peer("ray_peer", *counts, "--agents", str(sizes.peer_actors)),
    }
    names = list(runs)
    rounds: dict[str, list[Figures]] = {name: [] for name in names}
    for index in range(sizes.peer_rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            print(f"bench: peers: round {index + 1}: {name}", file=sys.stderr, flush=True)
            rounds[name].append(await runs[name]())
    median = {
        name: {key: statistics.median(r[key] for r in runs_) for key in runs_[0]}
        for name, runs_ in rounds.items()
    }
    bed.report.run["peers"] = {"rounds": rounds, "median": median}
    _record(bed, median)


def _record(bed: Bed, median: dict[str, Figures]) -> None:
    report = bed.report
    curve = report.curve(
        "peers",
        "warm messages to an agent in another process, by runtime",
        "messages in flight",
        "messages/s",
    )
    for name, values in median.items():
        report.add(
            Figure(f"peers: {name}: warm message p50, 1 in flight", values["p50_ms"], "ms"),
            Figure(f"peers: {name}: warm message p99, 1 in flight", values["p99_ms"], "ms"),
            Figure(
                f"peers: {name}: messages per second, {IN_FLIGHT} in flight",
                values["throughput"],
                "calls/s",
                better="higher",
            ),
            Figure(
                f"peers: {name}: CPU per message, {IN_FLIGHT} in flight, all its processes",
                values["cpu_ms"],
                "ms",
            ),
            Figure(
                f"peers: {name}: create an agent in another process, p50",
                values["create_p50_ms"],
                "ms",
            ),
            Figure(f"peers: {name}: memory per idle agent", values["idle_kib"], "KiB"),
        )
        curve.add(name, 1, 1000 / values["p50_ms"])
        curve.add(name, IN_FLIGHT, values["throughput"])
    ours = median[DSH_MESH]
    peers = {name: values for name, values in median.items() if name != DSH_MESH}
    fastest = min(peers, key=lambda name: peers[name]["p50_ms"])
    busiest = max(peers, key=lambda name: peers[name]["throughput"])
    echo = bed.floors.echo[IN_FLIGHT].throughput
    curve.add("floor: bare echo", IN_FLIGHT, echo)
    report.add(
        Figure(
            f"peers: warm cross-node message p50, 1 in flight / the faster peer's ({fastest})",
            ours["p50_ms"],
            "ms",
            peers[fastest]["p50_ms"],
            1.0,
            "lower",
        ),
        Figure(
            f"peers: messages per second at {IN_FLIGHT} in flight / the faster peer's ({busiest})",
            ours["throughput"],
            "calls/s",
            peers[busiest]["throughput"],
            1.0,
            "higher",
        ),
        Figure(
            f"peers: messages per second at {IN_FLIGHT} in flight / bare echo",
            ours["throughput"],
            "calls/s",
            echo,
            ECHO_SHARE,
            "higher",
        ),
        Figure(
            f"peers: CPU per acknowledged message at {IN_FLIGHT} in flight, all processes /"
            f" {AUTOGEN}'s",
            ours["cpu_ms"],
            "ms",
            peers[AUTOGEN]["cpu_ms"],
            1.0,
            "lower",
        ),
        Figure(
            "peers: create an agent on another node, p50",
            ours["create_p50_ms"],
            "ms",
            None,
            CREATE_TARGET_MS,
            "lower",
        ),
    )
