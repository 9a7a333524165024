"""Real node processes on loopback, for integration tests and the demo.

:class:`NodeProcess` runs ``python -m dsh_mesh.node`` as its own process on port 0 and waits for
its ready line (never a fixed sleep). :class:`LocalCluster` starts several against one etcd
under a key prefix of their own, so clusters sharing an etcd never see each other; it always
reaps its processes, also when a test fails.

By default the nodes run plaintext, asked for explicitly (``--plaintext``: each node logs its
warning). With ``tls=LocalPki(...)`` every node gets a certificate from that CA and runs mutual
TLS, towards other nodes and towards etcd, which must then be an ``EtcdServer(tls=...)`` of the
same CA.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import grpc

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.core import (
    DEFAULT_NAMESPACE,
    Activation,
    NodeId,
    Record,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
)
from dsh_mesh.logstore import open_log_store
from dsh_mesh.registry import (
    ROOT_USER,
    Etcd,
    EtcdConfig,
    EtcdSessionStore,
    Keys,
    NodeInfo,
    grant_mesh_access,
)
from dsh_mesh.registry._codec import decode_activation, decode_header
from dsh_mesh.testing._pki import LocalPki, TlsFiles
from dsh_mesh.transport import secure_channel

T = TypeVar("T")

_READY_TIMEOUT = 30.0
_POLL_SECONDS = 0.05
_STOP_TIMEOUT = 15.0
_live: weakref.WeakSet[NodeProcess] = weakref.WeakSet()
_SECURITY_ENV = frozenset(
    {"DSH_TLS_CERT", "DSH_TLS_KEY", "DSH_TLS_CA", "DSH_PLAINTEXT", "DSH_CLUSTER_TOKEN"}
)


class NodeProcessError(RuntimeError):
    """A node process failed to start or stop as asked; the message carries its log tail."""


READER = "mesh-reader"
"""The identity a test process reads a cluster's etcd as (a node-like one under least
privilege: etcd refuses client certificates there)."""


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    """What every node of one local cluster shares."""

    etcd_endpoint: str
    scenario: str
    key_prefix: str
    cluster_token: str
    log_store: str
    """The log store every node names (``sqlite:PATH`` or a PostgreSQL DSN)."""
    placement: str = "others-first"
    lease_ttl: float = 2.0
    shutdown_grace: float = 1.0
    tls: LocalPki | None = None
    """The CA of a mutual-TLS cluster (nodes and etcd); None: plaintext, asked for explicitly.
    Under TLS the nodes check no cluster token: the certificate is the credential."""
    history: bool = False
    """Every node appends its store history to :attr:`NodeProcess.history_path`, for the history
    checker (:func:`dsh_mesh.testing.check`)."""
    presets_file: Path | None = None
    """The presets file every node reads (presets and model endpoints, docs/presets.md)."""
    least_privilege: bool = False
    """Under TLS: etcd's auth is on and only node identities reach it, each limited to the
    key prefix (ADR 0032); a test process reads etcd as a node-like identity of its own."""

    def client_files(self, name: str = "tester") -> TlsFiles | None:
        """A client certificate of this cluster's CA (None for a plaintext cluster)."""
        return None if self.tls is None else self.tls.client(name)

    def etcd_config(self, *, reader: str = READER) -> EtcdConfig:
        """How a test process reaches this cluster's etcd (with a client certificate under
        TLS)."""
        files = self.client_files(reader)
        if self.tls is not None and self.least_privilege:
            files = self.tls.node(reader)  # a client certificate is refused by etcd here
        return EtcdConfig(
            endpoint=self.etcd_endpoint, tls=None if files is None else files.etcd_tls()
        )

    def etcd_root_config(self) -> EtcdConfig:
        """How etcd's root user reaches this cluster's etcd (under TLS: its certificate), to
        set up least privilege."""
        tls = None if self.tls is None else self.tls.node(ROOT_USER).etcd_tls()
        return EtcdConfig(endpoint=self.etcd_endpoint, tls=tls)


class NodeProcess:
    """One node as a child process. ``start()`` returns once the node serves."""

    def __init__(
        self,
        node_id: str,
        settings: ClusterSettings,
        *,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.log_path = log_dir / f"{node_id}.log"
        self.history_path = log_dir / f"{node_id}.history.jsonl"
        """Where the node appends its store history when the cluster keeps one."""
        self._env = dict(env or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._asked_to_stop = False
        self.address: str | None = None

    @property
    def pid(self) -> int:
        """The running process's pid."""
        if self._process is None:
            raise NodeProcessError(f"{self.node_id} is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        """True while the process has not exited."""
        return self._process is not None and self._process.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The last process's exit status once it has ended (negative: the signal that ended
        it); None while it runs, and before it first starts."""
        return None if self._process is None else self._process.poll()

    def command(self) -> list[str]:
        """The command line that starts this node."""
        s = self.settings
        return [
            sys.executable,
            "-m",
            "dsh_mesh.node",
            "--node-id",
            self.node_id,
            "--listen",
            "127.0.0.1:0",
            "--etcd",
            s.etcd_endpoint,
            "--key-prefix",
            s.key_prefix,
            "--log-store",
            s.log_store,
            "--lease-ttl",
            str(s.lease_ttl),
            "--placement",
            s.placement,
            "--scenario",
            s.scenario,
            "--shutdown-grace",
            str(s.shutdown_grace),
            *(["--history-file", str(self.history_path)] if s.history else []),
            *(["--presets-file", str(s.presets_file)] if s.presets_file is not None else []),
            *self._security(),
        ]

    def _security(self) -> list[str]:
        if self.settings.tls is None:
            return ["--plaintext"]
        files = self.settings.tls.node(self.node_id)
        return [
            "--tls-cert",
            str(files.cert),
            "--tls-key",
            str(files.key),
            "--tls-ca",
            str(files.ca),
        ]

    def start(self) -> NodeProcess:
        """Start the process and wait for its ready line."""
        self._asked_to_stop = False
        # The cluster decides the node's security itself: a shell's DSH_TLS_* (exported for the
        # CLI), DSH_PLAINTEXT or DSH_CLUSTER_TOKEN must not leak into it; ``env`` still may.
        inherited = {k: v for k, v in os.environ.items() if k not in _SECURITY_ENV}
        env = {**inherited, **self._env}
        if self.settings.tls is None:
            env["DSH_CLUSTER_TOKEN"] = self.settings.cluster_token
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=Path.cwd(),
                # A group of its own: Ctrl-C at the terminal of `dsh-mesh up` (or of a test run)
                # reaches only the parent, which then drains the nodes in order.
                process_group=0,
            )
        _live.add(self)
        self.address = self._await_ready()
        return self

    def _await_ready(self) -> str:
        assert self._process is not None and self._process.stdout is not None
        deadline = time.monotonic() + _READY_TIMEOUT
        buffered = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=0.1):
                    if self._process.poll() is not None:
                        break
                    continue
                chunk = os.read(self._process.stdout.fileno(), 4096)
                if not chunk:
                    break
                buffered += chunk
                for line in buffered.split(b"\n")[:-1]:
                    event = json.loads(line)
                    if event.get("event") == "ready":
                        return str(event["address"])
        self.kill()
        raise NodeProcessError(f"{self.node_id} did not become ready:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the node's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def log(self) -> str:
        """The node's whole log so far."""
        return self.log_path.read_text(errors="replace")

    def ask_to_stop(self) -> None:
        """SIGTERM (graceful drain) without waiting: several nodes drain at once."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            self._asked_to_stop = True

    def terminate(self, timeout: float = _STOP_TIMEOUT) -> int:
        """SIGTERM (graceful drain, unless :meth:`ask_to_stop` sent it already: once is the
        ask) and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self._process is None:
            return 0
        if self._process.poll() is None and not self._asked_to_stop:
            self._process.send_signal(signal.SIGTERM)
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise NodeProcessError(f"{self.node_id} ignored SIGTERM:\n{self.log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL (host failure) and reap. Idempotent."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)
            self._process.kill()
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def pause(self) -> None:
        """SIGSTOP: the process freezes (its lease will expire)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)


class LocalCluster:
    """N node processes against one etcd, under a fresh key prefix. A context manager; every
    process is reaped on exit. ``env`` is added to every node's environment (for example
    ``otel_env(receiver.endpoint)`` to export telemetry). ``tls`` runs the cluster under mutual
    TLS with certificates of that CA (etcd included); by default it runs plaintext. With
    ``history`` every node keeps a store history for the history checker."""

    def __init__(
        self,
        *,
        etcd_endpoint: str,
        scenario: str,
        nodes: Sequence[str] = ("node-a", "node-b", "node-c"),
        placement: str = "others-first",
        lease_ttl: float = 2.0,
        shutdown_grace: float = 1.0,
        log_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        tls: LocalPki | None = None,
        history: bool = False,
        presets_file: Path | None = None,
        log_store: str | None = None,
        least_privilege: bool = False,
    ) -> None:
        if least_privilege and tls is None:
            raise ValueError("least_privilege needs tls: etcd names its users by certificate")
        self._owned_dir = None if log_dir is not None else tempfile.TemporaryDirectory()
        self.log_dir = log_dir or Path(self._owned_dir.name if self._owned_dir else ".")
        self.settings = ClusterSettings(
            etcd_endpoint=etcd_endpoint,
            scenario=scenario,
            key_prefix=f"/dsh-{secrets.token_hex(4)}/",
            cluster_token=secrets.token_hex(16),
            placement=placement,
            lease_ttl=lease_ttl,
            shutdown_grace=shutdown_grace,
            tls=tls,
            history=history,
            presets_file=presets_file,
            log_store=log_store or f"sqlite:{self.log_dir / 'log.db'}",
            least_privilege=least_privilege,
        )
        self._env = dict(env or {})
        self.nodes = {
            node_id: NodeProcess(node_id, self.settings, log_dir=self.log_dir, env=self._env)
            for node_id in nodes
        }

    def __enter__(self) -> LocalCluster:
        try:
            self._grant(*self.nodes, READER)
            # One after another: a node that serves has seen every node before it register,
            # so placement right after the start already spreads over the cluster (nodes
            # started together may each know none of the others yet, and place locally).
            for node in self.nodes.values():
                node.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __getitem__(self, node_id: str) -> NodeProcess:
        return self.nodes[node_id]

    def __iter__(self) -> Iterator[NodeProcess]:
        return iter(self.nodes.values())

    def add(self, node_id: str) -> NodeProcess:
        """Start one more node in this cluster. Raises :class:`NodeProcessError` for an id the
        cluster already has (restart that node with ``cluster[node_id].start()``): replacing
        it would lose track of its process, which nothing would then stop."""
        if node_id in self.nodes:
            raise NodeProcessError(f"the cluster already has a node {node_id}")
        node = NodeProcess(node_id, self.settings, log_dir=self.log_dir, env=self._env)
        self.nodes[node_id] = node
        self._grant(node_id)
        return node.start()

    def _grant(self, *users: str) -> None:
        """Under least privilege: make ``users`` etcd users of this mesh's role (as etcd's
        root, from a thread of its own: a test may hold this thread's event loop)."""
        if self.settings.tls is None or not self.settings.least_privilege:
            return
        config = self.settings.etcd_root_config()
        prefix = self.settings.key_prefix.encode()

        async def grant() -> None:
            async with Etcd(config) as etcd:
                await grant_mesh_access(etcd, prefix=prefix, nodes=users)

        failure: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(grant())
            except Exception as error:  # raised again in the caller's thread
                failure.append(error)

        worker = threading.Thread(target=run, name="grant-mesh-access")
        worker.start()
        worker.join()
        if failure:
            raise failure[0]

    def channel(self, node_id: str, *, client: str = "tester") -> grpc.aio.Channel:
        """A new channel to node ``node_id`` as a client of this cluster: plaintext, or mutual
        TLS with the client certificate ``client`` (checking that the node's certificate names
        ``node_id``). The caller closes it (``async with``)."""
        address = self[node_id].address
        if address is None:
            raise NodeProcessError(f"{node_id} is not serving")
        files = self.settings.client_files(client)
        if files is None:
            return grpc.aio.insecure_channel(address)
        return secure_channel(address, files.credentials(), server_name=node_id)

    def metadata(self, node_id: str) -> tuple[tuple[str, str], ...]:
        """The call metadata a node of this cluster sends (to act as that node in tests)."""
        return (
            ("x-dsh-cluster-token", self.settings.cluster_token),
            ("x-dsh-node", node_id),
            ("x-dsh-hops", "0"),
        )

    def close(self) -> None:
        """Stop every node: SIGTERM first, SIGKILL for any that hangs. Idempotent."""
        for node in self.nodes.values():
            if node.running:
                # On failure terminate() has already killed and reaped the node.
                with contextlib.suppress(NodeProcessError):
                    node.terminate(timeout=5.0)
            node.kill()
        if self._owned_dir is not None:
            self._owned_dir.cleanup()
            self._owned_dir = None


@atexit.register
def _reap_leftovers() -> None:
    for node in list(_live):
        node.kill()


_HEADER_PAGE = 500
"""Headers a reader takes per etcd range (about 1 MB: under gRPC's 4 MiB message limit)."""


class MeshReader:
    """Reads a cluster's durable state straight from etcd (never through a node), so tests
    check what is really stored. ``async with MeshReader(settings) as reader``."""

    def __init__(self, settings: ClusterSettings) -> None:
        self._etcd = Etcd(settings.etcd_config())
        self.keys = Keys(settings.key_prefix.encode())
        self._log = open_log_store(settings.log_store)
        self._store = EtcdSessionStore(self._etcd, self.keys, log=self._log, lease=_no_lease)

    async def __aenter__(self) -> MeshReader:
        await self._etcd.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._log.aclose()
        await self._etcd.close()

    async def transcript(self, session: SessionId) -> list[Record]:
        """The session's durable transcript."""
        return await self._store.read(session)

    async def header(self, session: SessionId) -> SessionHeader | None:
        """The session's durable header."""
        return await self._store.get_header(session)

    async def activation(self, session: SessionId) -> Activation | None:
        """The session's current activation in etcd."""
        return await self._store.current_activation(session, fresh=True)

    async def sessions(self) -> list[SessionHeader]:
        """Every session header of the cluster, read a page at a time (a long fault run's
        headers outgrow one gRPC message)."""
        prefix = self.keys.prefix + b"headers/"
        headers: list[SessionHeader] = []
        start: bytes | None = None
        while True:
            response = await self._etcd.get_prefix(prefix, start=start, limit=_HEADER_PAGE)
            headers += [decode_header(kv.value) for kv in response.kvs]
            if not response.more:
                return headers
            start = response.kvs[-1].key + b"\0"

    async def activations(self) -> dict[SessionId, Activation]:
        """Every current activation of the cluster, by session (one range read)."""
        response = await self._etcd.get_prefix(self.keys.activations)
        return {
            self.keys.session_of_activation(kv.key): decode_activation(kv.value)
            for kv in response.kvs
        }

    async def node_load(self, node: str) -> int | None:
        """The load ``node`` last published: how many agents it holds in memory (``None`` while
        it is not registered)."""
        kv = await self._etcd.get(self.keys.node(NodeId(node)))
        return None if kv is None else NodeInfo.decode(kv.value).load

    async def live_sessions(self, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many sessions of ``namespace`` hold an activation: what its ``max_live_sessions``
        quota counts (ADR 0033)."""
        census = await self._store.namespace_census(namespace, since=datetime.now(UTC))
        return census.live_sessions

    async def wait_for(
        self,
        read: Callable[[], Awaitable[T]],
        predicate: Callable[[T], bool],
        *,
        within: float = 20.0,
        what: str = "condition",
    ) -> T:
        """Re-read until ``predicate`` holds; raise ``TimeoutError`` (with the last value) after
        ``within`` seconds. A bounded wait for a condition, never a fixed sleep."""
        deadline = asyncio.get_running_loop().time() + within
        while True:
            value = await read()
            if predicate(value):
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{what} did not hold within {within}s; last: {value!r}")
            await asyncio.sleep(_POLL_SECONDS)


class PatientReader(MeshReader):
    """A :class:`MeshReader` whose reads wait out a registry outage (an etcd election after a
    member was cut off or killed, or the whole cluster stopped) for up to ``patience`` seconds."""

    def __init__(self, settings: ClusterSettings, *, patience: float = 10.0) -> None:
        super().__init__(settings)
        self.patience = patience

    async def transcript(self, session: SessionId) -> list[Record]:
        return await patiently(
            lambda: super(PatientReader, self).transcript(session), within=self.patience
        )

    async def header(self, session: SessionId) -> SessionHeader | None:
        return await patiently(
            lambda: super(PatientReader, self).header(session), within=self.patience
        )

    async def activation(self, session: SessionId) -> Activation | None:
        return await patiently(
            lambda: super(PatientReader, self).activation(session), within=self.patience
        )

    async def sessions(self) -> list[SessionHeader]:
        return await patiently(lambda: super(PatientReader, self).sessions(), within=self.patience)

    async def activations(self) -> dict[SessionId, Activation]:
        return await patiently(
            lambda: super(PatientReader, self).activations(), within=self.patience
        )


async def patiently(read: Callable[[], Awaitable[T]], *, within: float = 10.0) -> T:
    """``read()``, retried while the registry is unavailable, for up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await read()
        except RegistryUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def _no_lease() -> int:
    raise RuntimeError("a MeshReader never writes")


async def create_root(
    cluster: LocalCluster, *, on: str, task: str, preset: str = "lead", client: str = "tester"
) -> SessionId:
    """``MeshControl.CreateRootSession`` on node ``on`` (with the cluster credential, named
    ``client``: its client certificate under TLS); returns the new root's id once it is
    durable and its first turn started. A refusal that says etcd or a peer is away for now
    (``UNAVAILABLE``: an etcd leader election, say) is retried with the same request id, as a
    client should, until ``_READY_TIMEOUT`` has passed."""
    request = mesh_pb2.CreateRootSessionRequest(
        preset=preset, initial_task=task, request_id=secrets.token_hex(8)
    )
    deadline = time.monotonic() + _READY_TIMEOUT
    async with cluster.channel(on, client=client) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        while True:
            try:
                response = await stub.CreateRootSession(
                    request, metadata=cluster.metadata(client), timeout=_READY_TIMEOUT
                )
            except grpc.aio.AioRpcError as failure:
                if failure.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
                continue
            return SessionId(response.session_id)
