"""What a tool call costs on the mesh's tool path, against the same call made bare.

- **Python tool.** A blocking function that does about 2 ms of work (SHA-256 of 1 MiB, three
  times), called
  through the path every agent's call takes (``run_limited``: argument validation, the node's
  tool threads, the call limits, the output cut), against calling the function directly.
- **MCP tool.** ``get_current_time`` of the published stdio server ``mcp-server-time``,
  through the mesh (``McpServers``: the node's one connection, launched through the reaper,
  ``run_limited``) against the official SDK's bare ``Client`` calling the same server.

p50 at 1 call in flight and throughput at 16, each as a ratio to its bare counterpart (targets:
p50 within 1.2x, throughput at least 1/1.2 of it). Then **1,000 resident agents** (20 with
``--quick``) of one manager, each having called the MCP tool once: how many server processes
run (target: one) and the process's memory growth per agent.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from bench._common import Bed
from bench._measure import Load, run_load
from bench._report import Figure
from bench.memory import vm_rss_kib
from dsh_mesh.core import AbortSignal, ActivationId, AgentRef, SessionId, ToolCall
from dsh_mesh.mcp import McpServerConfig, McpServers
from dsh_mesh.models import Call, Reply, ScriptedProvider
from dsh_mesh.node._threads import ToolThreads
from dsh_mesh.runtime import ContinuationManager, InMemorySessionStore, ManagerConfig
from dsh_mesh.testing import process_tree
from dsh_mesh.tools import Preset, Tool, ToolInvocation, run_limited, tool

_BLOCK = os.urandom(1 << 20)
_TIME = (sys.executable, ("-m", "mcp_server_time", "--local-timezone", "UTC"))
_LEVELS = (1, 16)
_CALLER = AgentRef(session_id=SessionId("s-bench"), activation_id=ActivationId("a-bench"))


_ROUNDS = 3
"""SHA-256 of 1 MiB takes about 0.65 ms here: three rounds are about 2 ms of work."""


@tool(replay="safe")
def digest(rounds: int = 1) -> str:
    """Hash a block of data ``rounds`` times."""
    value = b""
    for _ in range(rounds):
        value = hashlib.sha256(_BLOCK).digest()
    return value.hex()


def _invocation(target: Tool) -> ToolInvocation:
    return ToolInvocation(
        caller=_CALLER,
        call=ToolCall(call_id="c", name=target.descriptor.name, arguments_json="{}"),
        signal=AbortSignal(),
        executor=_THREADS,
    )


_THREADS = ToolThreads(32, name="bench-tool")


async def measure_tools(bed: Bed) -> None:
    """The Python and MCP tool figures, then the resident agents sharing one MCP server."""
    sizes, report = bed.sizes, bed.report
    calls, warmup = max(20, sizes.calls // 5), sizes.warmup

    async def bare_python(_: int) -> None:
        digest.function(rounds=_ROUNDS)

    async def mesh_python(_: int) -> None:
        output = await run_limited(digest, _invocation(digest), {"rounds": _ROUNDS}, digest.limits)
        assert not output.is_error, output

    python = await _pair(bare_python, mesh_python, calls=calls, warmup=warmup)
    _record(report, "Python tool (2 ms of work)", python)

    command, args = _TIME
    config = McpServerConfig(name="time", command=command, args=args)
    async with (
        Client(StdioServerParameters(command=command, args=list(args))) as bare,
        McpServers([config]) as servers,
    ):
        await servers.load("mcp:time/get_current_time")
        [time_tool] = servers.select("mcp:time/get_current_time")

        async def bare_mcp(_: int) -> None:
            result = await bare.call_tool("get_current_time", {"timezone": "UTC"})
            assert not result.is_error

        async def mesh_mcp(_: int) -> None:
            output = await run_limited(
                time_tool, _invocation(time_tool), {"timezone": "UTC"}, config.limits
            )
            assert not output.is_error, output

        mcp = await _pair(bare_mcp, mesh_mcp, calls=calls, warmup=warmup)
    _record(report, "MCP tool (mcp-server-time over stdio)", mcp)
    await _resident_agents(bed, 20 if sizes.name == "quick" else 1_000)


async def _pair(
    bare: Callable[[int], Coroutine[Any, Any, None]],
    mesh: Callable[[int], Coroutine[Any, Any, None]],
    *,
    calls: int,
    warmup: int,
) -> dict[str, dict[int, Load]]:
    """Each way at each level, bare first (interleaved by level, so drift hits both)."""
    loads: dict[str, dict[int, Load]] = {"bare": {}, "mesh": {}}
    for level in _LEVELS:
        for name, call in (("bare", bare), ("mesh", mesh)):
            loads[name][level] = await run_load(call, calls=calls, in_flight=level, warmup=warmup)
    return loads


def _record(report: Any, label: str, loads: dict[str, dict[int, Load]]) -> None:
    bare, mesh = loads["bare"], loads["mesh"]
    most = max(_LEVELS)
    for level in _LEVELS:
        report.add(
            Figure(f"{label}, bare: p50 at {level} in flight", bare[level].p50, "ms"),
            Figure(f"{label}, through the mesh: p50 at {level} in flight", mesh[level].p50, "ms"),
            Figure(
                f"{label}, bare: throughput at {level} in flight",
                bare[level].throughput,
                "calls/s",
            ),
            Figure(
                f"{label}, through the mesh: throughput at {level} in flight",
                mesh[level].throughput,
                "calls/s",
            ),
        )
    report.add(
        Figure(
            f"{label}: p50 through the mesh / bare, 1 in flight",
            mesh[1].p50,
            "ms",
            bare[1].p50,
            target=1.2,
            better="lower",
        ),
        Figure(
            f"{label}: throughput through the mesh / bare, {most} in flight",
            mesh[most].throughput,
            "calls/s",
            bare[most].throughput,
            target=round(1 / 1.2, 3),
            better="higher",
        ),
    )


async def _resident_agents(bed: Bed, count: int) -> None:
    """``count`` roots of one manager each call the MCP tool once and stay resident."""
    command, args = _TIME
    config = McpServerConfig(
        name="time", command=command, args=args, idle_close=timedelta(minutes=10)
    )
    preset = Preset(
        name="timer", system_prompt="You tell the time.", model="timer", tools=("mcp:time",)
    )
    provider = ScriptedProvider(
        programs={
            "timer": (
                Call(calls=(("time__get_current_time", {"timezone": "UTC"}),)),
                Reply(text="Told."),
            )
        }
    )
    before = vm_rss_kib(os.getpid())
    started = time.perf_counter()
    async with (
        McpServers([config]) as servers,
        ContinuationManager(
            store=InMemorySessionStore(),
            provider=provider,
            presets=(preset,),
            config=ManagerConfig(),
            tools=(),
            tool_executor=_THREADS,
            tool_source=servers,
        ) as manager,
    ):
        remaining = iter(range(count))

        async def creator() -> None:
            for _ in remaining:
                await manager.create_root("Tell the time.", preset="timer")

        await asyncio.gather(*(creator() for _ in range(16)))
        await manager.quiescent()
        elapsed = time.perf_counter() - started
        resident = len(manager.agents)
        servers_running = _server_processes()
        grown = vm_rss_kib(os.getpid()) - before
        opened = servers.connection("time").opened
    report = bed.report
    report.add(
        Figure(
            f"{count} resident agents that each called one stdio MCP server: server processes",
            servers_running,
            "processes",
            target=1,
            better="lower",
        ),
        Figure(f"{count} resident agents: connections opened to the server", opened, "count"),
        Figure(f"{count} resident agents: resident after their calls", resident, "agents"),
        Figure(f"{count} resident agents: time to create them and their calls", elapsed, "s"),
        Figure(
            f"{count} resident agents: memory growth of the process, per agent",
            grown / max(1, count),
            "KiB",
        ),
    )


def _server_processes() -> int:
    """Running ``mcp_server_time`` servers started (through the reaper) by this process."""
    me = os.getpid()
    tree = process_tree(me)
    reapers = {
        pid
        for pid, (parent, command) in tree.items()
        if parent == me and "dsh_mesh.mcp._reaper" in command
    }
    return sum(
        parent in reapers and "mcp_server_time" in command for parent, command in tree.values()
    )
