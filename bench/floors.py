"""The floors: a bare grpc.aio unary echo to another process, and one etcd transaction."""

from __future__ import annotations

import asyncio
import secrets
import sys

import grpc

from bench._common import Bed, Floors
from bench._measure import Load, run_load, run_loads
from bench._report import Figure, Report
from dsh_mesh.registry import Etcd, EtcdConfig
from dsh_mesh.registry._etcd import Result, Target, compare, put

ECHO = "bare grpc.aio echo"
TXN = "one etcd txn"
READ = "one etcd read (Range)"


async def measure_floors(bed: Bed) -> Floors:
    """Both floors at every load level of the run; also kept as ``bed.floors``."""
    sizes = bed.sizes
    floors = bed.floors = Floors()
    echo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.echo_server", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert echo.stdout is not None
        port = int(await asyncio.wait_for(echo.stdout.readline(), 30))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary("/bench.Echo/Echo")
            payload = b"x" * 200

            async def echo_call(_: int) -> None:
                await method(payload, timeout=10)

            loads = await run_loads(
                echo_call,
                levels=sizes.levels,
                calls=sizes.calls,
                warmup=sizes.warmup,
                hung_after=sizes.call_timeout,
                watch={"client (bench process)": None, "echo server": echo.pid},
            )
            floors.echo = {load.in_flight: load for load in loads}
    finally:
        echo.terminate()
        await echo.wait()
    async with Etcd(EtcdConfig(endpoint=bed.etcd_endpoint)) as etcd:
        prefix = f"/bench-floor-{secrets.token_hex(4)}/".encode()

        async def txn(i: int) -> None:
            key = prefix + str(i).encode()
            await etcd.txn([compare(key, Target.CREATE, Result.EQUAL, 0)], [put(key, b"x" * 200)])

        loads = await run_loads(
            txn,
            levels=sizes.levels,
            calls=sizes.calls,
            warmup=sizes.warmup,
            hung_after=sizes.call_timeout,
            watch={"client (bench process)": None, "etcd": bed.etcd_pid},
        )
        floors.txn = {load.in_flight: load for load in loads}
        _, read = await etcd_singles(etcd, calls=sizes.calls, hung_after=sizes.call_timeout)
    for label, by_level in ((ECHO, floors.echo), (TXN, floors.txn)):
        record_loads(bed.report, label, list(by_level.values()), series=f"floor: {label}")
    bed.report.add(
        Figure(f"{READ}: p50 at 1 in flight", read.p50, "ms"),
        Figure(f"{READ}: p99 at 1 in flight", read.p99, "ms"),
    )
    return floors


async def etcd_singles(etcd: Etcd, *, calls: int, hung_after: float) -> tuple[Load, Load]:
    """One etcd transaction (a guarded put, like an append) and one etcd read (a single-key
    Range, like an idempotency lookup), each timed one at a time."""
    prefix = f"/bench-probe-{secrets.token_hex(4)}/".encode()

    async def txn(i: int) -> None:
        key = prefix + str(i).encode()
        await etcd.txn([compare(key, Target.CREATE, Result.EQUAL, 0)], [put(key, b"x" * 200)])

    async def read(i: int) -> None:
        await etcd.get(prefix + str(i % 10).encode())

    txns = await run_load(txn, calls=calls, in_flight=1, warmup=10, hung_after=hung_after)
    reads = await run_load(read, calls=calls, in_flight=1, warmup=10, hung_after=hung_after)
    return txns, reads


def record_loads(
    report: Report,
    label: str,
    loads: list[Load],
    *,
    latency_floor: dict[int, float] | None = None,
    throughput_floor: dict[int, float] | None = None,
    series: str | None = None,
) -> None:
    """Record p50, p99 and throughput of each load as measurements (with the floors given, by
    calls in flight) and as points of the latency and throughput curves; and, at the most
    calls in flight, the CPU time per call of each process watched. ``series`` names the
    curves' series (default: ``label``)."""
    series = series or label
    latency = report.curve(
        "latency", "p50 latency by calls in flight", "calls in flight", "ms", log_x=True
    )
    tails = report.curve(
        "tail", "p99 latency by calls in flight", "calls in flight", "ms", log_x=True
    )
    rate = report.curve(
        "throughput", "throughput by calls in flight", "calls in flight", "calls/s", log_x=True
    )
    for load in loads:
        n = load.in_flight
        floor = None if latency_floor is None else latency_floor.get(n)
        rate_floor = None if throughput_floor is None else throughput_floor.get(n)
        report.add(
            Figure(f"{label}: p50 at {n} in flight", load.p50, "ms", floor),
            Figure(f"{label}: p99 at {n} in flight", load.p99, "ms"),
            Figure(
                f"{label}: throughput at {n} in flight",
                load.throughput,
                "calls/s",
                rate_floor,
                better="higher",
            ),
        )
        latency.add(series, n, load.p50)
        tails.add(series, n, load.p99)
        rate.add(series, n, load.throughput)
    busiest = max(loads, key=lambda load: load.in_flight)
    for process, ms in busiest.cpu_ms.items():
        report.add(
            Figure(f"{label}: CPU per call at {busiest.in_flight} in flight, {process}", ms, "ms")
        )
