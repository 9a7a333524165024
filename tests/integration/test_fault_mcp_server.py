"""The fault runs' MCP server (``dsh_mesh/testing/fault_mcp_server.py``), run by a node's MCP
connection as the fault runs run it: a kill the fault driver aims by the server's busy markers
lands mid-call, that call is answered with an error and the next one starts the server again;
its huge answers are cut at the limit; its ``die`` ends it mid-call; and the finder of servers
mid-call never names a process that is no fault server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from dsh_mesh.mcp import McpServers
from dsh_mesh.testing._edges import MCP_DIE, MCP_ECHO, MCP_HUGE, MCP_MAX_OUTPUT, NOTE_ROOM
from dsh_mesh.testing._workload import FAULT_MCP
from dsh_mesh.testing.fault_mcp_server import BUSY_ENV, forget, servers_mid_call
from dsh_mesh.tools import ToolOutput
from tests.integration.conftest import call_tool

pytestmark = pytest.mark.timeout(60)


async def mid_call(busy: Path) -> list[int]:
    """Wait until a fault server holds a call (no event to await: its marker file)."""
    async with asyncio.timeout(20):
        while not (pids := servers_mid_call(busy)):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    return pids


async def test_a_kill_aimed_by_the_busy_markers_lands_mid_call_and_the_server_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BUSY_ENV, str(tmp_path))  # the node's environment, which the server gets
    monkeypatch.setattr("dsh_mesh.mcp._servers.LISTING_TTL", 0.0)
    async with McpServers([FAULT_MCP]) as servers:
        await servers.load("mcp:faults")
        tools = {t.descriptor.name: t for t in servers.select("mcp:faults")}
        assert set(tools) == {MCP_ECHO, MCP_HUGE, MCP_DIE}
        assert await call_tool(tools[MCP_ECHO], {"text": "first"}) == ToolOutput(content="first")

        running = asyncio.ensure_future(call_tool(tools[MCP_ECHO], {"text": "killed"}, "c-2"))
        [pid] = await mid_call(tmp_path)
        os.kill(pid, signal.SIGKILL)
        forget(tmp_path, pid)
        killed = await running
        assert killed.is_error and "may or may not have reached the server" in killed.content
        assert await call_tool(tools[MCP_ECHO], {"text": "back"}, "c-3") == ToolOutput(
            content="back"
        )
        assert servers.connection("faults").opened == 2

        for size in ("large", "oversized"):  # past the limit; past one message's bound too
            huge = await call_tool(tools[MCP_HUGE], {"size": size}, f"c-{size}")
            assert "[output cut:" in huge.content, huge.content[-300:]
            assert len(huge.content) <= MCP_MAX_OUTPUT + NOTE_ROOM

        died = await call_tool(tools[MCP_DIE], {}, "c-die")
        assert died.is_error and "may or may not have reached the server" in died.content
        assert servers_mid_call(tmp_path) == []  # it left no marker behind
        assert await call_tool(tools[MCP_ECHO], {"text": "again"}, "c-4") == ToolOutput(
            content="again"
        )
        assert servers.connection("faults").opened == 3


def test_the_finder_never_names_a_process_that_is_no_fault_server(tmp_path: Path) -> None:
    (tmp_path / f"busy.{os.getpid()}.0").touch()  # this test process: no fault server
    (tmp_path / "busy.999999999.0").touch()  # no such process
    (tmp_path / "busy.garbage").touch()
    assert servers_mid_call(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy.garbage"]
