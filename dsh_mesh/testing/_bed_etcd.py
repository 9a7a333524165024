"""The etcd members of a multi-host test bed: one member per host, in the host's namespace.

Owns each member's process, data directory and log (:class:`EtcdMember`: start, stop, crash,
health and status), how the bed's members are made (:func:`etcd_members`: the initial cluster,
with a certificate per member under TLS) and which of them leads (:func:`agreed_leader`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping

import grpc
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

from dsh_mesh.registry import ROOT_USER
from dsh_mesh.testing._bed_host import ETCD_CLIENT_NAME, ETCD_CLIENT_PORT, BedError, BedHost
from dsh_mesh.testing._etcd import EtcdAddress
from dsh_mesh.testing._pki import LocalPki, TlsFiles

_ETCD_PEER_PORT = 2380
_POLL = 0.02
_STOP_GRACE = 3.0
_KEPT_ETCD_ENV = {"ETCD_UNSUPPORTED_ARCH"}


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
        return EtcdAddress(host=self.host.address, port=ETCD_CLIENT_PORT, tls=self._probe)

    @property
    def scheme(self) -> str:
        """``https`` under TLS, else ``http``."""
        return "http" if self.tls is None else "https"

    @property
    def client_url(self) -> str:
        """The member's client URL."""
        return f"{self.scheme}://{self.host.address}:{ETCD_CLIENT_PORT}"

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
        target = f"{self.host.address}:{ETCD_CLIENT_PORT}"
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


def etcd_members(
    hosts: Iterable[BedHost],
    *,
    binary: str,
    run_id: str,
    heartbeat_ms: int,
    election_ms: int,
    pki: LocalPki | None,
) -> dict[str, EtcdMember]:
    """One member per host, by host name, not started: together they form one new cluster
    (token ``dsh-bed-<run_id>``). Under ``pki`` every member has its own certificate (SANs: its
    address and :data:`ETCD_CLIENT_NAME`) and the bed probes it as etcd's root user."""
    hosts = list(hosts)
    scheme = "http" if pki is None else "https"
    initial = ",".join(f"{h.name}={scheme}://{h.address}:{_ETCD_PEER_PORT}" for h in hosts)
    members: dict[str, EtcdMember] = {}
    for host in hosts:
        member_tls = probe = None
        if pki is not None:
            member_tls = pki.etcd(f"etcd-{host.name}", hosts=[host.address, ETCD_CLIENT_NAME])
            # The bed's own look at its members (health, status, leader) is the
            # operator's: etcd's root user, whom auth (on under least privilege, ADR
            # 0032) lets ask a member's status.
            probe = pki.node(ROOT_USER)
        members[host.name] = EtcdMember(
            host,
            binary=binary,
            initial_cluster=initial,
            cluster_token=f"dsh-bed-{run_id}",
            heartbeat_ms=heartbeat_ms,
            election_ms=election_ms,
            tls=member_tls,
            probe=probe,
        )
    return members


def agreed_leader(members: Mapping[str, EtcdMember], timeout: float = 10.0) -> str:
    """The name of the member that leads now (the members that answer agree on the leader);
    raises :class:`BedError` if there is no agreed leader within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = {
            name: status
            for name, member in members.items()
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
