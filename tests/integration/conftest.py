"""Fixtures for integration tests: a real etcd server, started by the project's own code.

``etcd`` is one server for the whole session (or the one given by ``--etcd-endpoint``); tests
share it, so each uses keys under its own unique prefix and never disturbs the process.
``etcd_server`` is a private server per test, for tests that pause, kill or restart etcd.
``postgres`` is one PostgreSQL for the whole session, for the log store; each test takes a
database of its own on it (``PostgresServer.create_database``).
Every test under this directory is marked ``integration``. ``until_async`` waits for a
condition several test modules poll.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from dsh_mesh.testing import EtcdAddress, EtcdServer, PostgresServer

INTEGRATION_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items, not only this directory's.
    for item in items:
        if item.path.resolve().is_relative_to(INTEGRATION_DIR):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def etcd(request: pytest.FixtureRequest) -> Iterator[EtcdAddress]:
    """A healthy etcd for the session: ours on fresh loopback ports, or ``--etcd-endpoint``.

    Yields only the address: the server is shared, so no test may stop or pause it (use
    ``etcd_server`` for that).
    """
    endpoint = request.config.getoption("--etcd-endpoint")
    if endpoint:
        address = EtcdAddress.parse(str(endpoint))
        address.wait_healthy(timeout=15.0)
        yield address
        return
    with EtcdServer() as server:
        yield server.address


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A started etcd owned by this one test, stopped and reaped after it whatever happens."""
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL for the session, on a fresh loopback port. Shared: no test may stop it, and
    each works in a database of its own."""
    with PostgresServer() as server:
        yield server


async def until_async(
    predicate: Callable[[], Awaitable[bool]], *, within: float = 10.0, every: float = 0.01
) -> None:
    """Wait until ``predicate`` (which reads etcd or a store) holds, re-checking it ``every``
    seconds, for at most ``within`` seconds: a bounded wait for a condition, never a fixed
    sleep."""
    async with asyncio.timeout(within):
        while True:
            if await predicate():
                return
            await asyncio.sleep(every)
