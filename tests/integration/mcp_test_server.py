"""MCP servers for the tests: one over streamable HTTP on loopback (the official SDK's
``MCPServer``, served by uvicorn on port 0 in the test's own event loop), and a faulty one over
stdio, run as its own process (``python -m tests.integration.mcp_test_server --stdio``): it
can die mid-call, answer tens of megabytes, spew stderr, hang or crash at start."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

from dsh_mesh.mcp import IDEMPOTENCY_META


@dataclass
class Observed:
    """What the server saw: idempotency keys, calls in flight at most, cancellations."""

    keys: list[str] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    forever_started: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    """Opens every ``gated_*`` call (until then they wait)."""
    gated: list[tuple[str, str]] = field(default_factory=list)
    """(tool, idempotency key) of every ``gated_*`` execution, in order."""


def build(observed: Observed) -> MCPServer:
    server = MCPServer("dsh-test")

    @server.tool()
    async def whoami(ctx: Context) -> str:
        """Say which idempotency key this call carries."""
        meta = ctx.request_context.meta or {}
        key = str(meta.get(IDEMPOTENCY_META, ""))
        observed.keys.append(key)
        return key

    @server.tool()
    async def slow(seconds: float, beats: int, ctx: Context) -> str:
        """Work for a while, reporting progress ``beats`` times."""
        observed.in_flight += 1
        observed.most_in_flight = max(observed.most_in_flight, observed.in_flight)
        try:
            for beat in range(beats):
                await asyncio.sleep(seconds / beats)
                await ctx.report_progress(beat + 1, beats)
        finally:
            observed.in_flight -= 1
        return "slow done"

    async def gated(name: str, ctx: Context) -> str:
        key = str((ctx.request_context.meta or {}).get(IDEMPOTENCY_META, ""))
        observed.gated.append((name, key))
        await observed.gate.wait()
        return f"{name} ran ({key})"

    @server.tool()
    async def gated_safe(ctx: Context) -> str:
        """Do something safe to repeat under one key, once the test lets it."""
        return await gated("gated_safe", ctx)

    @server.tool()
    async def gated_unsafe(ctx: Context) -> str:
        """Do something that must happen at most once, once the test lets it."""
        return await gated("gated_unsafe", ctx)

    @server.tool()
    async def forever() -> str:
        """Never return (until cancelled)."""
        observed.forever_started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            observed.cancelled.set()
            raise
        return "never"

    return server


@contextlib.asynccontextmanager
async def serving(
    observed: Observed, mcp: MCPServer | None = None, *, json_response: bool = False
) -> AsyncIterator[str]:
    """Serve the test server (or ``mcp``); yields its URL. With ``json_response`` it answers
    each request with one JSON body instead of an SSE stream."""
    app = (mcp or build(observed)).streamable_http_app(json_response=json_response)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


# -- the faulty stdio server -------------------------------------------------------------------


def build_faulty() -> MCPServer:
    """A stdio server whose tools misbehave on request."""
    server = MCPServer("dsh-faulty")

    @server.tool()
    async def echo(text: str) -> str:
        """Say ``text`` back."""
        return text

    @server.tool()
    async def die() -> str:
        """Exit the server's process in the middle of the call."""
        os._exit(3)

    @server.tool()
    async def huge(megabytes: int) -> str:
        """Answer ``megabytes`` MB of text."""
        return "x" * (megabytes * 1024 * 1024)

    @server.tool()
    async def spew(kilobytes: int) -> str:
        """Write ``kilobytes`` KB of numbered lines to stderr, then answer."""
        line = "spew " + "." * 90
        for n in range(kilobytes * 1024 // 100):
            print(f"{n:04d}{line}", file=sys.stderr)
        print("the last line spewed", file=sys.stderr, flush=True)
        return "spewed"

    return server


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stdio", action="store_true", required=True)
    parser.add_argument("--start", choices=["ok", "hang", "crash"], default="ok")
    parser.add_argument("--launches", type=Path, help="append this process's pid to FILE")
    parser.add_argument("--ignore-sigterm", action="store_true")
    args = parser.parse_args(argv)
    if args.launches is not None:
        with args.launches.open("a") as launches:
            print(os.getpid(), file=launches)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.start == "crash":
        print("faulty server: boom at start", file=sys.stderr, flush=True)
        return 4
    if args.start == "hang":
        while True:  # never answers initialize
            time.sleep(3600)
    build_faulty().run("stdio")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
