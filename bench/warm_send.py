"""Warm cross-node SendMessage latency next to its floors, measured in one run.

    python -m bench.warm_send [--sends 1000] [--in-flight 64]

Starts a real etcd and three nodes. A root on node-a spawns one continuable child on another
node that stays resident. The benchmark then acts as node-a and sends to that child
``--sends`` times, one at a time, each a durable acceptance (one gRPC hop to the child's node,
its authorization from the directory cache, one etcd transaction). In the same run it measures
the floors: a bare grpc.aio echo to another process, and one etcd transaction (a guarded put,
like an append). Then the same warm sends against a second cluster exporting every span
(sampler always on) by OTLP to a receiver in this process. Prints p50/p99 of each, throughput
at ``--in-flight`` concurrent calls, and the ratios to the floors and of tracing on to off.

This is the tracing comparison only; the benchmark suite (every figure of the issue, with its
report and plot) is ``python -m bench`` (``make bench``, bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from bench._cluster import INBOX_DEPTH
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import SessionId
from dsh_mesh.registry import Etcd, EtcdConfig
from dsh_mesh.registry._etcd import Result, Target, compare, put
from dsh_mesh.testing import EtcdServer, LocalCluster, MeshReader, OtlpReceiver, otel_env


@dataclass(frozen=True)
class Figures:
    """Latency percentiles (ms) and throughput (calls/s) of one kind of call."""

    name: str
    p50: float
    p99: float
    throughput: float


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _measure(
    name: str, call: Callable[[int], Awaitable[None]], sends: int, in_flight: int
) -> Figures:
    for i in range(min(50, sends)):  # warm-up: channels, caches
        await call(-1 - i)
    samples: list[float] = []
    for i in range(sends):
        started = time.perf_counter()
        await call(i)
        samples.append((time.perf_counter() - started) * 1000)
    queue = iter(range(sends, sends * 2))

    async def worker() -> None:
        for i in queue:
            await call(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    throughput = sends / (time.perf_counter() - started)
    return Figures(name, statistics.median(samples), _percentile(samples, 0.99), throughput)


async def _run(sends: int, in_flight: int) -> list[Figures]:
    figures: list[Figures] = []
    echo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.echo_server", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert echo.stdout is not None
        port = int(await echo.stdout.readline())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary("/bench.Echo/Echo")
            payload = b"x" * 64

            async def echo_call(_: int) -> None:
                await method(payload, timeout=10)

            figures.append(await _measure("bare grpc.aio echo", echo_call, sends, in_flight))
    finally:
        echo.terminate()
        await echo.wait()
    with EtcdServer() as etcd_server:
        async with Etcd(EtcdConfig(endpoint=etcd_server.endpoint)) as etcd:
            prefix = f"/bench-{secrets.token_hex(4)}/".encode()

            async def txn(i: int) -> None:
                key = prefix + str(i).encode()
                await etcd.txn(
                    [compare(key, Target.CREATE, Result.EQUAL, 0)], [put(key, b"x" * 200)]
                )

            figures.append(await _measure("one etcd transaction", txn, sends, in_flight))
        unread = {"DSH_MAX_INBOX_DEPTH": str(INBOX_DEPTH)}  # the target never reads
        with LocalCluster(
            etcd_endpoint=etcd_server.endpoint,
            scenario="bench.scenarios:RESIDENT_CHILD",
            env=unread,
        ) as cluster:
            figures.append(await _warm_sends(cluster, sends, in_flight, "tracing off"))
            await asyncio.to_thread(cluster.close)
        async with OtlpReceiver() as receiver:
            with LocalCluster(
                etcd_endpoint=etcd_server.endpoint,
                scenario="bench.scenarios:RESIDENT_CHILD",
                env={**otel_env(receiver.endpoint), **unread},
            ) as cluster:
                figures.append(
                    await _warm_sends(cluster, sends, in_flight, "tracing on, all sampled")
                )
                await asyncio.to_thread(cluster.close)
            exported = len(receiver.spans("/dsh.mesh.v1.AgentMesh/SendMessage"))
            print(f"(tracing on: the receiver got {exported} SendMessage server spans)")
    return figures


async def _warm_sends(cluster: LocalCluster, sends: int, in_flight: int, label: str) -> Figures:
    node_a = cluster["node-a"].address
    assert node_a is not None
    async with grpc.aio.insecure_channel(node_a) as channel:
        control = mesh_pb2_grpc.MeshControlStub(channel)
        created = await control.CreateRootSession(
            mesh_pb2.CreateRootSessionRequest(
                preset="lead", initial_task="Bench.", request_id=secrets.token_hex(8)
            ),
            metadata=cluster.metadata("bench"),
            timeout=30,
        )
    root = SessionId(created.session_id)
    async with MeshReader(cluster.settings) as reader:
        headers = await reader.wait_for(
            lambda: reader.sessions(), lambda hs: len(hs) == 2, what="the child"
        )
        child = next(h.session_id for h in headers if h.parent_session == root)
        activation = await reader.wait_for(
            lambda: reader.activation(child), lambda a: a is not None, what="child resident"
        )
        assert activation is not None
    host = cluster[activation.node_id].address
    assert host is not None and activation.node_id != "node-a"
    sender = mesh_pb2.AgentRef(session_id=root, activation_id=created.activation_id)
    metadata = cluster.metadata("node-a")
    async with grpc.aio.insecure_channel(host) as channel:
        stub = mesh_pb2_grpc.AgentMeshStub(channel)

        async def send(i: int) -> None:
            await stub.SendMessage(
                mesh_pb2.SendMessageRequest(
                    sender=sender, agent_id=child, message=f"m{i}", idempotency_key=f"k{i}"
                ),
                metadata=metadata,
                timeout=10,
            )

        return await _measure(f"warm send, {label}", send, sends, in_flight)


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.warm_send")
    parser.add_argument("--sends", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=64)
    args = parser.parse_args()
    echo, txn, warm, traced = asyncio.run(_run(args.sends, args.in_flight))
    floor_p50 = echo.p50 + txn.p50
    print(f"{'':36} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9}   ({args.sends} sequential calls;")
    print(f"{'':36} {'':>8} {'':>8} {'':>9}    throughput at {args.in_flight} in flight)")
    for f in (echo, txn, warm, traced):
        print(f"{f.name:36} {f.p50:8.2f} {f.p99:8.2f} {f.throughput:9.0f}")
    print(f"floor (echo p50 + txn p50)       {floor_p50:8.2f}")
    print(f"warm send p50 / floor            {warm.p50 / floor_p50:8.2f}x")
    print(f"warm send throughput / echo      {warm.throughput / echo.throughput:8.2f}x")
    print(f"tracing on / off, p50            {traced.p50 / warm.p50:8.2f}x")


if __name__ == "__main__":
    main()
