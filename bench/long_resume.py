"""Cold resume of long transcripts in PostgreSQL (fsync on): time and node memory by length.

Roots of the ``LONG_ROOT`` scenario stall in their first model call on ``node-b``. Each gets a
past of N steps (a 4 KB tool result and the assistant step that called it, so 2N records)
appended straight to the log store under its activation's fence, 500 records per transaction,
as its own node would have written them. ``node-b`` then drains (SIGTERM, no grace): every
activation is released and the sessions are absent, their turns left open. A ``SubmitPrompt``
to ``node-c`` (placement ``local``) then finds each absent and cold-resumes it there: placing
it, winning its activation, raising its fence, reading its transcript page by page, building
the agent, closing the open turn and appending the prompt. What is timed is that call, from
the request until its durable acceptance, one session at a time, smallest first, after an
untimed resume of a root with a past of one step (the node's first resume). Each resumed
session, past its program, answers with an empty reply: the next resume starts once that turn
ended.

Memory: the peak resident set of the resuming node process during the call (``VmHWM`` of
``/proc/<pid>/status``, reset through ``/proc/<pid>/clear_refs`` just before), less its
``VmRSS`` just before; also the peak until the resumed turn ended (its model request, built
from the whole transcript, included). With ``long_resume_reps`` above 1 the resumes are
repeated on a freshly started node process each time (the nodes take turns), and the medians
are reported.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench._cluster import node_processes
from bench._common import Bed
from bench._log import step_writes
from bench._report import Figure
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import ConsumedEntry, Rejected, SessionId, TurnEndedEntry
from dsh_mesh.logstore import PostgresLogStore
from dsh_mesh.registry import Etcd, Keys
from dsh_mesh.registry._codec import decode_activation
from dsh_mesh.runtime import Write
from dsh_mesh.testing import LocalCluster, create_root
from dsh_mesh.transport import error_from_rpc

_NODES = ("node-b", "node-c")
_RECORDS_PER_APPEND = 500
_POLL = 0.01
_SETTLE_MARGIN = 0.05
"""After etcd shows the sessions absent: time for the resuming node's directory to see it."""
_WAIT = 60.0
_RETRIES = 20


def proc_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def reset_peak(pid: int) -> None:
    """Reset the process's peak resident set (``VmHWM``) to its current one."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


async def measure_long_resume(bed: Bed) -> None:
    """Time (per 4 KB tool result) and node memory of the cold resume of sessions with
    ``sizes.long_resume`` steps in PostgreSQL."""
    sizes, report = bed.sizes, bed.report
    dsn = await bed.postgres_store("long-resume")
    times: dict[int, list[float]] = {steps: [] for steps in sizes.long_resume}
    peaks: dict[int, list[float]] = {steps: [] for steps in sizes.long_resume}
    turn_peaks: dict[int, list[float]] = {steps: [] for steps in sizes.long_resume}
    seeding: dict[str, float] = {}
    report.run["long_resume_seed_seconds"] = seeding
    with node_processes(bed, "LONG_ROOT", _NODES, placement="local", log_store=dsn) as cluster:
        keys = Keys(cluster.settings.key_prefix.encode())
        async with Etcd(cluster.settings.etcd_config()) as etcd, PostgresLogStore(dsn=dsn) as log:
            host = _NODES[0]
            # A root with a past of one step: resumed first, untimed (the node's first resume).
            warm_up = await _seeded_root(cluster, host, etcd, keys, log, 1)
            roots: dict[int, SessionId] = {}
            for steps in sizes.long_resume:
                started = time.perf_counter()
                roots[steps] = await _seeded_root(cluster, host, etcd, keys, log, steps)
                seeding[str(steps)] = round(time.perf_counter() - started, 2)
            for _ in range(sizes.long_resume_reps):
                resumer = _NODES[1] if host == _NODES[0] else _NODES[0]
                if not cluster[resumer].running:
                    await asyncio.to_thread(cluster[resumer].start)
                await asyncio.to_thread(cluster[host].terminate)
                for root in (warm_up, *roots.values()):
                    absent = functools.partial(_absent, etcd, keys, root)
                    await _until(absent, f"{root} absent")
                await asyncio.sleep(_SETTLE_MARGIN)
                pid = cluster[resumer].pid
                async with cluster.channel(resumer) as channel:
                    stub = mesh_pb2_grpc.MeshControlStub(channel)
                    await _prompt(cluster, stub, warm_up, sizes.call_timeout)
                    ended = functools.partial(_turn_ended, log, warm_up)
                    await _until(ended, f"{warm_up} answered")
                    for steps in sizes.long_resume:
                        root = roots[steps]
                        reset_peak(pid)
                        before = proc_kib(pid, "VmRSS")
                        elapsed = await _prompt(cluster, stub, root, sizes.call_timeout)
                        peak = proc_kib(pid, "VmHWM")
                        current = await etcd.get(keys.activation(root))
                        if current is None or decode_activation(current.value).node_id != resumer:
                            raise RuntimeError(f"{root} was not cold-resumed on {resumer}")
                        ended = functools.partial(_turn_ended, log, root)
                        await _until(ended, f"{root} answered")
                        times[steps].append(elapsed)
                        peaks[steps].append(max(0, peak - before) * 1024)
                        turn_peaks[steps].append(max(0, proc_kib(pid, "VmHWM") - before) * 1024)
                host = resumer
    _record(bed, times, peaks, turn_peaks)


def _record(
    bed: Bed,
    times: dict[int, list[float]],
    peaks: dict[int, list[float]],
    turn_peaks: dict[int, list[float]],
) -> None:
    report = bed.report
    per_entry = {steps: statistics.median(t) / steps for steps, t in times.items()}
    timing = report.curve(
        "long-resume",
        "cold resume time per 4 KB tool result (PostgreSQL)",
        "4 KB tool results in the transcript",
        "ms",
        log_x=True,
    )
    for steps, samples in times.items():
        ms = statistics.median(samples)
        peak = statistics.median(peaks[steps])
        turn_peak = statistics.median(turn_peaks[steps])
        name = f"cold resume, {steps} 4 KB tool results in PostgreSQL"
        report.add(
            Figure(f"{name}: time", ms, "ms"),
            Figure(f"{name}: time per tool result", per_entry[steps], "ms"),
            Figure(f"{name}: node peak RSS growth", peak / 1024, "KiB"),
            Figure(f"{name}: node peak RSS growth per tool result", peak / steps, "bytes"),
            Figure(
                f"{name}: node peak RSS growth until the turn ended, per tool result",
                turn_peak / steps,
                "bytes",
            ),
        )
        timing.add("time / tool results", steps, per_entry[steps])
    memory = report.curve(
        "long-resume-memory",
        "node peak RSS growth per 4 KB tool result, cold resume",
        "4 KB tool results in the transcript",
        "bytes",
        log_x=True,
    )
    for steps in times:
        memory.add("until accepted", steps, statistics.median(peaks[steps]) / steps)
        memory.add("until the turn ended", steps, statistics.median(turn_peaks[steps]) / steps)
    most, second = sorted(times)[-1], sorted(times)[-2]
    report.add(
        Figure(
            f"cold resume time per 4 KB tool result at {most} / at {second}",
            per_entry[most],
            "ms",
            per_entry[second],
            target=1.2,
            better="lower",
        )
    )
    report.run["long_resume_ms"] = {str(s): [round(v, 2) for v in t] for s, t in times.items()}


async def _seeded_root(
    cluster: LocalCluster, host: str, etcd: Etcd, keys: Keys, log: PostgresLogStore, steps: int
) -> SessionId:
    """A root on ``host``, stalled in its first turn, with a past of ``steps`` steps."""
    root = await create_root(cluster, on=host, task="Live long.", preset="long")
    await _until(functools.partial(_stalled, log, root), f"{root} stalled")
    kv = await etcd.get(keys.activation(root))
    if kv is None:
        raise RuntimeError(f"{root} is not resident after its creation")
    await _seed(log, root, steps, int(kv.create_revision))
    return root


async def _seed(log: PostgresLogStore, session: SessionId, steps: int, fence: int) -> None:
    """Append ``steps`` steps to the session's running turn, as its own activation would."""
    writes: list[Write] = []
    for step in range(steps):
        writes.extend(step_writes(session, step))
        if len(writes) >= _RECORDS_PER_APPEND:
            await log.append(session, writes, fence=fence)
            writes = []
    if writes:
        await log.append(session, writes, fence=fence)


async def _prompt(
    cluster: LocalCluster, stub: mesh_pb2_grpc.MeshControlStub, session: SessionId, limit: float
) -> float:
    """Submit a prompt; returns the ms from the request to its acceptance. A retryable refusal
    (the node still sees the session resident elsewhere) is retried, timed afresh."""
    request = mesh_pb2.SubmitPromptRequest(
        session_id=session, text="Still there?", idempotency_key=secrets.token_hex(8)
    )
    for attempt in range(_RETRIES):
        started = time.perf_counter()
        try:
            await stub.SubmitPrompt(request, metadata=cluster.metadata("bench"), timeout=limit)
        except grpc.aio.AioRpcError as failure:
            error = error_from_rpc(failure)
            if not (isinstance(error, Rejected) and error.retryable) or attempt + 1 == _RETRIES:
                raise
            await asyncio.sleep(_SETTLE_MARGIN)
            continue
        return (time.perf_counter() - started) * 1000
    raise AssertionError("unreachable")


async def _stalled(log: PostgresLogStore, session: SessionId) -> bool:
    """Whether the root's first turn is under way (its task consumed): its model call stalls."""
    last = await log.last(session)
    return last is not None and isinstance(last.entry, ConsumedEntry)


async def _turn_ended(log: PostgresLogStore, session: SessionId) -> bool:
    last = await log.last(session)
    return last is not None and isinstance(last.entry, TurnEndedEntry)


async def _absent(etcd: Etcd, keys: Keys, session: SessionId) -> bool:
    return await etcd.get(keys.activation(session)) is None


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check()`` until it holds, for at most ``_WAIT`` seconds."""
    deadline = time.monotonic() + _WAIT
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {_WAIT:g} s")
        await asyncio.sleep(_POLL)
