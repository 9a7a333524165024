"""Serving the web view: uvicorn on a socket bound before it starts, so the address is known
(port 0 picks a free one) and printed only once the server listens, with the launch link that
signs a browser in (ADR 0041)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from dsh_mesh.client import MeshClient
from dsh_mesh.ui._app import create_app
from dsh_mesh.ui._guard import LOCAL_NAMES, ViewPolicy
from dsh_mesh.ui._people import SignIns


class ExposureRefused(ValueError):
    """The view was asked to listen beyond this machine with neither TLS nor a trusted
    proxy in front: its sign-in tokens and cookies would cross the network in the clear."""


@dataclass(frozen=True, kw_only=True)
class ViewAddress:
    """Where a running web view listens, and its launch token."""

    host: str
    port: int
    tls: bool = False
    launch_token: str = ""

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/"

    @property
    def sign_in_url(self) -> str:
        """The link that signs a browser in with the view's own credential (keep it secret:
        it is as good as that credential for whoever holds it)."""
        return f"{self.url}?token={self.launch_token}"


@dataclass(frozen=True, kw_only=True)
class ViewTls:
    """The view's own HTTPS certificate and key (PEM files)."""

    cert: Path
    key: Path


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps the view on this machine."""
    if host.lower() in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, *, tls: ViewTls | None, trusted_header: str) -> None:
    """Refuse (:class:`ExposureRefused`) to listen beyond loopback without TLS or a proxy."""
    if is_loopback(host) or tls is not None or trusted_header:
        return
    raise ExposureRefused(
        f"refusing to serve the web view on {host} in plain HTTP: whoever can reach that"
        " address could read its sign-in link and cookies off the network. Give it a"
        " certificate (--tls-cert FILE --tls-key FILE), or put an authenticating proxy in front"
        " and name the header it sets (--trusted-header, docs/ui.md), or listen on 127.0.0.1"
    )


@contextlib.asynccontextmanager
async def serving(
    client: MeshClient,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    trace_url: str = "",
    tls: ViewTls | None = None,
    allowed_hosts: Iterable[str] = (),
    trusted_header: str = "",
    trusted_proxies: Iterable[str] = ("127.0.0.1", "::1"),
    launch_token: str | None = None,
) -> AsyncIterator[ViewAddress]:
    """Serve the web view over ``client`` for the duration of the block; yields once it
    listens. Leaving the block stops it (open event streams are cut). Raises
    :class:`ExposureRefused` for a non-loopback ``host`` without ``tls`` or a
    ``trusted_header``."""
    check_exposure(host, tls=tls, trusted_header=trusted_header)
    bound = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    bound.bind((host, port))
    port = bound.getsockname()[1]
    policy = ViewPolicy.of(
        allowed_hosts=[host, *allowed_hosts],
        trusted_header=trusted_header,
        trusted_proxies=frozenset(trusted_proxies),
        tls=tls is not None,
        cookie=f"dsh-mesh-view-{port}",
    )
    sign_ins = SignIns(launch_token=launch_token)
    config = uvicorn.Config(
        create_app(client, trace_url=trace_url, policy=policy, sign_ins=sign_ins),
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,
        ssl_certfile=str(tls.cert) if tls else None,
        ssl_keyfile=str(tls.key) if tls else None,
        server_header=False,
        proxy_headers=False,  # X-Forwarded-For must not make a local process a trusted proxy
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[bound]), name="dsh-mesh ui")
    try:
        while not server.started:
            if task.done():
                await task  # it failed to start: raise why
                raise RuntimeError("the web view stopped before it listened")
            await asyncio.sleep(0.02)
        yield ViewAddress(
            host=host, port=port, tls=tls is not None, launch_token=sign_ins.launch_token
        )
    finally:
        server.should_exit = True
        server.force_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        bound.close()
