"""The real PostgreSQL the log store's tests run on (``dsh_mesh.testing.PostgresServer``): it
starts on a fresh port in a fresh directory, as an unprivileged user when we are root, and a
stop leaves no process, no directory and no port behind, also with clients still connected. A
kill crashes it (connections fail) and a restart brings it back on the same port with every
committed row; it listens on the address and port it is told, trusts the networks given, and
runs behind a command prefix such as ``ip netns exec`` (the multi-host bed's database host)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from dsh_mesh.testing import PostgresServer, PostgresServerError, find_postgres_bin_dir
from dsh_mesh.testing._processes import free_ports


def assert_stopped(pid: int, port: int) -> None:
    """The postmaster is reaped, none of its backends lingers, the port is free."""
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # its process group: the postmaster and every backend
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        assert probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED


async def test_a_server_accepts_connections_when_start_returns() -> None:
    with PostgresServer() as server:
        connection = await asyncpg.connect(server.dsn)
        try:
            assert await connection.fetchval("SELECT current_user") == server.user
            assert await connection.fetchval("SHOW synchronous_commit") == "on"
        finally:
            await connection.close()
        assert server.socket_dir.joinpath(f".s.PGSQL.{server.port}").exists()


async def test_a_stop_with_clients_connected_leaves_nothing_behind() -> None:
    server = PostgresServer()
    server.start()
    pid, port, directory = server.pid, server.port, server.socket_dir
    assert pid is not None
    idle = await asyncpg.connect(server.dsn)
    in_transaction = await asyncpg.connect(server.dsn)
    await in_transaction.execute("BEGIN")
    try:
        server.stop()  # fast shutdown: it does not wait for the clients to leave
        assert_stopped(pid, port)
        assert not directory.exists()
        assert not server.running
        server.stop()  # idempotent
        with pytest.raises(PostgresServerError):
            server.start()  # final
    finally:
        idle.terminate()
        in_transaction.terminate()


def test_two_servers_get_their_own_ports_and_directories() -> None:
    with PostgresServer() as first, PostgresServer() as second:
        assert first.port != second.port
        assert first.data_dir != second.data_dir
        assert first.dsn_for("x").endswith(f":{first.port}/x")


def test_databases_are_created_by_plain_names_only() -> None:
    with PostgresServer() as server:
        dsn = server.create_database("fresh_1")
        assert dsn == server.dsn_for("fresh_1")
        with pytest.raises(PostgresServerError):
            server.create_database("fresh_1")  # exists
        with pytest.raises(ValueError, match="plain database name"):
            server.create_database('x"; DROP DATABASE postgres; --')


def test_a_server_never_started_stops_quietly() -> None:
    server = PostgresServer()
    server.stop()
    with pytest.raises(PostgresServerError):
        _ = server.port


@pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL runs as another user only for root")
def test_as_root_the_server_runs_as_the_postgres_user() -> None:
    with PostgresServer() as server:
        assert server.pid is not None
        owner = os.stat(server.data_dir).st_uid
        assert owner != 0
        assert os.stat(f"/proc/{server.pid}").st_uid == owner


_FORKS_SEEN_BY_GRPC = """
import asyncio, grpc
from dsh_mesh.testing import PostgresServer

async def main():
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # gRPC's threads run, as in the bench
    waiting = asyncio.create_task(channel.channel_ready())
    await asyncio.sleep(0.2)
    with PostgresServer() as server:
        await asyncio.to_thread(server.create_database, "forked")
    waiting.cancel()
    await channel.close()

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL runs as another user only for root")
def test_a_server_started_beside_live_grpc_channels_runs_no_grpc_fork_handler() -> None:
    # A bench run once failed `CREATE DATABASE`: psql was started by fork() (Popen's user=),
    # which ran gRPC's fork handlers in a process with channels open and broke its poller.
    # setpriv drops to the server's user instead, so Python starts each tool with vfork().
    env = {**os.environ, "GRPC_VERBOSITY": "info"}
    done = subprocess.run(
        [sys.executable, "-c", _FORKS_SEEN_BY_GRPC],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fork_posix" not in done.stderr, done.stderr[-2000:]


def test_the_binaries_are_found() -> None:
    assert (find_postgres_bin_dir() / "initdb").exists()


async def test_a_killed_server_refuses_and_a_restart_keeps_its_data_and_its_dsn() -> None:
    with PostgresServer() as server:
        dsn = server.create_database("kept")
        pid = server.pid
        assert pid is not None
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute("CREATE TABLE t (v TEXT)")
            await connection.execute("INSERT INTO t VALUES ('committed before the kill')")
            backend = await connection.fetchval("SELECT pg_backend_pid()")
            server.kill()
            assert not server.running and server.pid is None
            # No backend outlives its postmaster (each is in a process group of its own).
            assert _state(backend) in ("gone", "Z")
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)
            # The open connection broke, and a new one is refused.
            with pytest.raises((asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError)):
                await connection.fetchval("SELECT 1")
            with pytest.raises(ConnectionRefusedError):
                await asyncpg.connect(dsn, timeout=5)
            server.kill()  # idempotent
        finally:
            connection.terminate()
        server.restart()
        assert server.running and server.pid != pid
        assert server.dsn_for("kept") == dsn  # same host and port
        again = await asyncpg.connect(dsn)
        try:
            assert await again.fetchval("SELECT v FROM t") == "committed before the kill"
        finally:
            await again.close()
        server.restart()  # a running server: crashed and started again
        assert server.running
        after = await asyncpg.connect(dsn)
        try:
            assert await after.fetchval("SELECT count(*) FROM t") == 1
        finally:
            await after.close()


def test_a_server_restarts_only_between_start_and_stop() -> None:
    server = PostgresServer()
    with pytest.raises(PostgresServerError, match="never started"):
        server.restart()
    server.kill()  # nothing to kill: a no-op
    server.start()
    server.stop()
    with pytest.raises(PostgresServerError, match="stopped"):
        server.restart()


async def test_a_server_listens_where_it_is_told_and_trusts_the_networks_given() -> None:
    (port,) = free_ports(1)
    with PostgresServer(
        listen="127.0.0.2", port=port, trusted=["127.0.0.0/8"], settings={"max_connections": "42"}
    ) as server:
        assert server.host == "127.0.0.2" and server.port == port
        assert server.dsn == f"postgresql://postgres@127.0.0.2:{port}/postgres"
        hba = (server.data_dir / "pg_hba.conf").read_text()
        assert "host all all 127.0.0.0/8 trust" in hba
        connection = await asyncpg.connect(server.dsn)
        try:
            assert await connection.fetchval("SHOW max_connections") == "42"
        finally:
            await connection.close()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            assert probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED  # not on .1
        with pytest.raises(PostgresServerError, match="could not listen"):
            PostgresServer(listen="127.0.0.2", port=port).start()  # a fixed port is not moved


@pytest.mark.skipif(os.geteuid() != 0, reason="entering a network namespace needs root")
def test_a_wrapped_server_runs_in_another_network_namespace() -> None:
    namespace = f"dshpgtest{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        subprocess.run(["ip", "-n", namespace, "link", "set", "lo", "up"], check=True)
        with PostgresServer(port=5432, wrap=["ip", "netns", "exec", namespace]) as server:
            assert server.pid is not None
            # `ip netns exec` execs: the child is the postmaster, in the namespace, as postgres.
            assert _same_netns(server.pid, namespace)
            assert os.stat(f"/proc/{server.pid}").st_uid == os.stat(server.data_dir).st_uid != 0
            server.create_database("over_the_socket")  # psql, unwrapped, over the unix socket
            inside = subprocess.run(
                [
                    "ip", "netns", "exec", namespace, sys.executable, "-c",
                    "import socket; socket.create_connection(('127.0.0.1', 5432), 5).close()",
                ],
                capture_output=True,
            )  # fmt: skip
            assert inside.returncode == 0, inside.stderr
            pid = server.pid
            server.kill()
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)
            server.restart()
            assert server.pid is not None and _same_netns(server.pid, namespace)
    finally:
        subprocess.run(["ip", "netns", "del", namespace], check=False)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def _same_netns(pid: int, namespace: str) -> bool:
    ours = os.stat(f"/proc/{pid}/ns/net")
    theirs = os.stat(f"/run/netns/{namespace}")
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)
