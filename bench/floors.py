"""The floors: a bare grpc.aio unary echo to another process, one etcd transaction, and for
each log store one append, alone and behind a gRPC hop."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc

from bench._common import SQLITE, Bed, Floors, LogFloors
from bench._log import FLOOR_FENCE, floor_write, raise_fences
from bench._measure import Load, run_load, run_loads
from bench._report import Figure, Report
from dsh_mesh.core import SessionId
from dsh_mesh.logstore import open_log_store
from dsh_mesh.registry import Etcd, EtcdConfig
from dsh_mesh.registry._etcd import Result, Target, compare, put

ECHO = "bare grpc.aio echo"
TXN = "one etcd txn"
READ = "one etcd read (Range)"
_CLIENT = "client (bench process)"


def hop_and_append(backend: str) -> str:
    """The name of the floor of one gRPC hop plus one append to ``backend``."""
    return f"one gRPC hop + one {backend} append"


def append_alone(backend: str) -> str:
    """The name of the floor of one append to ``backend``, made in the benchmark process."""
    return f"one {backend} append"


@asynccontextmanager
async def echo_server(*args: str) -> AsyncIterator[tuple[grpc.aio.UnaryUnaryMultiCallable, int]]:
    """``bench/echo_server.py`` (with ``args``) in another process: its Echo method on a fresh
    channel, and its pid."""
    echo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.echo_server", *args, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert echo.stdout is not None
        port = int(await asyncio.wait_for(echo.stdout.readline(), 30))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel.unary_unary("/bench.Echo/Echo"), echo.pid
    finally:
        echo.terminate()
        await echo.wait()


async def measure_floors(bed: Bed) -> Floors:
    """The echo, etcd and SQLite floors at every load level of the run; also kept as
    ``bed.floors``. PostgreSQL's are measured by :func:`log_floors` when a section needs them."""
    sizes = bed.sizes
    floors = bed.floors = Floors()
    async with echo_server() as (method, pid):
        payload = b"x" * 200

        async def echo_call(_: int) -> None:
            await method(payload, timeout=10)

        loads = await run_loads(
            echo_call,
            levels=sizes.levels,
            calls=sizes.calls,
            warmup=sizes.warmup,
            hung_after=sizes.call_timeout,
            watch={_CLIENT: None, "echo server": pid},
        )
        floors.echo = {load.in_flight: load for load in loads}
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
    await log_floors(bed, SQLITE)
    return floors


async def log_floors(bed: Bed, backend: str) -> LogFloors:
    """The floors of log store ``backend`` (:data:`SQLITE`: a fresh file, as ``LocalCluster``
    gives a cluster by default; :data:`POSTGRES`: a fresh database on the run's server, fsync
    on), measured once per run at every load level and recorded: one gRPC hop plus one append
    (``bench/echo_server.py LOG_STORE``), and one append made here. Every caller appends to a
    session of its own, so callers contend for the store, not for one session's fence row."""
    known = bed.floors.log.get(backend)
    if known is not None:
        return known
    sizes = bed.sizes
    url = bed.sqlite_store("floors") if backend == SQLITE else await bed.postgres_store("floors")
    floors = LogFloors()
    log = open_log_store(url)
    try:
        sessions = {
            prefix: [SessionId(f"{prefix}-{n}") for n in range(max(sizes.levels) + 1)]
            for prefix in ("hop", "alone")
        }
        for names in sessions.values():
            await raise_fences(log, names)
        keys = (f"alone-{n}" for n in itertools.count())

        async def alone(session: SessionId) -> None:
            await log.append(session, [floor_write(session, next(keys))], fence=FLOOR_FENCE)

        async with echo_server(url) as (method, pid):

            async def hop(session: SessionId) -> None:
                await method(session.encode(), timeout=10)

            watch = {_CLIENT: None, "echo server": pid}
            floors.hop = await _per_session_loads(bed, sessions["hop"], hop, watch)
        floors.alone = await _per_session_loads(bed, sessions["alone"], alone, {_CLIENT: None})
    finally:
        await log.aclose()
    report = bed.report
    for label, by_level in (
        (hop_and_append(backend), floors.hop),
        (append_alone(backend), floors.alone),
    ):
        record_loads(report, label, list(by_level.values()), series=f"floor: {label}")
    bed.floors.log[backend] = floors
    return floors


async def _per_session_loads(
    bed: Bed,
    sessions: list[SessionId],
    call: Callable[[SessionId], Awaitable[None]],
    watch: dict[str, int | None],
) -> dict[int, Load]:
    """``call`` at every load level, each concurrent caller with a session of its own (the
    warm-up, one at a time, round-robin over every session)."""
    sizes = bed.sizes
    for n in range(max(sizes.warmup, len(sessions))):
        await call(sessions[n % len(sessions)])
    loads: dict[int, Load] = {}
    for in_flight in sizes.levels:
        loads[in_flight] = await run_load(
            _caller_sessions(sessions, call),
            calls=sizes.calls,
            in_flight=in_flight,
            hung_after=sizes.call_timeout,
            watch=watch,
        )
    return loads


def _caller_sessions(
    sessions: list[SessionId], call: Callable[[SessionId], Awaitable[None]]
) -> Callable[[int], Awaitable[None]]:
    """``call`` with the session of the calling task: the first task to call gets
    ``sessions[0]``, the next ``sessions[1]``, and so on."""
    mine: dict[int, SessionId] = {}

    async def timed(_: int) -> None:
        task = id(asyncio.current_task())
        session = mine.get(task)
        if session is None:
            session = mine[task] = sessions[len(mine)]
        await call(session)

    return timed


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
