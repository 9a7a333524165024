"""A real PostgreSQL server for tests, run as a child process on loopback.

Every server gets a fresh ``initdb`` cluster in a fresh temporary directory and a fresh loopback
port, so tests never share state with each other or with a PostgreSQL a developer runs on 5432.
Start-up waits for the server's own readiness notice instead of sleeping, shutdown always reaps
the child, and an ``atexit`` hook kills whatever a crashed test left running.

PostgreSQL refuses to run as root; as root, ``initdb`` and ``postgres`` run as the unprivileged
``postgres`` user (created by the Debian package that ``scripts/install_postgres.sh``
installs), which then owns the temporary directory.
"""

from __future__ import annotations

import atexit
import contextlib
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
_PORT_ATTEMPTS = 5
_DATABASE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


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
    ``stop()`` ends the server (SIGINT, PostgreSQL's fast shutdown, then SIGKILL to its process
    group after 5 s), reaps it and removes the directory; it is idempotent and final.
    ``with PostgresServer() as pg:`` starts and stops.

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
    ) -> None:
        """Prepare a server; nothing is started or allocated until :meth:`start`.

        ``bin_dir`` defaults to :func:`find_postgres_bin_dir` (resolved at start); ``fsync``
        turns durable writes on; ``startup_timeout`` bounds ``initdb`` and the start in seconds;
        ``run_as`` is the user the server runs as when this process is root.
        """
        if startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        self._bin_dir = bin_dir
        self._fsync = fsync
        self._startup_timeout = startup_timeout
        self._run_as = run_as
        self._lock = threading.RLock()
        self._process: subprocess.Popen[bytes] | None = None
        self._tmpdir: Path | None = None
        self._port: int | None = None
        self._closed = False

    # -- addresses ------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The loopback host the server listens on."""
        return _LOOPBACK

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
        """``postgresql://postgres@127.0.0.1:<port>/postgres``: the default database."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """The DSN of ``database`` on this server (which need not exist yet)."""
        return f"postgresql://{_SUPERUSER}@{self.host}:{self.port}/{database}"

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

        Picks a fresh port, retrying with another if the server cannot bind it. Raises
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
                for attempt in range(_PORT_ATTEMPTS):
                    (self._port,) = free_ports(1)
                    if self._launch_and_wait():
                        started = True
                        return
                    if attempt + 1 == _PORT_ATTEMPTS:
                        raise PostgresServerError(
                            f"PostgreSQL found its port taken {_PORT_ATTEMPTS} times in a row"
                            + self._log_tail()
                        )
            finally:
                if not started:
                    self._close()

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
        SIGKILL to the whole process group after 5 s. Idempotent and safe to call in any state;
        when it returns no server process is left and the port is free.
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
        self, argv: list[str], *, notify: Path | None = None, new_session: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as the server's user, with a clean environment, output to the log."""
        tmpdir = self._require_tmpdir()
        # libpq and the server read PG* variables; a developer's must not reach a test server.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.pop("NOTIFY_SOCKET", None)
        if notify is not None:
            env["NOTIFY_SOCKET"] = str(notify)
        account = self._account()
        if account is not None:
            env["HOME"] = str(tmpdir)
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
                user=None if account is None else account.pw_uid,
                group=None if account is None else account.pw_gid,
                extra_groups=None if account is None else [],
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

    def _command(self) -> list[str]:
        return [
            self._tool("postgres"),
            "-D",
            str(self.data_dir),
            "-p",
            str(self.port),
            "-c",
            f"listen_addresses={_LOOPBACK}",
            "-c",
            f"unix_socket_directories={self.socket_dir}",
            "-c",
            f"fsync={'on' if self._fsync else 'off'}",
            "-c",
            "logging_collector=off",
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
            # Its own process group: a stop can end the backends with the postmaster.
            process = self._spawn(self._command(), notify=notify_path, new_session=True)
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
    # The backends are the postmaster's children, in its process group: kill them too, or they
    # linger (reparented to init) after the postmaster is gone. Only while it is unreaped: its
    # pid (the group's id) is ours until then, and may be another's after.
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# Servers holding a process or a temporary directory; the atexit hook is the safety net for a
# test run that dies before its fixtures' finalizers run.
_LIVE: set[PostgresServer] = set()


def _reap_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()


atexit.register(_reap_all)
