"""Serving the web view: uvicorn on a socket bound before it starts, so the address is known
(port 0 picks a free one) and printed only once the server listens."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn

from dsh_mesh.client import MeshClient
from dsh_mesh.ui._app import create_app


@dataclass(frozen=True, kw_only=True)
class ViewAddress:
    """Where a running web view listens."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"


@contextlib.asynccontextmanager
async def serving(
    client: MeshClient, *, host: str = "127.0.0.1", port: int = 0, trace_url: str = ""
) -> AsyncIterator[ViewAddress]:
    """Serve the web view over ``client`` for the duration of the block; yields once it
    listens. Leaving the block stops it (open event streams are cut)."""
    bound = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    bound.bind((host, port))
    config = uvicorn.Config(
        create_app(client, trace_url=trace_url),
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[bound]), name="dsh-mesh ui")
    try:
        while not server.started:
            if task.done():
                await task  # it failed to start: raise why
                raise RuntimeError("the web view stopped before it listened")
            await asyncio.sleep(0.02)
        yield ViewAddress(host=host, port=bound.getsockname()[1])
    finally:
        server.should_exit = True
        server.force_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        bound.close()
