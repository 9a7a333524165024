"""The real PostgreSQL the log store's tests run on (``dsh_mesh.testing.PostgresServer``): it
starts on a fresh port in a fresh directory, as an unprivileged user when we are root, and a
stop leaves no process, no directory and no port behind, also with clients still connected."""

from __future__ import annotations

import errno
import os
import socket

import asyncpg
import pytest

from dsh_mesh.testing import PostgresServer, PostgresServerError, find_postgres_bin_dir


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


def test_the_binaries_are_found() -> None:
    assert (find_postgres_bin_dir() / "initdb").exists()
