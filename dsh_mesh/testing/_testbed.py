"""A multi-host test bed on one machine: network namespaces joined by a bridge.

:class:`MultiHostBed` (root only) creates one Linux bridge in the root namespace, with an address
for the test process, and one network namespace per host, each joined to the bridge by a veth
pair and given its own address in a fresh /24 of 10.231.0.0/16 that exists only on interfaces the
bed made. There is no route out of a host: a host's only route is its own /24. Every host runs
one member of a three-member etcd cluster and, per :meth:`MultiHostBed.cluster`, one node process
started by ``ip netns exec`` from a TOML file in the deployment format (``nodes/README.md``).
With ``database=True`` (the default) one more host, ``pg``, runs neither: it runs the PostgreSQL
server (:attr:`MultiHostBed.database`) that every cluster of the bed keeps its log store in, one
fresh database per cluster, reached by the nodes and the test process over the bridge.
With ``tls=True`` every etcd member and every node has its own certificate from a CA made for the
bed (the project's own :class:`~dsh_mesh.transport.CertificateAuthority`, as ``dsh-mesh certs``
uses), and every connection is mutual TLS; without it nodes run with the explicit ``plaintext``
switch and the cluster token in the environment.

Faults: :meth:`MultiHostBed.cut` takes a host off the network (``iptables`` DROP of everything
but loopback inside its namespace, or its link down), :meth:`MultiHostBed.isolate_from_etcd`
takes it off everything but the database host (its node loses etcd and its peers but still
reaches PostgreSQL: the zombie of ADR 0026), :meth:`MultiHostBed.restore` brings it back;
:meth:`MultiHostBed.stop_etcd`, :meth:`MultiHostBed.kill_etcd` and
:meth:`MultiHostBed.start_etcd` stop, crash and restart one etcd member, and
:meth:`MultiHostBed.etcd_leader` finds the current leader; :meth:`MultiHostBed.kill_database`
and :meth:`MultiHostBed.restart_database` crash PostgreSQL and start it again on the same data;
:meth:`MultiHostBed.set_read_only` makes a cluster's database read-only and writable again.
Node processes are :class:`~dsh_mesh.testing.NodeProcess` objects (``kill``, ``pause``,
``terminate``). Delay and loss come from :class:`~dsh_mesh.testing.TcpProxy` placed in front of
a node (see ``fronted``).

Every name is unique per run (a random run id), so beds of two runs on one machine never
collide. Teardown kills every process in the bed's namespaces, deletes the namespaces (and with
them the veth pairs) and the bridge, and removes the bed's directory; it runs on ``close()``, on
leaving the ``with`` block (also when a test fails) and from an ``atexit`` hook, and a bed left
behind by a run that was killed outright is swept by the next bed (see :func:`sweep_stale_beds`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import TracebackType
from typing import Self

import grpc
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

from dsh_mesh.registry import ROOT_USER, EtcdConfig
from dsh_mesh.testing._cluster import ClusterSettings, LocalCluster, NodeProcess, NodeProcessError
from dsh_mesh.testing._etcd import EtcdAddress, find_etcd_binary
from dsh_mesh.testing._pki import LocalPki, TlsFiles
from dsh_mesh.testing._postgres import PostgresServer

_STATE_DIR = Path("/run/dsh-testbed")
_NETNS_ETC = Path("/etc/netns")
KEEP_ENV = "DSH_TESTBED_KEEP"
"""Set (non-empty) to keep a bed's directory (logs, configuration, certificates) after
teardown, for reading the logs of a failed run."""
ETCD_CLIENT_NAME = "etcd-client"
"""The name every host resolves to all etcd members (its own first), from the
``/etc/netns/<namespace>/hosts`` that ``ip netns exec`` puts in place of ``/etc/hosts``: a node's
``etcd`` setting names it, so the node's etcd client fails over to another member when one goes
away, as a DNS name with several addresses does in a deployment."""
DATABASE_HOST = "pg"
"""The name of the bed's database host (``database=True``): it runs PostgreSQL, no etcd member
and no node. Every node host's ``/etc/hosts`` names it too."""
DATABASE_PORT = 5432
"""PostgreSQL's port on the database host (the host is the bed's own: nothing else binds it)."""
_DATABASE_SETTINGS = {
    # Three nodes' pools (8 each), the test process's readers, and the connections of nodes
    # killed or cut off that the server has not yet noticed are gone.
    "max_connections": "300",
    # A client whose host was cut off sends no reset: keepalives end its backend in ~11 s.
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
}
_SUBNETS = ipaddress.IPv4Network("10.231.0.0/16")
_ETCD_CLIENT_PORT = 2379
_ETCD_PEER_PORT = 2380
_POLL = 0.02
_STOP_GRACE = 3.0
_CMD_TIMEOUT = 20.0
_KEPT_ETCD_ENV = {"ETCD_UNSUPPORTED_ARCH"}


class BedUnavailable(RuntimeError):
    """This machine cannot host a bed (not root, no ``ip netns``, no etcd); the message says why
    in one sentence, fit for a skip reason."""


class BedError(RuntimeError):
    """A bed operation failed (a command exited non-zero, a member did not become healthy); the
    message carries the command's output or the log tail."""


def bed_unavailable_reason() -> str | None:
    """``None`` if a bed can be made here, else why not. Probes by adding (and deleting) one
    throw-away namespace; starts nothing else."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed (apt-get install -y iproute2)"
    try:
        find_etcd_binary()
    except FileNotFoundError as error:
        return str(error)
    probe = f"dshprobe{secrets.token_hex(3)}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        detail = added.stderr.strip() or f"exit status {added.returncode}"
        return f"creating a network namespace failed (`ip netns add`: {detail})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def iptables_available() -> bool:
    """True if ``iptables`` is installed (``scripts/install_testbed_tools.sh`` installs it);
    without it :meth:`MultiHostBed.cut` takes the host's link down instead."""
    return shutil.which("iptables") is not None


@dataclass(frozen=True, kw_only=True)
class BedHost:
    """One host of a bed: a network namespace with one address on the bed's bridge."""

    name: str
    """Short name: ``a``, ``b``, ... (its node is ``node-<name>``)."""
    namespace: str
    """The network namespace (``ip netns exec <namespace> ...``)."""
    address: str
    """The host's one address; nothing outside the bed has it."""
    veth: str
    """The bridge-side end of the host's veth pair (in the root namespace)."""
    directory: Path
    """The host's own directory: etcd data, configuration, logs."""

    @property
    def node_id(self) -> str:
        """The id of the node this host runs."""
        return f"node-{self.name}"


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=_CMD_TIMEOUT
    )
    if check and result.returncode != 0:
        raise BedError(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


class EtcdMember:
    """One member of the bed's etcd cluster, running inside its host's namespace.

    ``start()`` launches it (not waiting: a new cluster needs its peers before it is healthy),
    ``wait_healthy()`` blocks until ``/health`` answers, ``stop()`` is an orderly shutdown
    (SIGTERM, SIGKILL after 3 s), ``kill()`` a crash (SIGKILL); both keep the data directory, so
    ``start()`` brings the same member back. Calls are serialized by a lock.
    """

    def __init__(
        self,
        host: BedHost,
        *,
        binary: str,
        initial_cluster: str,
        cluster_token: str,
        heartbeat_ms: int,
        election_ms: int,
        tls: TlsFiles | None = None,
        probe: TlsFiles | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        """The member's certificate (server to clients and peers, client to peers), or None."""
        self._probe = probe
        self._binary = binary
        self._initial_cluster = initial_cluster
        self._cluster_token = cluster_token
        self._heartbeat_ms = heartbeat_ms
        self._election_ms = election_ms
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        self.data_dir = host.directory / "etcd-data"
        self.log_path = host.directory / "etcd.log"

    @property
    def name(self) -> str:
        """The member name (the host's name)."""
        return self.host.name

    @property
    def address(self) -> EtcdAddress:
        """The member's client address (with a probe client certificate under TLS)."""
        return EtcdAddress(host=self.host.address, port=_ETCD_CLIENT_PORT, tls=self._probe)

    @property
    def scheme(self) -> str:
        """``https`` under TLS, else ``http``."""
        return "http" if self.tls is None else "https"

    @property
    def client_url(self) -> str:
        """The member's client URL."""
        return f"{self.scheme}://{self.host.address}:{_ETCD_CLIENT_PORT}"

    @property
    def peer_url(self) -> str:
        """The member's raft peer URL."""
        return f"{self.scheme}://{self.host.address}:{_ETCD_PEER_PORT}"

    @property
    def running(self) -> bool:
        """True while the member's process has not exited."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The member's pid while it runs."""
        return self._process.pid if self._process is not None and self.running else None

    def command(self) -> list[str]:
        """The etcd command line (run inside the host's namespace): the flags of
        ``deploy/systemd/dsh-etcd@.service`` that matter here, with test timings."""
        client = self.client_url
        tls: list[str] = []
        if self.tls is not None:
            cert, key, ca = str(self.tls.cert), str(self.tls.key), str(self.tls.ca)
            tls = [
                "--client-cert-auth",
                "--trusted-ca-file", ca,
                "--cert-file", cert,
                "--key-file", key,
                "--peer-client-cert-auth",
                "--peer-trusted-ca-file", ca,
                "--peer-cert-file", cert,
                "--peer-key-file", key,
            ]  # fmt: skip
        return [
            self._binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self._initial_cluster,
            "--initial-cluster-token",
            self._cluster_token,
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval",
            str(self._heartbeat_ms),
            "--election-timeout",
            str(self._election_ms),
            # A member cut off keeps campaigning and raising its term; without pre-vote it
            # deposes the healthy leader the moment it is back (etcd 3.4 defaults to off).
            "--pre-vote",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            *tls,
        ]

    def start(self) -> None:
        """Launch the member (again); returns at once. A no-op while it runs."""
        with self._lock:
            if self.running:
                return
            env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
            env.update({k: v for k, v in os.environ.items() if k in _KEPT_ETCD_ENV})
            argv = ["ip", "netns", "exec", self.host.namespace, *self.command()]
            with self.log_path.open("ab") as log:
                log.write(f"--- dsh-mesh bed: launching {' '.join(argv)}\n".encode())
                log.flush()
                self._process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.host.directory,
                )

    def wait_healthy(self, timeout: float = 20.0) -> None:
        """Block until the member answers ``/health`` (it has a leader and serves); raise
        :class:`BedError` with its log tail if it exits or is not healthy in time."""
        deadline = time.monotonic() + timeout
        while not self.address.is_healthy():
            if not self.running:
                raise BedError(f"etcd member {self.name} exited" + self.log_tail())
            if time.monotonic() > deadline:
                raise BedError(
                    f"etcd member {self.name} not healthy in {timeout}s" + self.log_tail()
                )
            time.sleep(_POLL)

    def stop(self) -> None:
        """Orderly shutdown: SIGTERM, SIGKILL after 3 s; reaped. Idempotent."""
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
                try:
                    process.wait(_STOP_GRACE)
                except subprocess.TimeoutExpired:
                    process.kill()
            process.wait()

    def kill(self) -> None:
        """Crash: SIGKILL and reap. Idempotent."""
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            process.wait()

    def status(self, timeout: float = 0.5) -> dict[str, str] | None:
        """The member's ``Maintenance.Status`` (``member_id``, ``leader``, ``raft_term``, as
        strings), or ``None`` if it does not answer. Over gRPC, with the probe's certificate:
        under auth etcd names the caller by it (its JSON gateway would want a password)."""
        target = f"{self.host.address}:{_ETCD_CLIENT_PORT}"
        if self._probe is None:
            channel = grpc.insecure_channel(target)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=self._probe.ca.read_bytes(),
                private_key=self._probe.key.read_bytes(),
                certificate_chain=self._probe.cert.read_bytes(),
            )
            channel = grpc.secure_channel(target, credentials)
        try:
            with channel:
                status = rpc_pb2_grpc.MaintenanceStub(channel).Status(
                    rpc_pb2.StatusRequest(), timeout=timeout
                )
        except grpc.RpcError:
            return None
        return {
            "member_id": str(status.header.member_id),
            "leader": str(status.leader),
            "raft_term": str(status.header.raft_term),
        }

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the member's log, as a message suffix."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log_path}:\n" + "\n".join(text)


class BedNode(NodeProcess):
    """A node process on one host of a bed: ``ip netns exec <host> python -m dsh_mesh.node
    --config <host>/node-<name>.toml``, with the cluster token in ``DSH_CLUSTER_TOKEN``. Start,
    readiness (the JSON ready line), signals and logs are :class:`NodeProcess`'s."""

    def __init__(
        self,
        host: BedHost,
        cluster: BedCluster,
        *,
        listen: str,
        advertise_host: str | None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(host.node_id, cluster.settings, log_dir=cluster.log_dir, env=env)
        self.host = host
        self.config_path = cluster.log_dir / f"{host.node_id}.toml"
        settings = cluster.settings
        lines = [
            f"# dsh-mesh test bed: the node of host {host.name} (namespace {host.namespace}),",
            "# in the deployment's format (nodes/README.md). Plaintext beds pass the cluster",
            "# token in DSH_CLUSTER_TOKEN, as a deployment does; TLS beds need none.",
            "[node]",
            f"node_id = {_toml(host.node_id)}",
            f"listen = {_toml(listen)}",
            f"etcd = {_toml(f'{ETCD_CLIENT_NAME}:{_ETCD_CLIENT_PORT}')}",
            f"key_prefix = {_toml(settings.key_prefix)}",
            f"log_store = {_toml(settings.log_store)}",
            f"lease_ttl = {settings.lease_ttl}",
            f"placement = {_toml(settings.placement)}",
            f"scenario = {_toml(settings.scenario)}",
            f"shutdown_grace = {settings.shutdown_grace}",
        ]
        if settings.history:
            lines.append(f"history_file = {_toml(str(self.history_path))}")
        if advertise_host is not None:
            lines.append(f"advertise_host = {_toml(advertise_host)}")
        pki = cluster.bed.pki
        if pki is None:
            lines.append("plaintext = true  # a bed made with tls=False")
        else:
            files = pki.node(host.node_id, hosts=[host.address, host.node_id])
            lines += [
                f"tls_cert = {_toml(str(files.cert))}",
                f"tls_key = {_toml(str(files.key))}",
                f"tls_ca = {_toml(str(files.ca))}",
            ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def command(self) -> list[str]:
        """The node's command line, run inside its host's namespace."""
        return [
            "ip",
            "netns",
            "exec",
            self.host.namespace,
            sys.executable,
            "-m",
            "dsh_mesh.node",
            "--config",
            str(self.config_path),
        ]


@dataclass(frozen=True, kw_only=True)
class BedSettings(ClusterSettings):
    """A bed cluster's settings. ``etcd_endpoint`` is the test process's view of etcd (every
    member, see :meth:`MultiHostBed.etcd_target`); under TLS its etcd client checks that the
    member's certificate names :data:`ETCD_CLIENT_NAME`, the name the nodes dial."""

    def etcd_config(self, *, reader: str = "mesh-reader") -> EtcdConfig:
        """How the test process reaches the bed's etcd (with a certificate under TLS)."""
        return _named(super().etcd_config(reader=reader))

    def etcd_root_config(self) -> EtcdConfig:
        """How etcd's root user reaches the bed's etcd (under TLS)."""
        return _named(super().etcd_root_config())


def _named(config: EtcdConfig) -> EtcdConfig:
    """``config`` checking that the member's certificate names :data:`ETCD_CLIENT_NAME`."""
    if config.tls is None:
        return config
    return replace(config, tls=replace(config.tls, server_name=ETCD_CLIENT_NAME))


class BedCluster(LocalCluster):
    """One node per bed host (``node-a`` on host ``a``, ...), all under a fresh key prefix of
    the bed's etcd cluster, with the log store ``log_store`` (default: a SQLite file in the
    cluster's directory, which every host sees). A :class:`LocalCluster` in every other respect
    (``with``, ``[...]``, ``metadata``, ``settings`` for a :class:`MeshReader`); ``close()``
    stops every node."""

    def __init__(
        self,
        bed: MultiHostBed,
        *,
        scenario: str,
        placement: str,
        lease_ttl: float,
        shutdown_grace: float,
        fronted: Mapping[str, tuple[str, int]],
        env: Mapping[str, str] | None,
        history: bool = False,
        log_store: str | None = None,
        database: str | None = None,
    ) -> None:
        log_dir = Path(tempfile.mkdtemp(prefix="cluster-", dir=bed.directory))
        self.database = database
        """The name of the cluster's database on the bed's database host (its log store), or
        None when its nodes share a SQLite file."""
        super().__init__(
            etcd_endpoint=bed.etcd_target(),
            scenario=scenario,
            nodes=(),
            placement=placement,
            lease_ttl=lease_ttl,
            shutdown_grace=shutdown_grace,
            log_dir=log_dir,
            env=env,
            tls=bed.pki,
            history=history,
            log_store=log_store,
            # Under TLS only the nodes reach etcd, each within its prefix (ADR 0032), as in a
            # deployment: the fault runs and soaks exercise it.
            least_privilege=bed.pki is not None,
        )
        plain = self.settings
        self.settings = BedSettings(**{f.name: getattr(plain, f.name) for f in fields(plain)})
        self.bed = bed
        unknown = set(fronted) - {h.node_id for h in bed.hosts.values()}
        if unknown:
            raise ValueError(f"no such nodes in the bed: {sorted(unknown)}")
        for host in bed.hosts.values():
            advertised, port = fronted.get(host.node_id, (None, 0))
            self.nodes[host.node_id] = BedNode(
                host,
                self,
                listen=f"{host.address}:{port}",
                advertise_host=advertised,
                env=env,
            )

    def host_of(self, node_id: str) -> BedHost:
        """The host a node runs on."""
        node = self.nodes[node_id]
        assert isinstance(node, BedNode)
        return node.host

    def add(self, node_id: str) -> NodeProcess:
        """Not supported: a bed cluster has exactly one node per host."""
        raise NodeProcessError(f"a bed cluster runs one node per host; cannot add {node_id}")


class MultiHostBed:
    """Hosts in network namespaces on one bridge, with a three-member etcd cluster across them.

    ``with MultiHostBed() as bed:`` builds the network and starts etcd (healthy on return);
    ``bed.cluster(scenario)`` prepares one node per host (start it with ``with``). Raises
    :class:`BedUnavailable` where the machine cannot host a bed (see
    :func:`bed_unavailable_reason`). ``close()`` is idempotent and also runs at interpreter exit.

    ``tls`` runs mutual TLS everywhere, with certificates of a CA made for the bed
    (:attr:`pki`): every etcd member has its own (SANs: its address and
    :data:`ETCD_CLIENT_NAME`) for clients and peers, and requires client certificates from both;
    every node has its own (CN and DNS SAN: its node id; its host's address), which it serves
    with, dials other nodes with and dials etcd with. Without ``tls`` every node is started
    with the explicit ``plaintext`` switch.

    ``database`` (default) adds the host :data:`DATABASE_HOST` (:attr:`db_host`), which is no
    etcd member and runs no node: it runs a PostgreSQL server (:attr:`database`) listening on
    its address at :data:`DATABASE_PORT`, trusting every client of the bed's subnet (the hosts
    and the test process; the connections are plaintext, as the database is the bed's own). Each
    :meth:`cluster` gets a fresh database on it as its log store. Without ``database`` a
    cluster's nodes share a SQLite file, as on one machine (they do share its file system).
    """

    def __init__(
        self,
        *,
        hosts: Sequence[str] = ("a", "b", "c"),
        tls: bool = False,
        heartbeat_ms: int = 10,
        election_ms: int = 100,
        database: bool = True,
    ) -> None:
        if len(hosts) < 1 or len(set(hosts)) != len(hosts):
            raise ValueError("hosts must be distinct, at least one")
        for name in hosts:
            if not (name.isascii() and name.isalnum() and len(name) <= 2):
                raise ValueError(f"host name {name!r}: one or two letters or digits")
        if database and DATABASE_HOST in hosts:
            raise ValueError(f"host name {DATABASE_HOST!r} is the database host's")
        self.tls = tls
        self.with_database = database
        """Whether the bed runs a database host (``database=True``)."""
        self.database: PostgresServer | None = None
        """The PostgreSQL server on :attr:`db_host` once started (``database=True``), else
        None."""
        self.db_host: BedHost | None = None
        """The database host (no etcd member, no node), once the network is built."""
        self.pki: LocalPki | None = None
        """The bed's CA under TLS (in the bed's directory), else None."""
        self.run_id = secrets.token_hex(3)
        self._host_names = tuple(hosts)
        self.heartbeat_ms = heartbeat_ms
        """etcd's raft heartbeat interval (ms)."""
        self.election_ms = election_ms
        """etcd's election timeout (ms): how long followers wait for a lost leader."""
        self.bridge = f"dshbr{self.run_id}"
        self.bridge_address = ""
        self.network: ipaddress.IPv4Network | None = None
        self.directory = Path()
        self.hosts: dict[str, BedHost] = {}
        self.etcd: dict[str, EtcdMember] = {}
        self._clusters: list[BedCluster] = []
        self._cut: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {}
        self._made: list[str] = []  # namespaces created so far
        self._state_file: Path | None = None
        self._state: dict[str, object] = {}
        self._started = False
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Self:
        """Build the network, start the database (``database=True``) and the etcd cluster, and
        return once the database accepts connections and every member is healthy. On failure
        everything made so far is torn down before the error propagates."""
        if self._started:
            raise BedError("the bed is already started")
        reason = bed_unavailable_reason()
        if reason is not None:
            raise BedUnavailable(reason)
        self._started = True
        binary = find_etcd_binary()
        sweep_stale_beds()
        self.directory = Path(tempfile.mkdtemp(prefix=f"dsh-bed-{self.run_id}-"))
        _LIVE.add(self)
        try:
            self._build_network()
            if self.db_host is not None:
                self._start_database(self.db_host)
            if self.tls:
                self.pki = LocalPki(self.directory / "pki")
            scheme = "https" if self.tls else "http"
            initial = ",".join(
                f"{h.name}={scheme}://{h.address}:{_ETCD_PEER_PORT}" for h in self.hosts.values()
            )
            for host in self.hosts.values():
                member_tls = probe = None
                if self.pki is not None:
                    member_tls = self.pki.etcd(
                        f"etcd-{host.name}", hosts=[host.address, ETCD_CLIENT_NAME]
                    )
                    # The bed's own look at its members (health, status, leader) is the
                    # operator's: etcd's root user, whom auth (on under least privilege, ADR
                    # 0032) lets ask a member's status.
                    probe = self.pki.node(ROOT_USER)
                self.etcd[host.name] = EtcdMember(
                    host,
                    binary=binary,
                    initial_cluster=initial,
                    cluster_token=f"dsh-bed-{self.run_id}",
                    heartbeat_ms=self.heartbeat_ms,
                    election_ms=self.election_ms,
                    tls=member_tls,
                    probe=probe,
                )
            for member in self.etcd.values():
                member.start()
            for member in self.etcd.values():
                member.wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Tear everything down: nodes, the database (its data directory with it; its log is
        copied to the bed's directory when that is kept), etcd members, every other process in
        the bed's namespaces, the namespaces, the bridge, the directory. Idempotent; never
        raises for something already gone."""
        if self._closed:
            return
        self._closed = True
        for cluster in self._clusters:
            with contextlib.suppress(Exception):
                cluster.close()
        if self.database is not None:
            if os.environ.get(KEEP_ENV) and self.db_host is not None:
                with contextlib.suppress(Exception):
                    shutil.copy(self.database.log_path, self.db_host.directory / "postgres.log")
            with contextlib.suppress(Exception):
                self.database.stop()
        for member in self.etcd.values():
            with contextlib.suppress(Exception):
                member.kill()
        _teardown(self._made, self.bridge)
        if self._state_file is not None:
            self._state_file.unlink(missing_ok=True)
        if self.directory != Path():
            if os.environ.get(KEEP_ENV):
                print(f"dsh-mesh bed {self.run_id}: logs kept in {self.directory}", file=sys.stderr)
            else:
                shutil.rmtree(self.directory, ignore_errors=True)
        _LIVE.discard(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        database = "" if self.db_host is None else f", database on {self.db_host.address}"
        return (
            f"MultiHostBed(run={self.run_id}, network={self.network}, hosts={list(self.hosts)}"
            f"{database})"
        )

    # -- etcd and nodes -------------------------------------------------------------------------

    def etcd_target(self, *, first: str | None = None) -> str:
        """An etcd endpoint for the test process, which runs in the root namespace where
        :data:`ETCD_CLIENT_NAME` does not resolve: a gRPC target naming every member
        (``ipv4:A:2379,B:2379,C:2379``), so a client whose member goes away dials the next. The
        member of host ``first`` comes first."""
        names = sorted(self.hosts, key=lambda name: (name != first, name))
        return "ipv4:" + ",".join(f"{self.hosts[n].address}:{_ETCD_CLIENT_PORT}" for n in names)

    def cluster(
        self,
        scenario: str,
        *,
        placement: str = "others-first",
        lease_ttl: float = 2.0,
        shutdown_grace: float = 1.0,
        fronted: Mapping[str, tuple[str, int]] | None = None,
        env: Mapping[str, str] | None = None,
        history: bool = False,
    ) -> BedCluster:
        """One node per host, under a fresh key prefix, not started yet (``with`` starts it).

        ``fronted`` maps a node id to ``(advertised host, port)``: that node listens on its
        host's address at ``port`` and publishes the advertised host instead, so peers dial
        whatever listens there (a :class:`TcpProxy` forwarding to the node). Other nodes listen
        on their host's address at a free port. With ``history`` every node keeps a store history
        (:attr:`NodeProcess.history_path`) for the history checker. With a database host the
        cluster's log store is a fresh database on it (``settings.log_store`` is its DSN, which
        the test process's readers use too). The bed stops every cluster on close.
        """
        log_store = database = None
        if self.database is not None:
            database = f"mesh_{secrets.token_hex(6)}"
            log_store = self.database.create_database(database)
        cluster = BedCluster(
            self,
            scenario=scenario,
            placement=placement,
            lease_ttl=lease_ttl,
            shutdown_grace=shutdown_grace,
            fronted=fronted or {},
            env=env,
            history=history,
            log_store=log_store,
            database=database,
        )
        self._clusters.append(cluster)
        return cluster

    def etcd_leader(self, timeout: float = 10.0) -> str:
        """The name of the host whose etcd member leads now (the members that answer agree on
        the leader); raises :class:`BedError` if there is no agreed leader within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = {
                name: status
                for name, member in self.etcd.items()
                if member.running and (status := member.status()) is not None
            }
            leaders = {s["leader"] for s in statuses.values()}
            if len(leaders) == 1 and statuses:
                (leader,) = leaders
                for name, status in statuses.items():
                    if status["member_id"] == leader:
                        return name
            if time.monotonic() > deadline:
                raise BedError(f"no agreed etcd leader within {timeout}s: {statuses}")
            time.sleep(_POLL)

    def stop_etcd(self, host: str) -> None:
        """Stop host's etcd member in order (SIGTERM); its data stays for :meth:`start_etcd`."""
        self.etcd[host].stop()

    def kill_etcd(self, host: str) -> None:
        """Crash host's etcd member (SIGKILL); its data stays for :meth:`start_etcd`."""
        self.etcd[host].kill()

    def start_etcd(self, host: str, timeout: float = 20.0) -> None:
        """Start host's stopped member again and wait until it is healthy (it rejoins)."""
        member = self.etcd[host]
        member.start()
        member.wait_healthy(timeout)

    # -- the database ---------------------------------------------------------------------------

    def kill_database(self) -> None:
        """Crash PostgreSQL (SIGKILL to the postmaster and every backend); its data stays for
        :meth:`restart_database`. Every client's connection breaks and new ones are refused:
        the nodes' log stores answer ``REGISTRY_UNAVAILABLE``. Idempotent."""
        self._require_database().kill()

    def restart_database(self) -> None:
        """Start PostgreSQL again on the same data and port (every DSN stays valid) and wait
        until it accepts connections; it recovers every committed transaction. A running
        database is crashed first."""
        self._require_database().restart()

    async def set_read_only(self, database: str, on: bool) -> None:
        """Make ``database`` (a cluster's, :attr:`BedCluster.database`) read-only, as a standby
        is before its promotion, or writable again (``on=False``), and end every connection to
        it: the setting holds for new sessions only, so the nodes' pools reconnect into it.
        Meanwhile every write is refused (SQLSTATE 25006) and the nodes answer
        ``REGISTRY_UNAVAILABLE``; reads go on. Said as the superuser over a connection to the
        ``postgres`` database (so the statement itself is not read-only) from this process:
        not through ``psql``, since a fork while gRPC's threads run may crash the child."""
        import asyncpg

        server = self._require_database()
        setting = (
            "SET default_transaction_read_only = on"
            if on
            else "RESET default_transaction_read_only"
        )
        connection = await asyncpg.connect(server.dsn_for("postgres"), timeout=10)
        try:
            await connection.execute(f'ALTER DATABASE "{database}" {setting}', timeout=10)
            await connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                database,
                timeout=10,
            )
        finally:
            await connection.close(timeout=10)

    @property
    def database_running(self) -> bool:
        """True while the bed's PostgreSQL runs (False without a database host)."""
        return self.database is not None and self.database.running

    def _require_database(self) -> PostgresServer:
        if self.database is None:
            raise BedError("this bed has no database host (made with database=False)")
        return self.database

    def _start_database(self, host: BedHost) -> None:
        assert self.network is not None
        self.database = PostgresServer(
            listen=host.address,
            port=DATABASE_PORT,
            wrap=["ip", "netns", "exec", host.namespace],
            trusted=[str(self.network)],
            settings=_DATABASE_SETTINGS,
        )
        self.database.start()
        # A bed swept after its owner was killed outright takes the data directory with it.
        self._state["directories"] = [str(self.database.socket_dir)]
        self._write_state()

    # -- network faults -------------------------------------------------------------------------

    def cut(self, host: str, *, how: str | None = None, keep: Sequence[str] = ()) -> None:
        """Cut ``host`` off from every other host (and from the test process): ``"drop"``
        inserts iptables rules in its namespace that drop every packet in and out except on
        loopback; ``"link"`` takes the bridge side of its veth down. Default: ``"drop"`` when
        iptables is installed, else ``"link"``. ``keep`` names hosts whose traffic with it still
        flows (``"drop"`` only): rules before the drops accept packets from and to their
        addresses. Processes on the host keep running and still reach each other. Idempotent
        per host (a host cut already stays cut as it was). ``host`` may be the database host."""
        if host in self._cut:
            return
        how = how or ("drop" if iptables_available() else "link")
        if keep and how != "drop":
            raise ValueError("keep needs how='drop' (iptables)")
        target = self._host(host)
        if how == "drop":
            rules = _drop_rules([self._host(name).address for name in keep])
            inserted: list[tuple[str, ...]] = []
            try:
                for position, rule in rules:
                    iptables = ["iptables", "-w", "-I", rule[0], position, *rule[1:]]
                    _run(["ip", "netns", "exec", target.namespace, *iptables])
                    inserted.append(rule)
            except BaseException:
                self._delete_rules(target, inserted)
                raise
            self._cut[host] = (how, tuple(inserted))
        elif how == "link":
            _run(["ip", "link", "set", target.veth, "down"])
            self._cut[host] = (how, ())
        else:
            raise ValueError(f"how must be 'drop' or 'link', not {how!r}")

    def isolate_from_etcd(self, host: str) -> None:
        """Cut node host ``host`` off from every host but the database host (and from the test
        process): its node loses its etcd members and its peers, so its lease lapses and
        another node takes its sessions over, while it still reaches PostgreSQL, where it
        may try to append until the successor's fence refuses it (ADR 0026). Needs iptables and
        a database host. :meth:`restore` undoes it."""
        if host not in self.hosts:
            raise ValueError(f"no node host {host!r} in the bed")
        if self.db_host is None:
            raise BedError("this bed has no database host (made with database=False)")
        if not iptables_available():
            raise BedError("isolating a host from etcd needs iptables")
        self.cut(host, how="drop", keep=(self.db_host.name,))

    def restore(self, host: str) -> None:
        """Undo :meth:`cut` or :meth:`isolate_from_etcd`. Idempotent."""
        how, rules = self._cut.pop(host, ("", ()))
        target = self._host(host)
        if how == "drop":
            self._delete_rules(target, rules)
        elif how == "link":
            _run(["ip", "link", "set", target.veth, "up"])

    def _delete_rules(self, host: BedHost, rules: Sequence[tuple[str, ...]]) -> None:
        # `iptables -D` takes the rule without a position; drops first, so nothing the kept
        # hosts send is dropped in between.
        for rule in reversed(rules):
            _run(["ip", "netns", "exec", host.namespace, "iptables", "-w", "-D", *rule])

    def is_cut(self, host: str) -> bool:
        """True while ``host`` is cut off (also when isolated from etcd)."""
        return host in self._cut

    def restore_all(self) -> None:
        """Undo every cut."""
        for host in list(self._cut):
            self.restore(host)

    def exec(self, host: str, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a short command inside ``host``'s namespace (a node host or the database host);
        its output is returned, a non-zero exit raises :class:`BedError`."""
        return _run(["ip", "netns", "exec", self._host(host).namespace, *argv])

    def pids(self, host: str) -> list[int]:
        """Every process running in ``host``'s namespace."""
        result = _run(["ip", "netns", "pids", self._host(host).namespace], check=False)
        return [int(p) for p in result.stdout.split()]

    def _host(self, name: str) -> BedHost:
        """A node host or the database host, by name."""
        if self.db_host is not None and name == self.db_host.name:
            return self.db_host
        return self.hosts[name]

    # -- internals ------------------------------------------------------------------------------

    def _build_network(self) -> None:
        _STATE_DIR.mkdir(parents=True, exist_ok=True)
        # The lock keeps two beds starting at once from choosing the same subnet.
        with (_STATE_DIR / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            network = _free_subnet()
            self.network = network
            addresses = list(network.hosts())
            self.bridge_address = str(addresses[0])
            self._state_file = _STATE_DIR / f"{self.run_id}.json"
            names = (*self._host_names, *([DATABASE_HOST] if self.with_database else []))
            self._state = {
                "pid": os.getpid(),
                "started": _start_time(os.getpid()),
                "bridge": self.bridge,
                "namespaces": [f"dshh{self.run_id}{name}" for name in names],
                "directory": str(self.directory),
            }
            self._write_state()
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            cidr = f"{self.bridge_address}/{network.prefixlen}"
            _run(["ip", "addr", "add", cidr, "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
        for index, name in enumerate(names):
            ns = f"dshh{self.run_id}{name}"
            veth = f"dshv{self.run_id}{name}"
            directory = self.directory / name
            directory.mkdir()
            host = BedHost(
                name=name,
                namespace=ns,
                address=str(addresses[index + 1]),
                veth=veth,
                directory=directory,
            )
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            (_NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            cidr = f"{host.address}/{network.prefixlen}"
            _run(["ip", "-n", ns, "addr", "add", cidr, "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if name in self._host_names:
                self.hosts[name] = host
            else:
                self.db_host = host
        database = [] if self.db_host is None else [f"{self.db_host.address} {DATABASE_HOST}"]
        for host in self.hosts.values():
            others = sorted(self.hosts.values(), key=lambda h: (h.name != host.name, h.name))
            lines = [
                "127.0.0.1 localhost",
                f"{host.address} {host.node_id}",
                *(f"{h.address} {ETCD_CLIENT_NAME}" for h in others),
                *database,
            ]
            (_NETNS_ETC / host.namespace / "hosts").write_text("\n".join(lines) + "\n")
        if self.db_host is not None:
            lines = ["127.0.0.1 localhost", *database]
            (_NETNS_ETC / self.db_host.namespace / "hosts").write_text("\n".join(lines) + "\n")

    def _write_state(self) -> None:
        """Record the bed in its state file, for :func:`sweep_stale_beds`."""
        if self._state_file is not None:
            self._state_file.write_text(json.dumps(self._state))


def _drop_rules(keep: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The iptables rules of a cut, as (position, rule) in the order to insert them: in each
    chain, accept the addresses in ``keep`` first, then drop every packet but loopback's."""
    rules: list[tuple[str, tuple[str, ...]]] = []
    for chain, interface, peer in (("INPUT", "-i", "-s"), ("OUTPUT", "-o", "-d")):
        for position, address in enumerate(keep, start=1):
            rules.append((str(position), (chain, peer, address, "-j", "ACCEPT")))
        rules.append((str(len(keep) + 1), (chain, "!", interface, "lo", "-j", "DROP")))
    return rules


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.231.0.0/16 that no interface or route of the root namespace overlaps."""
    used: list[ipaddress.IPv4Network] = []
    for line in _run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            if first not in ("default", "broadcast", "local", "unreachable"):
                used.append(ipaddress.IPv4Network(first, strict=False))
    candidates = list(_SUBNETS.subnets(new_prefix=24))
    secrets.SystemRandom().shuffle(candidates)
    for candidate in candidates:
        if not any(candidate.overlaps(other) for other in used):
            return candidate
    raise BedError("no free /24 left in 10.231.0.0/16")


def _teardown(namespaces: Sequence[str], bridge: str) -> None:
    """Kill every process in the namespaces, delete them (their veth pairs go with them) and the
    bridge. Tolerates any of it being gone already."""
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for ns in namespaces:
        # A process dying releases its namespace reference a moment after SIGKILL; deletion
        # of the name works regardless, the kernel frees the namespace with its last user.
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for ns in namespaces:
        shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        _NETNS_ETC.rmdir()  # only if empty: no other bed, nor anything else, uses it
    if bridge:
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def sweep_stale_beds() -> list[str]:
    """Tear down beds whose owning process is gone (a test run killed outright, so neither its
    ``with`` block nor its ``atexit`` hook ran). Returns the run ids swept. Needs root."""
    swept: list[str] = []
    if not _STATE_DIR.is_dir():
        return swept
    for state_file in _STATE_DIR.glob("*.json"):
        try:
            state = json.loads(state_file.read_text())
            pid = int(state["pid"])
        except (OSError, ValueError, KeyError):
            continue
        started = _start_time(pid)
        if started is not None and started == state.get("started", started):
            continue  # its owner still runs
        _teardown(list(state.get("namespaces", [])), str(state.get("bridge", "")))
        for directory in [state.get("directory"), *state.get("directories", [])]:
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
        state_file.unlink(missing_ok=True)
        swept.append(state_file.stem)
    return swept


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), which tells it
    apart from a later process with the same pid; None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    # After the command's closing parenthesis: state is field 3, starttime field 22.
    return None if fields[0] in ("Z", "X") else fields[19]


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


_LIVE: set[MultiHostBed] = set()


@atexit.register
def _close_all() -> None:
    for bed in list(_LIVE):
        with contextlib.suppress(Exception):
            bed.close()
