"""A real PostgreSQL server for tests, run as a child process on loopback.

Every server gets a fresh ``initdb`` cluster in a fresh temporary directory and a fresh loopback
port, so tests never share state with each other or with a PostgreSQL a developer runs on 5432.
Start-up waits for the server's own readiness notice instead of sleeping, shutdown always reaps
the child, and an ``atexit`` hook kills whatever a crashed test left running. A server can be
crashed (:meth:`PostgresServer.kill`) and started again on the same data and port
(:meth:`PostgresServer.restart`); the multi-host test bed runs one on a host of its own (another
address, a command prefix such as ``ip netns exec``, clients of the bed's subnet trusted).

PostgreSQL refuses to run as root; as root, ``initdb`` and ``postgres`` run as the unprivileged
``postgres`` user (created by the Debian package that ``scripts/install_postgres.sh``
installs), which then owns the temporary directory.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import pwd
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from dsh_mesh.testing._processes import free_ports, kill_and_reap, log_tail

_LOOPBACK = "127.0.0.1"
_SUPERUSER = "postgres"
_RUN_AS = "postgres"
_DEBIAN_BIN_DIRS = Path("/usr/lib/postgresql")
_WAIT_SLICE = 0.05
_STOP_GRACE = 5.0
_GONE_WAIT = 10.0
"""How long a kill waits for the killed server's children to be reaped by init."""
_PORT_ATTEMPTS = 5
_DATABASE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_SETTING_NAME = re.compile(r"[a-z_][a-z0-9_.]*")


class PostgresNotFoundError(FileNotFoundError):
    """No PostgreSQL server binaries (``initdb`` and ``postgres``) were found.

    ``scripts/install_postgres.sh`` (run by ``make``) installs them.
    """


class PostgresServerError(RuntimeError):
    """A :class:`PostgresServer` could not do what was asked: ``initdb`` failed, the server did
    not start or did not become ready in time, or it was asked to act in a state that does not
    allow it (never started, already stopped). The message carries the tail of the log."""


def find_postgres_bin_dir() -> Path:
    """Return the directory holding ``initdb``, ``postgres`` and ``psql``: the one of an
    ``initdb`` on ``PATH``, else the newest Debian ``/usr/lib/postgresql/<version>/bin`` (Debian
    keeps server binaries off ``PATH``).

    Raises :class:`PostgresNotFoundError` when neither exists. Pure look-up: starts nothing.
    """
    candidates: list[Path] = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    if _DEBIAN_BIN_DIRS.is_dir():
        versions = [p for p in _DEBIAN_BIN_DIRS.iterdir() if p.name.isdigit()]
        candidates.extend(p / "bin" for p in sorted(versions, key=lambda p: -int(p.name)))
    for directory in candidates:
        if all(os.access(directory / tool, os.X_OK) for tool in ("initdb", "postgres", "psql")):
            return directory
    raise PostgresNotFoundError(
        "no PostgreSQL server binaries: no initdb on PATH nor under /usr/lib/postgresql; "
        "run `bash scripts/install_postgres.sh` (or `make`) to install them"
    )


class PostgresServer:
    """One real PostgreSQL server as a child process on a fresh loopback port, for tests.

    Lifecycle: ``start()`` creates a temporary directory, runs ``initdb`` into it (superuser
    ``postgres``, trust authentication, which only loopback and the directory's own unix socket
    can reach), launches ``postgres`` listening on ``127.0.0.1:<fresh port>`` with its unix
    socket in the directory, and returns only once the server has said it accepts connections.
    ``stop()`` ends the server (SIGINT, PostgreSQL's fast shutdown, then SIGKILL to it and its
    children after 5 s), reaps it and removes the directory; it is idempotent and final.
    ``with PostgresServer() as pg:`` starts and stops. In between, ``kill()`` crashes the server
    (SIGKILL to the postmaster and every backend) and ``restart()`` starts it again on the same
    data directory and port, so every DSN handed out stays valid and every committed
    transaction is still there.

    Elsewhere than on loopback: ``listen`` is the address to listen on (and the host of every
    DSN), ``port`` a fixed port instead of a fresh one, ``wrap`` a command prefix for the server
    process alone (``["ip", "netns", "exec", namespace]`` runs it in another network namespace;
    the prefix must exec the server, so the child's pid stays the postmaster's), ``trusted`` the
    networks whose clients are let in without a password (``host all all <cidr> trust`` lines
    appended to ``pg_hba.conf``), and ``settings`` more server settings (``-c name=value``).
    ``initdb`` and ``psql`` run unwrapped: ``psql`` talks over the unix socket in the temporary
    directory, which a file system path reaches from any network namespace.

    ``fsync`` defaults to off: for tests that is fine. Nothing here survives the loss of the
    operating system's page cache, and no test causes one (a killed server's writes are still in
    the page cache, so a crash of the server loses nothing committed). What the log store's tests
    state, transactions and row locks, does not depend on it. ``synchronous_commit`` keeps its
    default (on): a commit returns after its WAL is written. Benchmarks that claim a commit's
    cost pass ``fsync=True``.

    Not for concurrent use from several threads beyond what an internal lock serializes; all
    calls block, so async tests may run them through ``asyncio.to_thread``.
    """

    def __init__(
        self,
        *,
        bin_dir: Path | None = None,
        fsync: bool = False,
        startup_timeout: float = 30.0,
        run_as: str = _RUN_AS,
        listen: str = _LOOPBACK,
        port: int | None = None,
        wrap: Sequence[str] = (),
        trusted: Sequence[str] = (),
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """Prepare a server; nothing is started or allocated until :meth:`start`.

        ``bin_dir`` defaults to :func:`find_postgres_bin_dir` (resolved at start); ``fsync``
        turns durable writes on; ``startup_timeout`` bounds ``initdb`` and the start in seconds;
        ``run_as`` is the user the server runs as when this process is root. ``listen``,
        ``port``, ``wrap``, ``trusted`` and ``settings`` are described in the class's
        docstring; ``ValueError`` for an address, a network, a port or a setting name that is
        not one.
        """
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        ipaddress.ip_address(listen)  # ValueError unless an address
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"not a TCP port: {port}")
        self._trusted = tuple(str(ipaddress.ip_network(cidr, strict=False)) for cidr in trusted)
        self._settings = dict(settings or {})
        for name, value in self._settings.items():
            if not _SETTING_NAME.fullmatch(name) or "\n" in value:
                raise ValueError(f"not a plain server setting: {name}={value!r}")
        self._bin_dir = bin_dir
        self._fsync = fsync
        self._startup_timeout = startup_timeout
        self._run_as = run_as
        self._listen = listen
        self._fixed_port = port
        self._wrap = tuple(wrap)
        self._lock = threading.RLock()
        self._process: subprocess.Popen[bytes] | None = None
        self._tmpdir: Path | None = None
        self._port: int | None = None
        self._closed = False

    # -- addresses ------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The address the server listens on (``listen``; loopback by default)."""
        return self._listen

    @property
    def port(self) -> int:
        """The TCP port; raises :class:`PostgresServerError` before :meth:`start`."""
        if self._port is None:
            raise PostgresServerError("PostgreSQL server was never started: it has no port yet")
        return self._port

    @property
    def user(self) -> str:
        """The superuser role, which every DSN of this server logs in as."""
        return _SUPERUSER

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@<host>:<port>/postgres``: the default database."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """The DSN of ``database`` on this server (which need not exist yet)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"postgresql://{_SUPERUSER}@{host}:{self.port}/{database}"

    @property
    def socket_dir(self) -> Path:
        """The directory of the server's unix socket (the temporary directory)."""
        return self._require_tmpdir()

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (inside the temporary directory)."""
        return self._require_tmpdir() / "data"

    @property
    def log_path(self) -> Path:
        """The file the output of ``initdb`` and the server goes to."""
        return self._require_tmpdir() / "postgres.log"

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it is running, else None."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def running(self) -> bool:
        """True while the postmaster exists and has not exited."""
        return self.pid is not None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Run ``initdb``, start the server and return once it accepts connections.

        Picks a fresh port (unless ``port`` was given), retrying with another if the server
        cannot bind it. Raises
        :class:`PostgresServerError` (with the log tail) if ``initdb`` fails or the server exits
        or is not ready within ``startup_timeout``; the process is then reaped, the directory
        removed and the server closed as by :meth:`stop`. Call once. Raises
        :class:`PostgresNotFoundError` if no ``bin_dir`` was given and none is found.
        """
        with self._lock:
            if self._closed:
                raise PostgresServerError("PostgreSQL server was stopped; create a new one")
            if self._tmpdir is not None:
                raise PostgresServerError("PostgreSQL server already started")
            self._bin_dir = self._bin_dir or find_postgres_bin_dir()
            self._tmpdir = Path(tempfile.mkdtemp(prefix="dsh-pg-"))
            _LIVE.add(self)
            started = False
            try:
                self._hand_over(self._tmpdir)
                self._initdb()
                self._trust()
                for attempt in range(_PORT_ATTEMPTS):
                    self._port = self._fixed_port or free_ports(1)[0]
                    if self._launch_and_wait():
                        started = True
                        return
                    if self._fixed_port is not None:
                        raise PostgresServerError(
                            f"PostgreSQL could not listen on {self.host}:{self._fixed_port}"
                            + self._log_tail()
                        )
                    if attempt + 1 == _PORT_ATTEMPTS:
                        raise PostgresServerError(
                            f"PostgreSQL found its port taken {_PORT_ATTEMPTS} times in a row"
                            + self._log_tail()
                        )
            finally:
                if not started:
                    self._close()

    def kill(self) -> None:
        """Crash the server: SIGKILL to the postmaster and to every backend and auxiliary
        process at once (they are not in its process group: each calls ``setsid()``), the
        postmaster reaped, and a wait of up to 10 s until none of them is left (a backend still
        attached to the shared memory would keep a restart from starting). The data directory
        stays for :meth:`restart`; clients' connections break. Idempotent; a no-op before
        :meth:`start` and after :meth:`stop`."""
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            _kill_group_and_reap(process)

    def restart(self) -> None:
        """Start the server again on the same data directory and port, after :meth:`kill` (a
        running server is killed first: a crash and a restart), and return once it accepts
        connections, as :meth:`start` does. PostgreSQL recovers from its WAL, so every
        transaction committed before the kill is there. Raises :class:`PostgresServerError`
        (with the log tail) before :meth:`start`, after :meth:`stop`, if the port was taken
        meanwhile or the server does not become ready in time; the data stays, so a later
        ``restart()`` may try again."""
        with self._lock:
            if self._closed:
                raise PostgresServerError("PostgreSQL server was stopped; create a new one")
            if self._tmpdir is None or self._port is None:
                raise PostgresServerError("PostgreSQL server was never started")
            self.kill()
            if not self._launch_and_wait():
                raise PostgresServerError(
                    f"PostgreSQL could not listen on {self.host}:{self.port} again"
                    + self._log_tail()
                )

    def create_database(self, name: str) -> str:
        """Create the empty database ``name`` (lower-case letters, digits, ``_``) and return its
        DSN. Raises :class:`PostgresServerError` if it exists or the server is not running."""
        if not _DATABASE_NAME.fullmatch(name):
            raise ValueError(f"not a plain database name: {name!r}")
        self.execute(f"CREATE DATABASE {name}")
        return self.dsn_for(name)

    def execute(self, sql: str, *, database: str = "postgres") -> None:
        """Run ``sql`` in ``database`` as the superuser, through ``psql`` over the unix socket:
        for setting up and breaking tests, not for timing. Raises :class:`PostgresServerError`
        (with the log tail) when it fails or the server is not running."""
        if not self.running:
            raise PostgresServerError("PostgreSQL server is not running")
        process = self._spawn(
            [
                self._tool("psql"),
                "--no-psqlrc",
                "--quiet",
                "--set",
                "ON_ERROR_STOP=1",
                "--host",
                str(self.socket_dir),
                "--port",
                str(self.port),
                "--username",
                _SUPERUSER,
                "--dbname",
                database,
                "--command",
                sql,
            ]
        )
        try:
            status = process.wait(timeout=self._startup_timeout)
        except subprocess.TimeoutExpired:
            kill_and_reap(process)
            raise PostgresServerError(f"psql hung on {sql!r}" + self._log_tail()) from None
        if status != 0:
            raise PostgresServerError(f"psql failed on {sql!r}" + self._log_tail())

    def stop(self) -> None:
        """End the server for good and remove the temporary directory.

        Fast shutdown (SIGINT: open transactions roll back, clients are disconnected; SIGTERM
        would be PostgreSQL's smart shutdown, which waits for every client to leave), then
        SIGKILL to the postmaster and its children after 5 s. Idempotent and safe to call in
        any state; when it returns no server process is left and the port is free.
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
        port = self._port if self._port is not None else "unassigned"
        state = "stopped" if self._closed else ("running" if self.running else "not running")
        return f"PostgresServer(port={port}, {state})"

    # -- internals ------------------------------------------------------------------------------

    def _close(self) -> None:
        try:
            process = self._process
            if process is not None:
                _stop_and_reap(process)
            self._process = None
        finally:
            self._closed = True
            _LIVE.discard(self)
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _require_tmpdir(self) -> Path:
        if self._tmpdir is None:
            raise PostgresServerError("PostgreSQL server was never started: no directory yet")
        return self._tmpdir

    def _tool(self, name: str) -> str:
        assert self._bin_dir is not None
        return str(self._bin_dir / name)

    def _account(self) -> pwd.struct_passwd | None:
        """The user to run as: None unless this process is root, which PostgreSQL refuses."""
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(self._run_as)
        except KeyError:
            raise PostgresServerError(
                f"running as root and there is no user {self._run_as!r} to run PostgreSQL as; "
                "run `bash scripts/install_postgres.sh`, which creates it"
            ) from None

    def _hand_over(self, path: Path) -> None:
        account = self._account()
        if account is not None:
            os.chown(path, account.pw_uid, account.pw_gid)

    def _spawn(
        self,
        argv: list[str],
        *,
        notify: Path | None = None,
        new_session: bool = False,
        wrapped: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as the server's user, with a clean environment, output to the log.
        ``wrapped``: behind the ``wrap`` prefix, which runs as this process's user (entering a
        namespace needs root) and then, as root, ``setpriv`` (which execs) to drop to the
        server's user."""
        tmpdir = self._require_tmpdir()
        # libpq and the server read PG* variables; a developer's must not reach a test server.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.pop("NOTIFY_SOCKET", None)
        if notify is not None:
            env["NOTIFY_SOCKET"] = str(notify)
        account = self._account()
        if account is not None:
            env["HOME"] = str(tmpdir)
            # setpriv drops to the server's user, not Popen's user=/group=: with those, Python
            # must fork() rather than vfork(), which runs gRPC's fork handlers in a process that
            # has channels open (the bench's, a test's), and once such a fork broke gRPC's
            # poller and left psql unrun.
            argv = [
                _setpriv(),
                f"--reuid={account.pw_uid}",
                f"--regid={account.pw_gid}",
                "--clear-groups",
                "--",
                *argv,
            ]
        if wrapped and self._wrap:
            argv = [*self._wrap, *argv]  # the prefix runs as root; setpriv drops
        with self.log_path.open("ab") as log:
            log.write(f"--- dsh-mesh: running {' '.join(argv)}\n".encode())
            log.flush()
            self._hand_over(self.log_path)
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmpdir,
                start_new_session=new_session,
            )

    def _initdb(self) -> None:
        process = self._spawn(
            [
                self._tool("initdb"),
                "--pgdata",
                str(self.data_dir),
                "--username",
                _SUPERUSER,
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--locale",
                "C",
                "--no-sync",  # a throwaway cluster: the files need not reach the disk
            ]
        )
        try:
            status = process.wait(timeout=self._startup_timeout)
        except subprocess.TimeoutExpired:
            kill_and_reap(process)
            raise PostgresServerError(
                f"initdb did not finish in {self._startup_timeout:g} s" + self._log_tail()
            ) from None
        if status != 0:
            raise PostgresServerError(f"initdb exited with status {status}" + self._log_tail())

    def _trust(self) -> None:
        """Let clients of the ``trusted`` networks in without a password."""
        if not self._trusted:
            return
        with (self.data_dir / "pg_hba.conf").open("a") as hba:
            hba.write("# dsh-mesh: the trusted networks of this test server\n")
            for network in self._trusted:
                hba.write(f"host all all {network} trust\n")

    def _command(self) -> list[str]:
        extra = [arg for name, value in self._settings.items() for arg in ("-c", f"{name}={value}")]
        return [
            self._tool("postgres"),
            "-D",
            str(self.data_dir),
            "-p",
            str(self.port),
            "-c",
            f"listen_addresses={self._listen}",
            "-c",
            f"unix_socket_directories={self.socket_dir}",
            "-c",
            f"fsync={'on' if self._fsync else 'off'}",
            "-c",
            "logging_collector=off",
            *extra,
        ]

    def _launch_and_wait(self) -> bool:
        """Launch the server and wait until it is ready: True. False when it could not bind its
        port (nothing is left running then); raises on any other failure."""
        # The server tells systemd when it accepts connections (sd_notify "READY=1", Debian
        # builds it so): we stand in for systemd, so readiness is a message, not a guess. A
        # build without it is caught by the pid file's status line, checked between messages.
        notify_path = self._require_tmpdir() / "notify.sock"
        notify_path.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(str(notify_path))
            self._hand_over(notify_path)
            log_start = self.log_path.stat().st_size
            # A session of its own: a Ctrl-C to the test run does not reach the server, whose
            # teardown stops it in order.
            process = self._spawn(
                self._command(), notify=notify_path, new_session=True, wrapped=True
            )
            self._process = process
            deadline = time.monotonic() + self._startup_timeout
            ready = False
            try:
                while not ready:
                    if process.poll() is not None:
                        if "could not create any TCP/IP" in self._log_since(log_start):
                            return False
                        tail = self._log_tail()
                        raise PostgresServerError(
                            f"postgres exited with status {process.returncode} during start-up"
                            + tail
                        )
                    if time.monotonic() >= deadline:
                        raise PostgresServerError(
                            f"postgres on port {self.port} not ready after "
                            f"{self._startup_timeout:g} s" + self._log_tail()
                        )
                    readable, _, _ = select.select([notify], [], [], _WAIT_SLICE)
                    if readable:
                        ready = b"READY=1" in notify.recv(4096).split(b"\n")
                    ready = ready or self._pid_file_says_ready()
                return True
            finally:
                if not ready:
                    _kill_group_and_reap(process)
                    self._process = None

    def _pid_file_says_ready(self) -> bool:
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return len(lines) >= 8 and lines[7].strip() == "ready"

    def _log_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                return log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def _log_tail(self) -> str:
        return log_tail(self.log_path)


def _stop_and_reap(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=_STOP_GRACE)
        except subprocess.TimeoutExpired:
            _kill_group_and_reap(process)
    process.wait()


def _kill_group_and_reap(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the postmaster and every process it started, reap it, and wait (bounded) until
    those are gone too.

    Every backend and auxiliary process of PostgreSQL calls ``setsid()`` when it starts, so none
    is in the postmaster's process group: killing the group alone leaves them to notice the
    postmaster's death on their own, a backend in the middle of a commit finishing it first.
    So the postmaster is stopped (SIGSTOP: it starts no more children and reacts to none
    dying), its children are found by their parent pid, and all of them are killed together,
    as a crash of the machine would. Only while the postmaster is unreaped: its pid is ours
    until then, and may be another's after."""
    children: list[tuple[int, str]] = []
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGSTOP)
        children = _children(process.pid)
        for child, _ in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    # Reparented to init, which reaps them a moment later; a backend still attached to the
    # shared memory would keep a restart from starting.
    deadline = time.monotonic() + _GONE_WAIT
    while any(_alive(child, started) for child, started in children):
        if time.monotonic() > deadline:
            break
        time.sleep(_WAIT_SLICE)


def _children(parent: int) -> list[tuple[int, str]]:
    """The processes whose parent is ``parent``, each with its start time (from ``/proc``)."""
    found: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[1] == str(parent):
            found.append((int(entry.name), fields[19]))
    return found


def _alive(pid: int, started: str) -> bool:
    """Whether process ``pid``, started at ``started``, still exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X") and fields[19] == started


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's closing parenthesis (state
    first, parent pid second, start time 20th), or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields if len(fields) > 19 else None


def _setpriv() -> str:
    found = shutil.which("setpriv")
    if found is None:
        raise PostgresServerError(
            "a wrapped server run by root drops to its user with setpriv (util-linux), "
            "which is not installed"
        )
    return found


# Servers holding a process or a temporary directory; the atexit hook is the safety net for a
# test run that dies before its fixtures' finalizers run.
_LIVE: set[PostgresServer] = set()


def _reap_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()


atexit.register(_reap_all)
