"""Timing a kind of call: per-call latency and throughput at a number of calls in flight."""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

Call = Callable[[int], Awaitable[object]]
"""One call to time; its argument is a number unique within the process (for idempotency
keys and message text)."""

_serial = itertools.count()
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, all threads) a process has used so far; None: this one."""
    stat = Path(f"/proc/{'self' if pid is None else pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def percentile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples``, nearest rank."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass(frozen=True)
class Load:
    """``calls`` calls made by ``in_flight`` concurrent callers: latency percentiles of each
    call (ms) and the calls completed per second overall."""

    in_flight: int
    calls: int
    p50: float
    p99: float
    throughput: float
    cpu_ms: dict[str, float] = field(default_factory=dict)
    """CPU time per call (ms) of each process watched, by name."""

    @staticmethod
    def of(
        in_flight: int,
        samples: list[float],
        elapsed: float,
        cpu_ms: Mapping[str, float] | None = None,
    ) -> Load:
        """The figures of ``samples`` (ms per call) taken over ``elapsed`` seconds."""
        return Load(
            in_flight=in_flight,
            calls=len(samples),
            p50=statistics.median(samples),
            p99=percentile(samples, 0.99),
            throughput=len(samples) / elapsed,
            cpu_ms=dict(cpu_ms or {}),
        )


Processes = Mapping[str, int | None]
"""Processes whose CPU time a load watches: name -> pid (None: this process)."""


CALL_TIMEOUT = 15.0
"""By default no timed call should take this long (seconds): one that does is reported as hung
instead of stalling the run."""


class HungCall(RuntimeError):
    """A timed call did not complete within :data:`CALL_TIMEOUT`."""


async def bounded(call: Call, serial: int, hung_after: float) -> None:
    """``call(serial)``, or :class:`HungCall` past ``hung_after`` seconds."""
    # In the caller's own task (asyncio.wait_for wraps the call in a task of its own on this
    # Python): a call keyed by its task (floors' _caller_sessions) must see its caller's.
    try:
        async with asyncio.timeout(hung_after):
            await call(serial)
    except TimeoutError:
        raise HungCall(f"a call did not complete within {hung_after:g} s: hung") from None


async def run_load(
    call: Call,
    *,
    calls: int,
    in_flight: int,
    warmup: int = 0,
    watch: Processes | None = None,
    hung_after: float = CALL_TIMEOUT,
) -> Load:
    """Make ``warmup`` untimed calls one at a time, then ``calls`` timed calls from ``in_flight``
    concurrent callers; every call's own latency is a sample. The CPU time each process of
    ``watch`` spends meanwhile is divided by ``calls``. Raises :class:`HungCall` when a call
    takes longer than ``hung_after`` seconds."""
    for _ in range(warmup):
        await bounded(call, next(_serial), hung_after)
    samples: list[float] = []
    pending = iter(range(calls))

    async def caller() -> None:
        for _ in pending:
            started = time.perf_counter()
            await bounded(call, next(_serial), hung_after)
            samples.append((time.perf_counter() - started) * 1000)

    watched = dict(watch or {})
    cpu_before = {name: cpu_seconds(pid) for name, pid in watched.items()}
    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(min(in_flight, calls))))
    elapsed = time.perf_counter() - started
    cpu_ms = {
        name: (cpu_seconds(pid) - cpu_before[name]) * 1000 / calls for name, pid in watched.items()
    }
    return Load.of(in_flight, samples, elapsed, cpu_ms)


async def run_loads(
    call: Call,
    *,
    levels: tuple[int, ...],
    calls: int,
    warmup: int,
    watch: Processes | None = None,
    hung_after: float = CALL_TIMEOUT,
) -> list[Load]:
    """:func:`run_load` at each number of calls in flight in ``levels`` (warm-up once)."""
    loads = []
    for index, in_flight in enumerate(levels):
        loads.append(
            await run_load(
                call,
                calls=calls,
                in_flight=in_flight,
                warmup=warmup if index == 0 else 0,
                watch=watch,
                hung_after=hung_after,
            )
        )
    return loads
