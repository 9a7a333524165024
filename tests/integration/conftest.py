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
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from dsh_mesh.core import (
    AbortSignal,
    Activation,
    ActivationId,
    AgentRef,
    Entry,
    HumanPromptEntry,
    ListingFilter,
    NodeId,
    Record,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    ToolCall,
)
from dsh_mesh.registry import (
    Etcd,
    EtcdConfig,
    EtcdSessionStore,
    Keys,
    LeaseConfig,
    LeaseKeeper,
    RegistryReads,
)
from dsh_mesh.registry._reads import Listing
from dsh_mesh.runtime import LogStore
from dsh_mesh.testing import EtcdAddress, EtcdServer, FaultyLogStore, PostgresServer, StoreCall
from dsh_mesh.tools import Tool, ToolInvocation, ToolOutput, run_limited

INTEGRATION_DIR = Path(__file__).resolve().parent
WAIT = 10.0
"""Upper bound of a wait of these helpers."""
POLL = timedelta(seconds=0.05)
"""How often the reads :func:`opened` makes poll the log store."""


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


def of_session(name: str) -> Callable[[StoreCall], bool]:
    """Matches a log store call about the session ``name``."""
    return lambda call: call.arguments.get("session") == SessionId(name)


# -- a registry over one etcd, under a key prefix of its own ------------------------------


@dataclass
class Mesh:
    """A registry under a key prefix of its own: an etcd client, its store over a log store
    a test can step into, and the reads over both."""

    etcd: Etcd
    keys: Keys
    log: FaultyLogStore
    store: EtcdSessionStore
    reads: RegistryReads
    lease: LeaseKeeper

    async def root(self, name: str) -> SessionId:
        session = SessionId(name)
        await self.store.create_header(
            SessionHeader(session_id=session, kind=SessionKind.ROOT, parent_session=None, spec=SPEC)
        )
        return session

    async def child(self, name: str, parent: SessionId, entries: Sequence[Entry] = ()) -> SessionId:
        session = SessionId(name)
        await self.store.create_header(
            SessionHeader(
                session_id=session,
                kind=SessionKind.CONTINUABLE_CHILD,
                parent_session=parent,
                spec=SPEC,
            ),
            entries,
        )
        return session

    async def activate(self, session: SessionId) -> Activation:
        activation = Activation(
            session_id=session, activation_id=ActivationId(f"a-{session}"), node_id=NODE
        )
        assert await self.store.try_activate(activation) == activation
        return activation

    async def append(self, activation: Activation, text: str) -> Record:
        record, _ = await self.store.append(
            activation.session_id, prompt(text), writer=activation.activation_id
        )
        return record

    def reads_polling(self, every: timedelta) -> RegistryReads:
        return RegistryReads(self.etcd, self.keys, self.log, poll=every)


SPEC = SessionSpec(preset="p", model="m")
NODE = NodeId("n-1")


@asynccontextmanager
async def opened(endpoint: str, log: LogStore) -> AsyncIterator[Mesh]:
    """A client, a lease, a store and the reads over ``log`` (the caller's to close), under a
    key prefix of their own (with no session in it yet)."""
    async with Etcd(EtcdConfig(endpoint=endpoint, call_timeout=timedelta(seconds=3))) as etcd:
        lease = LeaseKeeper(etcd, LeaseConfig())
        await lease.grant()
        held = FaultyLogStore(log)
        keys = Keys(f"/lf-{secrets.token_hex(4)}/".encode())
        store = EtcdSessionStore(etcd, keys, log=held, lease=lambda: lease.lease_id)
        try:
            yield Mesh(etcd, keys, held, store, RegistryReads(etcd, keys, held, poll=POLL), lease)
        finally:
            await store.aclose()
            with contextlib.suppress(RegistryUnavailable):
                await lease.revoke()


def keys_fetched(mesh: Mesh) -> list[int]:
    """From now on, the number of keys each etcd range read of ``mesh`` returns, in order
    (a transaction's own reads are not ranges)."""
    fetched: list[int] = []
    original = mesh.etcd.range

    async def counting(*args: Any, **kwargs: Any) -> Any:
        response = await original(*args, **kwargs)
        fetched.append(len(response.kvs))
        return response

    mesh.etcd.range = counting  # type: ignore[method-assign]
    return fetched


def prompt(text: str) -> HumanPromptEntry:
    """A human prompt saying ``text``."""
    return HumanPromptEntry(content=text)


async def every_page(
    reads: RegistryReads, *, root: SessionId | None, limit: int, resident_only: bool = False
) -> list[Listing]:
    """The pages of a listing, from the first until one has no next token."""
    pages: list[Listing] = []
    token = ""
    async with asyncio.timeout(WAIT):
        while True:
            page = await reads.listing(
                root=root,
                after=token,
                limit=limit,
                only=ListingFilter(resident=True if resident_only else None),
            )
            pages.append(page)
            if not page.next_token:
                return pages
            assert len(pages) < 100, "the listing never ends"
            token = page.next_token


def ids(pages: Sequence[Listing]) -> list[SessionId]:
    """The sessions ``pages`` list, in order."""
    return [header.session_id for page in pages for header in page.headers]


async def listed(
    reads: RegistryReads, *, root: SessionId | None, limit: int = 2, resident_only: bool = False
) -> list[SessionId]:
    """Every session of a listing, read ``limit`` at a time."""
    return ids(await every_page(reads, root=root, limit=limit, resident_only=resident_only))


# -- a tool called the way the agent loop calls it -------------------------------------------


def tool_invocation(tool: Tool, call_id: str = "c-1") -> ToolInvocation:
    """Call ``call_id`` of ``tool``, by a made-up agent's step."""
    return ToolInvocation(
        caller=AgentRef(session_id=SessionId("s-1"), activation_id=ActivationId("a-1")),
        call=ToolCall(call_id=call_id, name=tool.descriptor.name, arguments_json="{}"),
        signal=AbortSignal(),
        step_seq=4,
        index=0,
    )


async def call_tool(tool: Tool, arguments: dict[str, object], call_id: str = "c-1") -> ToolOutput:
    """What ``tool`` answers ``arguments`` within its own limits, as the agent loop runs it."""
    return await run_limited(tool, tool_invocation(tool, call_id), arguments, tool.limits)  # type: ignore[attr-defined]
