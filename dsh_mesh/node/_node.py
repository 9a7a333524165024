"""One node: the components of a node process and their single lifecycle.

``Node.run()`` connects to etcd, starts the gRPC server (AgentMesh, MeshPeer, MeshControl,
health, reflection; mutual TLS, or plaintext with a loud warning when the configuration asks
for it), follows the directory, and then, for as long as it is not stopped: grants a
lease, registers, hosts agents under a fresh continuation manager, and keeps the lease alive. A
lost lease fences the node at once (its agents stop, its health turns NOT_SERVING, it accepts
nothing) until it has a new lease and has registered again. :meth:`Node.stop` (SIGTERM) drains:
running turns get the grace period, activations are released so other nodes can cold-resume
them at once, the lease is revoked and the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dsh_mesh import telemetry
from dsh_mesh._proto.dsh.mesh.peer.v1 import peer_pb2, peer_pb2_grpc
from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import Activation, MeshError, NodeFenced, RandomIds
from dsh_mesh.logstore import open_log_store
from dsh_mesh.mcp import McpServers
from dsh_mesh.node._config import NodeConfig
from dsh_mesh.node._expiry import ApprovalExpiry
from dsh_mesh.node._router import ClusterRouter
from dsh_mesh.node._scenario import Scenario
from dsh_mesh.node._sweep import Sweep
from dsh_mesh.node._threads import ToolThreads
from dsh_mesh.registry import (
    ActivationEnded,
    Directory,
    DirectoryEvent,
    Etcd,
    EtcdSessionStore,
    HeldIndex,
    IndexCache,
    Keys,
    LeaseKeeper,
    LeaseLost,
    NodeInfo,
    RegistryReads,
    Retention,
    TreeStopped,
)
from dsh_mesh.registry._etcd import put
from dsh_mesh.runtime import (
    ContinuationManager,
    DeltaHub,
    HistoryLog,
    RecordingStore,
    SessionStore,
)
from dsh_mesh.transport import (
    AgentMeshService,
    ClusterAuthInterceptor,
    MeshControlService,
    MeshPeerService,
    MethodAwarePool,
    NodeHealth,
    PeerPool,
)

_log = logging.getLogger(__name__)
PLAINTEXT_WARNING = (
    "!!! PLAINTEXT: node %s serves gRPC at %s and talks to etcd at %s WITHOUT TLS. Callers "
    "are not authenticated beyond the shared cluster token, which crosses the network in "
    "clear, and a node's id is whatever it claims. Use this only for a local demo on "
    "loopback; configure tls_cert, tls_key and tls_ca for anything else (ADR 0021). !!!"
)
WAITING_SAID_EVERY = timedelta(seconds=5)
"""How often a node starting while etcd does not answer says it still waits (ADR 0048)."""
_SERVER_GRACE = timedelta(seconds=1)
_REGISTER_RETRY = timedelta(milliseconds=500)


class Node:
    """A node process's components. Call :meth:`run` once; :meth:`stop` is idempotent and safe
    from a signal handler."""

    def __init__(self, config: NodeConfig, scenario: Scenario) -> None:
        self.config = config
        self._scenario = scenario
        self._provider = scenario.provider()
        self._namespaces = config.namespaces()  # read once: every node reads the same file
        # Blocking Python tools run here, never on the loop: a tool that blocks for a minute
        # must not delay the lease's renewal. Its threads cannot be stopped; at exit the node
        # does not wait for them (a call still running was answered when its turn ended).
        self._deltas = DeltaHub()
        """Its agents' model text as it is generated, for watches (ADR 0053): one per node,
        outliving its managers."""
        self._tool_threads = ToolThreads(scenario.tool_threads, name=f"dsh-tool-{config.node_id}")
        self._stopping = asyncio.Event()
        self._manager: ContinuationManager | None = None
        self._mcp_servers: McpServers | None = None
        self._group: asyncio.TaskGroup | None = None
        self.address: str | None = None
        """``host:port`` other nodes dial; set once the server listens."""
        telemetry.observe_node(
            resident_agents=lambda: 0 if self._manager is None else len(self._manager.agents),
            inbox_depth=lambda: (
                0 if self._manager is None else sum(a.inbox_depth for a in self._manager.agents)
            ),
        )

    def stop(self) -> None:
        """Ask the node to drain and exit."""
        self._stopping.set()

    def manager(self) -> ContinuationManager:
        """The current manager; raises :class:`NodeFenced` while the node holds no lease."""
        if self._manager is None:
            raise NodeFenced(f"node {self.config.node_id} holds no lease right now")
        return self._manager

    async def run(self, *, ready: Callable[[str], None] | None = None) -> None:
        """Serve until :meth:`stop`; ``ready(address)`` is called once the node first serves."""
        config = self.config
        keys = Keys(config.key_prefix.encode())
        log = open_log_store(config.log_store)  # opens on first use: a database down is an outage
        async with (
            Etcd(config.etcd_config()) as etcd,
            contextlib.aclosing(log),
            _shut_down_at_exit(self._tool_threads),
            McpServers(self._scenario.mcp_servers, grace=config.shutdown_grace) as mcp_servers,
        ):
            self._mcp_servers = mcp_servers
            lease = LeaseKeeper(etcd, config.lease)
            directory = Directory(etcd, keys, on_event=self._on_directory_event)
            indexes = IndexCache(etcd, RegistryReads.cached_indexes(keys))
            cached = EtcdSessionStore(
                etcd,
                keys,
                log=log,
                lease=lambda: lease.lease_id,
                directory=directory,
                indexes=indexes,
            )
            store: SessionStore = cached
            history = None
            if config.history_file is not None:
                history = HistoryLog(config.history_file, node=config.node_id).open()
                store = RecordingStore(cached, history)
            pool = PeerPool(
                node_id=config.node_id,
                credential=config.credential,
                address_of=lambda node: _address(directory, node),
                tls=config.tls,
            )
            router = ClusterRouter(
                node_id=config.node_id,
                directory=directory,
                pool=pool,
                placement=config.placement,
            )
            health = NodeHealth(log.condition.degraded)
            server = grpc.aio.server(
                interceptors=[
                    *telemetry.server_interceptors(),
                    ClusterAuthInterceptor(
                        config.credential, client_tokens=self._namespaces.grants
                    ),
                ]
            )
            messages = AgentMeshService(self.manager, cached.current_activation)
            mesh_pb2_grpc.add_AgentMeshServicer_to_server(messages, server)
            mesh_pb2_grpc.add_MeshControlServicer_to_server(
                MeshControlService(
                    self.manager,
                    node_id=config.node_id,
                    reads=RegistryReads(etcd, keys, log, cache=indexes),
                    current_activation=cached.current_activation,
                    peers=pool,
                    grants=self._namespaces.grants,
                    credential=config.credential,
                    prices=self._scenario.prices,
                    deltas=self._deltas,
                ),
                server,
            )
            peer_pb2_grpc.add_MeshPeerServicer_to_server(
                MeshPeerService(self.manager, messages, self._deltas), server
            )
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            reflection.enable_server_reflection(
                (
                    mesh_pb2.DESCRIPTOR.services_by_name["AgentMesh"].full_name,
                    mesh_pb2.DESCRIPTOR.services_by_name["MeshControl"].full_name,
                    peer_pb2.DESCRIPTOR.services_by_name["MeshPeer"].full_name,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                server,
                pool=MethodAwarePool(),
            )
            if config.tls is not None:
                port = server.add_secure_port(config.listen, config.tls.server_credentials())
            else:
                port = server.add_insecure_port(config.listen)
            self.address = f"{config.advertise_host or config.listen_host}:{port}"
            if config.plaintext:
                _log.warning(PLAINTEXT_WARNING, config.node_id, self.address, config.etcd.endpoint)
            await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await server.start()
            try:
                async with pool, asyncio.TaskGroup() as group:
                    self._group = group
                    following = group.create_task(directory.follow(), name="directory")
                    # Listings read etcd alone until it has loaded (ADR 0046).
                    indexing = group.create_task(indexes.follow(), name="index cache")
                    if await _until_etcd_answers(directory, config.etcd.endpoint, self._stopping):
                        retention = Retention(etcd, keys, log)
                        expiry = ApprovalExpiry(log=log, store=store)
                        await self._serve(
                            etcd,
                            keys,
                            lease,
                            store,
                            router,
                            health,
                            ready,
                            retention,
                            directory,
                            expiry,
                        )
                    following.cancel()
                    indexing.cancel()
            finally:
                self._group = None
                with contextlib.suppress(MeshError):
                    await lease.revoke()
                await server.stop(_SERVER_GRACE.total_seconds())
                # Nothing appends any more (the manager closed, the server stopped): end the
                # store's group commits while the etcd client is still open.
                await cached.aclose()
                await self._provider.aclose()
                if history is not None:
                    history.close()

    async def _serve(
        self,
        etcd: Etcd,
        keys: Keys,
        lease: LeaseKeeper,
        store: SessionStore,
        router: ClusterRouter,
        health: NodeHealth,
        ready: Callable[[str], None] | None,
        retention: Retention,
        directory: Directory,
        expiry: ApprovalExpiry,
    ) -> None:
        assert self.address is not None
        while not self._stopping.is_set():
            try:
                await lease.grant()
                # Among the holders before anything is won under it: once it dies, a sweep
                # finds what it held (ADR 0043).
                await HeldIndex(etcd, keys).register(lease.lease_id, self.config.node_id)
                await self._register(etcd, keys, lease.lease_id, load=0)
            except MeshError as unreachable:
                # etcd is away: stay fenced (NOT_SERVING, accepting nothing) and try again.
                _log.warning("node %s cannot register: %s", self.config.node_id, unreachable)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), _REGISTER_RETRY.total_seconds())
                continue
            async with ContinuationManager(
                store=store,
                provider=self._provider,
                presets=self._scenario.presets,
                config=self.config.manager_config(self._namespaces),
                ids=RandomIds(),
                router=router,
                tools=self._scenario.tools,
                tool_executor=self._tool_threads,
                tool_source=self._mcp_servers,
                deltas=self._deltas,
            ) as manager:
                self._manager = manager
                await health.set("", health_pb2.HealthCheckResponse.SERVING)
                _log.info("node %s serving at %s", self.config.node_id, self.address)
                if ready is not None:
                    ready(self.address)
                    ready = None
                lost = await self._hold(
                    etcd, keys, lease, manager, router, retention, directory, expiry
                )
                await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                self._manager = None
                if lost:
                    # Fenced: the lease (and every activation bound to it) is gone or about to
                    # be. Stop every agent now; nothing of them may be written any more.
                    _log.error("node %s lost its lease: fenced", self.config.node_id)
                    telemetry.lease_lost()
                    manager.shutdown()
                else:
                    # Its activations end with its lease, revoked as it exits: one etcd
                    # request for them all, where releasing each took seconds per 10,000
                    # (ADR 0046). Unclean either way: the sweep finishes them (ADR 0043).
                    await manager.drain(self.config.shutdown_grace, release=False)

    async def _hold(
        self,
        etcd: Etcd,
        keys: Keys,
        lease: LeaseKeeper,
        manager: ContinuationManager,
        router: ClusterRouter,
        retention: Retention,
        directory: Directory,
        expiry: ApprovalExpiry,
    ) -> bool:
        """Keep the lease, publish load, run retention and expire approval requests until
        stopped (False) or the lease is lost (True)."""
        keeping = asyncio.create_task(lease.keep(), name="lease keepalive")
        stopping = asyncio.create_task(self._stopping.wait(), name="stop request")
        publishing = asyncio.create_task(
            self._publish_load(etcd, keys, lease, manager, router), name="load"
        )
        guarding = asyncio.create_task(self._guard_memory(manager), name="memory")
        retaining = asyncio.create_task(self._retain(retention, directory), name="retention")
        expiring = asyncio.create_task(self._expire(expiry, manager), name="approval expiry")
        sweep = Sweep(
            HeldIndex(etcd, keys),
            node_id=self.config.node_id,
            interval=self.config.sweep_interval,
            live_nodes=lambda: directory.nodes().keys(),
        )
        sweeping = asyncio.create_task(sweep.run(manager, lease.lease_id), name="sweep")
        tasks = (keeping, stopping, publishing, guarding, retaining, expiring, sweeping)
        try:
            await asyncio.wait((keeping, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        return isinstance(results[0], LeaseLost)

    async def _retain(self, retention: Retention, directory: Directory) -> None:
        """Every ``retention_interval``, if this is the live node with the lowest id: delete
        the settled trees idle past ``retention_days`` and forget the idempotency records
        older than ``idempotency_days`` (either off at 0). Several nodes running it at once
        (the directory lags) is safe: every deletion is conditional and idempotent."""
        config = self.config
        if not config.retention_days and not config.idempotency_days:
            return
        while True:
            await asyncio.sleep(config.retention_interval.total_seconds())
            live = directory.nodes()
            if live and min(live) != config.node_id:
                continue
            try:
                if config.retention_days:
                    pruned = await retention.prune(
                        older_than=timedelta(days=config.retention_days),
                        archive=config.retention_archive_dir,
                    )
                    if pruned.trees or pruned.woke:
                        _log.info(
                            "retention: deleted %d trees (%d sessions)",
                            len(pruned.trees),
                            pruned.sessions,
                        )
                if config.idempotency_days:
                    await retention.expire_keys(older_than=timedelta(days=config.idempotency_days))
            except (MeshError, OSError) as failure:
                _log.warning("retention: not run this time (%s)", failure)
            except Exception:  # a defect: logged with its trace, and tried again next time
                _log.exception("retention: not run this time")

    async def _expire(self, expiry: ApprovalExpiry, manager: ContinuationManager) -> None:
        """Every ``approval_sweep_interval``: wake the absent agents whose approval requests
        expired, so that they answer them as denied and go on (docs/approvals.md)."""
        while True:
            await asyncio.sleep(self.config.approval_sweep_interval.total_seconds())
            try:
                woken = await expiry.sweep(manager)
            except MeshError as failure:
                _log.warning("approval expiry: not run this time (%s)", failure)
                continue
            except Exception:  # a defect: logged with its trace, and tried again next time
                _log.exception("approval expiry: not run this time")
                continue
            if woken:
                _log.info("approval expiry: resumed %d absent agent(s)", len(woken))

    async def _guard_memory(self, manager: ContinuationManager) -> None:
        """Past the memory high-water mark, passivate a tenth of the idle agents (at least
        one) each interval until the node's RSS is back under it: idle agents are the memory a
        node can give back without losing anything, since their sessions are durable."""
        high_water = self.config.memory_high_water()
        if high_water is None:
            return
        while True:
            await asyncio.sleep(self.config.load_interval.total_seconds())
            rss = resident_memory()
            if rss is None or rss <= high_water:
                continue
            count = manager.passivate_idle(max(1, len(manager.agents) // 10))
            if count:
                _log.warning(
                    "node %s: memory %d MiB over %d MiB: passivating %d idle agents",
                    self.config.node_id,
                    rss >> 20,
                    high_water >> 20,
                    count,
                )

    async def _publish_load(
        self,
        etcd: Etcd,
        keys: Keys,
        lease: LeaseKeeper,
        manager: ContinuationManager,
        router: ClusterRouter,
    ) -> None:
        published = 0
        while True:
            load = len(manager.agents)
            router.local_load = load
            if load != published:
                with contextlib.suppress(MeshError):
                    await self._register(etcd, keys, lease.lease_id, load=load)
                    published = load
            await asyncio.sleep(self.config.load_interval.total_seconds())

    async def _register(self, etcd: Etcd, keys: Keys, lease_id: int, *, load: int) -> None:
        assert self.address is not None
        info = NodeInfo(node_id=self.config.node_id, address=self.address, load=load)
        await etcd.txn([], [put(keys.node(self.config.node_id), info.encode(), lease=lease_id)])

    def _on_directory_event(self, event: DirectoryEvent) -> None:
        if isinstance(event, TreeStopped) and self._manager is not None:
            self._manager.stop_seen(event.stop)  # whoever made it: this node's agents stop
        if isinstance(event, ActivationEnded) and self._group is not None and self._manager:
            self._group.create_task(self._activation_ended(self._manager, event.activation))

    async def _activation_ended(self, manager: ContinuationManager, ended: Activation) -> None:
        """The manager's reaction to ``ended``; its failure is logged, never the node's (it
        runs in the node's task group, where an exception would end the node): the sweep
        finishes what it left (ADR 0043)."""
        try:
            await manager.activation_ended(ended)
        except MeshError as error:
            _log.warning("could not settle lost activation %s: %s", ended.activation_id, error)
        except Exception:
            _log.exception("could not settle lost activation %s", ended.activation_id)


def _address(directory: Directory, node: str) -> str | None:
    info = directory.nodes().get(node)  # type: ignore[call-overload]
    return None if info is None else info.address


def resident_memory() -> int | None:
    """This process's resident set size in bytes (Linux ``/proc``); ``None`` elsewhere."""
    try:
        fields = Path("/proc/self/statm").read_text().split()
    except OSError:
        return None
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.asynccontextmanager
async def _shut_down_at_exit(executor: ToolThreads) -> AsyncIterator[None]:
    try:
        yield
    finally:
        executor.shutdown(wait=False)


async def _until_etcd_answers(directory: Directory, endpoint: str, stopping: asyncio.Event) -> bool:
    """True once the directory has loaded from etcd; False if the node is asked to stop first.
    A node started while etcd does not answer waits for it, health ``NOT_SERVING``, saying so
    (and why) every :data:`WAITING_SAID_EVERY`, instead of dying: it serves as soon as etcd is
    back."""
    loaded = asyncio.ensure_future(directory.ready())
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        while True:
            done, _ = await asyncio.wait(
                {loaded, stopped},
                timeout=WAITING_SAID_EVERY.total_seconds(),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if loaded in done:
                return True
            if stopped in done:
                return False
            _log.warning(
                "waiting for etcd at %s before serving: %s",
                endpoint,
                directory.trouble or "no answer yet",
            )
    finally:
        loaded.cancel()
        stopped.cancel()
