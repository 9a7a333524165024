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

The bed is made of three pieces, each the owner of its own state: the network
(:class:`~dsh_mesh.testing._bed_network.BedNetwork`: bridge, namespaces, cuts), the etcd
members (``_bed_etcd``) and the hosts with their node processes (``_bed_host``);
:class:`MultiHostBed` composes them, runs the database and the clusters, and tears all down.

Every name is unique per run (a random run id), so beds of two runs on one machine never
collide. Teardown kills every process in the bed's namespaces, deletes the namespaces (and with
them the veth pairs) and the bridge, and removes the bed's directory; it runs on ``close()``, on
leaving the ``with`` block (also when a test fails) and from an ``atexit`` hook, and a bed left
behind by a run that was killed outright is swept by the next bed (see :func:`sweep_stale_beds`).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import TracebackType
from typing import Self

from dsh_mesh.registry import EtcdConfig
from dsh_mesh.testing._bed_etcd import EtcdMember, agreed_leader, etcd_members
from dsh_mesh.testing._bed_host import (
    ETCD_CLIENT_NAME,
    ETCD_CLIENT_PORT,
    BedError,
    BedHost,
    BedNode,
    BedUnavailable,
)
from dsh_mesh.testing._bed_network import (
    DATABASE_HOST,
    BedNetwork,
    bed_unavailable_reason,
    sweep_stale_beds,
)
from dsh_mesh.testing._cluster import ClusterSettings, LocalCluster, NodeProcess, NodeProcessError
from dsh_mesh.testing._etcd import find_etcd_binary
from dsh_mesh.testing._pki import LocalPki
from dsh_mesh.testing._postgres import PostgresServer

KEEP_ENV = "DSH_TESTBED_KEEP"
"""Set (non-empty) to keep a bed's directory (logs, configuration, certificates) after
teardown, for reading the logs of a failed run."""
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
        self.pki: LocalPki | None = None
        """The bed's CA under TLS (in the bed's directory), else None."""
        self.run_id = secrets.token_hex(3)
        self.heartbeat_ms = heartbeat_ms
        """etcd's raft heartbeat interval (ms)."""
        self.election_ms = election_ms
        """etcd's election timeout (ms): how long followers wait for a lost leader."""
        self._network = BedNetwork(run_id=self.run_id, host_names=hosts, database=database)
        self.directory = Path()
        self.etcd: dict[str, EtcdMember] = {}
        """The etcd members by host name, once started."""
        self._clusters: list[BedCluster] = []
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
            self._network.build(self.directory)
            if self.db_host is not None:
                self._start_database(self.db_host)
            if self.tls:
                self.pki = LocalPki(self.directory / "pki")
            self.etcd = etcd_members(
                self.hosts.values(),
                binary=binary,
                run_id=self.run_id,
                heartbeat_ms=self.heartbeat_ms,
                election_ms=self.election_ms,
                pki=self.pki,
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
        self._network.teardown()
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

    # -- the network ----------------------------------------------------------------------------

    @property
    def bridge(self) -> str:
        """The bridge's name (in the root namespace)."""
        return self._network.bridge

    @property
    def bridge_address(self) -> str:
        """The test process's address on the bridge, once started."""
        return self._network.bridge_address

    @property
    def network(self) -> ipaddress.IPv4Network | None:
        """The bed's /24 of 10.231.0.0/16, once started."""
        return self._network.network

    @property
    def hosts(self) -> dict[str, BedHost]:
        """The node hosts by name (each runs an etcd member and a node), once started."""
        return self._network.hosts

    @property
    def db_host(self) -> BedHost | None:
        """The database host (no etcd member, no node), once the network is built."""
        return self._network.db_host

    # -- etcd and nodes -------------------------------------------------------------------------

    def etcd_target(self, *, first: str | None = None) -> str:
        """An etcd endpoint for the test process, which runs in the root namespace where
        :data:`ETCD_CLIENT_NAME` does not resolve: a gRPC target naming every member
        (``ipv4:A:2379,B:2379,C:2379``), so a client whose member goes away dials the next. The
        member of host ``first`` comes first."""
        names = sorted(self.hosts, key=lambda name: (name != first, name))
        return "ipv4:" + ",".join(f"{self.hosts[n].address}:{ETCD_CLIENT_PORT}" for n in names)

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
        return agreed_leader(self.etcd, timeout)

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
        self._network.note_directory(self.database.socket_dir)

    # -- network faults -------------------------------------------------------------------------

    def cut(self, host: str, *, how: str | None = None, keep: Sequence[str] = ()) -> None:
        """Cut ``host`` off from every other host (and from the test process), except the
        hosts in ``keep``: :meth:`BedNetwork.cut` (``how`` is ``"drop"``, iptables, or
        ``"link"``). Idempotent per host. ``host`` may be the database host."""
        self._network.cut(host, how=how, keep=keep)

    def isolate_from_etcd(self, host: str) -> None:
        """Cut node host ``host`` off from every host but the database host: its lease lapses
        while it still reaches PostgreSQL (ADR 0026); :meth:`BedNetwork.isolate_from_etcd`.
        :meth:`restore` undoes it."""
        self._network.isolate_from_etcd(host)

    def restore(self, host: str) -> None:
        """Undo :meth:`cut` or :meth:`isolate_from_etcd`. Idempotent."""
        self._network.restore(host)

    def is_cut(self, host: str) -> bool:
        """True while ``host`` is cut off (also when isolated from etcd)."""
        return self._network.is_cut(host)

    def restore_all(self) -> None:
        """Undo every cut."""
        self._network.restore_all()

    def exec(self, host: str, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a short command inside ``host``'s namespace (a node host or the database host);
        its output is returned, a non-zero exit raises :class:`BedError`."""
        return self._network.exec(host, *argv)

    def pids(self, host: str) -> list[int]:
        """Every process running in ``host``'s namespace."""
        return self._network.pids(host)


_LIVE: set[MultiHostBed] = set()


@atexit.register
def _close_all() -> None:
    for bed in list(_LIVE):
        with contextlib.suppress(Exception):
            bed.close()
