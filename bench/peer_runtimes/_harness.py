"""What every peer's driver shares: timing a kind of call, the CPU and memory of a tree of
processes, and the one line of figures a driver prints. The standard library only: the same
module runs in the project's virtualenv and in the peers' own."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

Call = Callable[[int], Awaitable[object]]
"""One call to time; its argument is unique within the run (for message text and keys)."""

FIGURES = "PEER-FIGURES "
"""The prefix of the one line of JSON a driver prints on standard output."""

_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for servers that cannot report the
    port they bound)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def tree(root: int | None = None) -> list[int]:
    """``root`` (None: this process) and every process descending from it now."""
    top = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    found, frontier = [top], [top]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """User and system CPU time used so far by the processes ``pids`` that still exist."""
    total = 0.0
    for pid in pids:
        try:
            fields = _stat(pid)
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


def rss_kib(pid: int) -> int:
    """The resident set of process ``pid`` in KiB (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples``, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_at_a_time(call: Call, calls: int, *, first: int = 0) -> list[float]:
    """``calls`` calls made one after the other; each one's latency in ms."""
    samples = []
    for serial in range(first, first + calls):
        started = time.perf_counter()
        await call(serial)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


async def in_flight(
    call: Call, calls: int, concurrency: int, pids: Iterable[int], *, first: int = 0
) -> tuple[float, float]:
    """``calls`` calls from ``concurrency`` concurrent callers: calls per second, and the CPU
    time per call (ms) of the processes ``pids`` together."""
    watched = list(pids)
    pending = iter(range(first, first + calls))

    async def caller() -> None:
        for serial in pending:
            await call(serial)

    cpu_before = cpu_seconds(watched)
    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return calls / elapsed, (cpu_seconds(watched) - cpu_before) * 1000 / calls


def figures(
    *,
    latency: list[float],
    throughput: float,
    cpu_ms: float,
    creation: list[float],
    idle_kib: float,
    processes: int,
) -> dict[str, float]:
    """The figures every driver reports, under the names the ``peers`` section reads."""
    return {
        "p50_ms": statistics.median(latency),
        "p99_ms": percentile(latency, 0.99),
        "throughput": throughput,
        "cpu_ms": cpu_ms,
        "create_p50_ms": statistics.median(creation),
        "idle_kib": idle_kib,
        "processes": processes,
    }


async def measure(
    send: Call,
    create: Call,
    *,
    calls: int,
    concurrency: int,
    agents: int,
    processes: list[int],
    host: int,
) -> dict[str, float]:
    """The figures of a runtime whose agents are created in the process ``host``: ``calls``
    warm sends one at a time, as many at ``concurrency`` (CPU of ``processes``), then
    ``agents`` agents created one at a time (and ``host``'s growth per agent). 100 untimed
    sends and 50 untimed creations warm it up first."""
    await one_at_a_time(send, 100, first=-100)
    latency = await one_at_a_time(send, calls)
    rate, cpu_ms = await in_flight(send, calls, concurrency, processes, first=calls)
    await one_at_a_time(create, 50, first=-50)
    before = rss_kib(host)
    creation = await one_at_a_time(create, agents)
    await asyncio.sleep(0.5)
    grown = rss_kib(host) - before
    return figures(
        latency=latency,
        throughput=rate,
        cpu_ms=cpu_ms,
        creation=creation,
        idle_kib=max(0.0, grown / agents),
        processes=len(processes),
    )


def emit(values: dict[str, float]) -> None:
    """Print the driver's figures as the one line the ``peers`` section parses."""
    print(FIGURES + json.dumps(values), flush=True)
