"""Real work at scale (issue 35, point 5): many agents on one node, each streaming its answers
from a model server at a model's pace, against bare httpx streaming the same.

The server (``bench/stream_server.py``, a process of its own) answers every request with 48
one-token chunks, 50 tokens a second, and a call of the ``tick`` tool, so every agent steps on:
a step is one streamed answer, its assistant entry, the tool's call and its result, all durable.
At each size of ``sizes.streamers``:

- **Floor.** ``bench/stream_floor.py``: as many bare httpx streams in one process, each posting
  the provider's timed request body (about 8.5 KB) and reading every answer to its end.
- **The mesh.** One node process whose ``streamer`` preset's endpoint is the server (a pool of
  as many connections as agents). That many roots are created, each with a task, while the
  server holds their first calls; then it answers them all, and from then on every agent
  streams and steps by itself.

Each is measured over the same window, once the server has had twice as many requests as
there are streams: answers read whole a second (steps: the requests that followed them; what
the server wrote may still wait in a socket), and the CPU time of its process (the node; the
floor's client) per token of those answers. Targets: steps a second at least 0.8x the floor's,
and CPU per token at most 1/0.8 = 1.25x the floor's. The server, a third process on the same
two cores, is outside both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench._cluster import node_processes, unthrottled
from bench._common import Bed
from bench._measure import cpu_seconds
from bench._report import Figure
from bench.provider import timed_request
from bench.stream_server import TOKENS
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.models._openai_wire import request_body

NODE = "node-a"
STEPS_TARGET = 0.8
"""Steps a second through the mesh, at least this share of the floor's."""
CPU_TARGET = 1 / 0.8
"""CPU per streamed token through the mesh, at most this many times the floor's."""
_IN_FLIGHT = 64
_LEASE_TTL = 10.0
"""A node busy with thousands of streams keeps its lease: a longer TTL than the default."""
_STOP_SECONDS = 60.0
_STEADY_SECONDS = 300.0
"""How long the section waits for twice as many requests as streams."""
_ANSWER_SECONDS = 120.0
"""How long the section waits for the server's answer, or for the floor to have every stream
under way."""


@dataclass(frozen=True)
class Rate:
    """One process over one window: answers completed and tokens streamed a second, and its
    CPU time per token."""

    steps: float
    tokens: float
    cpu_per_token_us: float


class _Server:
    """The paced server's process and its command pipe."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.stream_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        self.base_url = self._process.stdout.readline().strip()
        if not self.base_url:
            raise RuntimeError("the paced chat server did not start")

    async def command(self, line: str) -> dict[str, int]:
        """Send one command; its one line of JSON answer (a busy server can be slow)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        answer = await asyncio.wait_for(
            asyncio.to_thread(self._process.stdout.readline), _ANSWER_SECONDS
        )
        parsed: dict[str, int] = json.loads(answer)
        return parsed

    def close(self) -> None:
        if self._process.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@contextlib.contextmanager
def _server() -> Iterator[_Server]:
    server = _Server()
    try:
        yield server
    finally:
        server.close()


async def _steady(server: _Server, agents: int) -> None:
    """Return once the server has had twice as many requests as there are streams: as many
    answers read whole as streams, so the backlog of first answers no longer waits in the
    sockets (a count over all streams, not of each)."""
    deadline = time.monotonic() + _STEADY_SECONDS
    while (await server.command("stats"))["requests"] < 2 * agents:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{agents} streams did not ask {2 * agents} times in {_STEADY_SECONDS} s"
            )
        await asyncio.sleep(0.5)


async def _window(server: _Server, pid: int, seconds: float) -> Rate:
    """What ``pid`` did over ``seconds``: the answers it read whole (each one a request that
    followed it: what the server wrote may still wait in a socket) and its CPU time."""
    before = await server.command("stats")
    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    after = await server.command("stats")
    cpu_after = cpu_seconds(pid)
    elapsed = time.perf_counter() - started
    steps = after["requests"] - before["requests"]
    return Rate(
        steps=steps / elapsed,
        tokens=steps * TOKENS / elapsed,
        cpu_per_token_us=(cpu_after - cpu_before) / max(steps * TOKENS, 1) * 1e6,
    )


def _start_floor(base_url: str, agents: int, body: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.stream_floor", base_url, str(agents), str(body)],
        stdout=subprocess.PIPE,
        text=True,
    )


async def _floor(bed: Bed, agents: int, window: float, settle: float) -> Rate:
    body = bed.log_root / "stream-body.json"
    body.write_bytes(request_body(timed_request(), model="bench-stream"))
    with _server() as server:
        await server.command("release")
        floor = _start_floor(server.base_url, agents, body)
        try:
            assert floor.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(floor.stdout.readline), _ANSWER_SECONDS)
            if line.strip() != "ready":
                raise RuntimeError(f"the bare httpx floor did not start: {line!r}")
            await _steady(server, agents)
            await asyncio.sleep(settle)
            return await _window(server, floor.pid, window)
        finally:
            floor.terminate()
            try:
                floor.wait(timeout=_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                floor.kill()
                floor.wait()


def _presets(bed: Bed, base_url: str, agents: int) -> Path:
    path = bed.log_root / f"streaming-{agents}.toml"
    path.write_text(
        f"""[endpoints.stream]
base_url = "{base_url}"
max_connections = {agents}

[presets.streamer]
system_prompt = "You work through a long task, one small step at a time."
model = "stream:bench-stream"
tools = ["tick"]
max_model_calls_per_turn = 100000

[tools]
modules = ["bench.stream_tools"]
"""
    )
    return path


async def _mesh(bed: Bed, agents: int, window: float, settle: float) -> Rate:
    with _server() as server:
        env = {
            "DSH_PRESETS_FILE": str(_presets(bed, server.base_url, agents)),
            "DSH_NAMESPACES_FILE": str(unthrottled(bed)),
        }
        with node_processes(bed, "IDLE_ROOTS", (NODE,), lease_ttl=_LEASE_TTL, env=env) as cluster:
            try:
                async with cluster.channel(NODE) as channel:
                    stub = mesh_pb2_grpc.MeshControlStub(channel)
                    metadata = cluster.metadata("bench")
                    todo = iter(range(agents))

                    async def start() -> None:
                        for _ in todo:
                            await stub.CreateRootSession(
                                mesh_pb2.CreateRootSessionRequest(
                                    preset="streamer",
                                    initial_task="Work through the task step by step.",
                                    request_id=secrets.token_hex(8),
                                ),
                                metadata=metadata,
                                timeout=120,
                            )

                    # Every agent's first model call waits at the server until all are there.
                    await asyncio.gather(*(start() for _ in range(min(_IN_FLIGHT, agents))))
                    await server.command("release")
                    await _steady(server, agents)
                    await asyncio.sleep(settle)
                    rate = await _window(server, cluster[NODE].pid, window)
                    await server.command("finish")  # every turn ends at its next answer
                cluster[NODE].terminate(timeout=_STOP_SECONDS)
                return rate
            finally:
                cluster[NODE].kill()  # a no-op once it has exited


async def measure_streaming(bed: Bed) -> None:
    """Steps a second and CPU per token, through the mesh and bare, at each size."""
    sizes, report = bed.sizes, bed.report
    # The quick run only shows the section runs end to end (make test runs it): short windows.
    window = 1.5 if sizes.name == "quick" else 15.0
    settle = 0.5 if sizes.name == "quick" else 3.0
    steps = report.curve(
        "streaming", "agents streaming from a model server", "agents on one node", "steps/s",
        log_x=True,
    )  # fmt: skip
    for agents in sizes.streamers:
        floor = await _floor(bed, agents, window, settle)
        mesh = await _mesh(bed, agents, window, settle)
        report.run.setdefault("streaming", {})[str(agents)] = {
            "floor": vars(floor) | {"tokens_per_answer": TOKENS},
            "mesh": vars(mesh),
        }
        steps.add("bare httpx", agents, floor.steps)
        steps.add("dsh-mesh agents", agents, mesh.steps)
        report.add(
            Figure(
                f"{agents} agents streaming on one node: steps/s through the mesh / bare httpx",
                mesh.steps,
                "steps/s",
                floor.steps,
                STEPS_TARGET,
                "higher",
            )
        )
        report.add(
            Figure(
                f"{agents} agents streaming on one node: CPU per token, the node / bare httpx",
                mesh.cpu_per_token_us,
                "us",
                floor.cpu_per_token_us,
                CPU_TARGET,
                "lower",
            )
        )
