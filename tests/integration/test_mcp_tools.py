"""MCP servers as tools, against real servers: the test's own over streamable HTTP on
loopback, and the published stdio server ``mcp-server-time`` (PyPI). One connection per node per
server; the call's idempotency key reaches the server in ``_meta``; progress resets the idle
limit; a timeout cancels the call on the server; the concurrency bound holds."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from dsh_mesh.core import AbortSignal, ActivationId, AgentRef, SessionId, ToolCall
from dsh_mesh.mcp import McpServerConfig, McpServers
from dsh_mesh.tools import CallLimits, Tool, ToolInvocation, ToolOutput, run_limited
from tests.integration.mcp_test_server import Observed, serving

CALLER = AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1"))
TIME_SERVER = (sys.executable, ("-m", "mcp_server_time", "--local-timezone", "UTC"))


def invocation(tool: Tool, call_id: str = "c-1") -> ToolInvocation:
    return ToolInvocation(
        caller=CALLER,
        call=ToolCall(call_id=call_id, name=tool.descriptor.name, arguments_json="{}"),
        signal=AbortSignal(),
        step_seq=4,
        index=0,
    )


async def call(tool: Tool, arguments: dict[str, object], call_id: str = "c-1") -> ToolOutput:
    return await run_limited(tool, invocation(tool, call_id), arguments, tool.limits)  # type: ignore[attr-defined]


@pytest.fixture
async def http_server() -> AsyncIterator[tuple[str, Observed]]:
    observed = Observed()
    async with serving(observed) as url:
        yield url, observed


async def test_a_streamable_http_servers_tools_carry_the_key_and_honour_the_limits(
    http_server: tuple[str, Observed],
) -> None:
    url, observed = http_server
    config = McpServerConfig(
        name="docs",
        url=url,
        limits=CallLimits(timeout=timedelta(seconds=1), idle_timeout=timedelta(seconds=0.4)),
        max_concurrency=2,
    )
    async with McpServers([config]) as servers:
        await servers.load("mcp:docs")
        tools = {t.descriptor.name: t for t in servers.select("mcp:docs")}
        assert sorted(tools) == ["docs__forever", "docs__slow", "docs__whoami"]
        schema = json.loads(tools["docs__slow"].descriptor.input_schema_json)
        assert sorted(schema["properties"]) == ["beats", "seconds"]

        # The idempotency key travels in _meta.
        output = await call(tools["docs__whoami"], {})
        assert output == ToolOutput(content="4.0.c-1") and observed.keys == ["4.0.c-1"]

        # 0.9 s of work with progress every 0.1 s: never idle 0.4 s, within the 1 s limit.
        assert (await call(tools["docs__slow"], {"seconds": 0.9, "beats": 9})).content == (
            "slow done"
        )
        # The same without progress: idle past 0.4 s.
        silent = await call(tools["docs__slow"], {"seconds": 0.9, "beats": 1})
        assert silent.is_error and "no progress for 0.4 s" in silent.content

        # Past its limit (here the idle one): answered, and the server's handler cancelled.
        stuck = await call(tools["docs__forever"], {})
        assert stuck.is_error and stuck.content.startswith("timed out: no progress for 0.4 s")
        await asyncio.wait_for(observed.cancelled.wait(), 5)

        # At most max_concurrency calls in flight on the node's one connection.
        observed.most_in_flight = 0
        outputs = await asyncio.gather(
            *(call(tools["docs__slow"], {"seconds": 0.15, "beats": 3}, f"c-{n}") for n in range(5))
        )
        assert all(o.content == "slow done" for o in outputs)
        assert observed.most_in_flight == 2
        assert servers.connection("docs").opened == 1  # one connection for all of it


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry)] = (parent, command)
    return found


def descendants(pid: int) -> dict[int, str]:
    processes = _processes()
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, command) in processes.items():
            if ppid == parent and child not in found:
                found[child] = command
                frontier.append(child)
    return found


async def test_a_stdio_server_is_one_process_shared_closed_when_idle_and_on_exit() -> None:
    command, args = TIME_SERVER
    config = McpServerConfig(
        name="time", command=command, args=args, idle_close=timedelta(seconds=1)
    )
    async with McpServers([config]) as servers:
        await servers.load("mcp:time/get_current_time")
        [tool] = servers.select("mcp:time/get_current_time")
        assert tool.descriptor.name == "time__get_current_time"
        outputs = await asyncio.gather(*(call(tool, {"timezone": "UTC"}) for _ in range(8)))
        assert all(json.loads(o.content)["timezone"] == "UTC" for o in outputs)
        servers_running = [c for c in descendants(os.getpid()).values() if "mcp_server_time" in c]
        assert len(servers_running) == 2  # the reaper and the one server it started
        connection = servers.connection("time")
        async with asyncio.timeout(10):
            while connection.is_open:  # noqa: ASYNC110 (idle for 1 s: closed; no event to await)
                await asyncio.sleep(0.1)
        assert not [c for c in descendants(os.getpid()).values() if "mcp_server_time" in c]
        assert not json.loads((await call(tool, {"timezone": "UTC"})).content).get("error")
        assert connection.opened == 2  # opened again by the next call
    assert not [c for c in descendants(os.getpid()).values() if "mcp_server_time" in c]
