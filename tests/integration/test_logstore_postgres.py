"""The log store on a real PostgreSQL (``dsh_mesh.testing.PostgresServer``): the conformance suite
(tests/logstore_conformance.py), then what only a shared server has. Two store objects on one
database are two nodes; a raw connection holding a transaction open forces the interleavings
ADR 0026 argues about, instead of hoping a race hits them; a stopped server is an outage."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from dsh_mesh.core import ActivationFenced, RegistryUnavailable, TaskEntry
from dsh_mesh.logstore import PostgresLogStore
from dsh_mesh.registry import encode_acceptance, encode_entry
from dsh_mesh.runtime import IdempotencyKey, LogStore
from dsh_mesh.testing import PostgresServer
from tests.logstore_conformance import OTHER, LogStoreConformance, S, contents, keyed, task

WAIT = 10.0
"""Seconds a test waits for the server to show an append blocked on a lock."""
INSERT_ENTRY = (
    "INSERT INTO entries (session, seq, position, data)"
    " VALUES ($1, $2, pg_current_xact_id()::text::bigint * 1024, $3)"
)
"""Another node's append of one record: a session, its seq and the entry."""


@pytest.fixture
def dsn(postgres: PostgresServer) -> str:
    """A fresh, empty database on the session's server."""
    return postgres.create_database(f"t_{uuid.uuid4().hex}")


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[PostgresLogStore]:
    async with PostgresLogStore(dsn=dsn) as postgres_store:
        yield postgres_store


@pytest.fixture
async def holder(dsn: str, store: LogStore) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the store's database (its tables exist): another node's
    transaction, held open for as long as the test likes."""
    connection = await asyncpg.connect(dsn)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
def private_server() -> Iterator[PostgresServer]:
    """A server of this test's own, which it may stop."""
    with PostgresServer() as server:
        yield server


class TestConformance(LogStoreConformance):
    """The shared suite on a real PostgreSQL, a fresh database per test."""


async def blocked_behind(dsn: str, holder: asyncpg.Connection) -> None:
    """Return once another backend waits for a lock ``holder`` holds (the server's own view:
    ``pg_blocking_pids``, read live on a connection of its own)."""
    pid = holder.get_server_pid()
    watcher = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + WAIT
        while not await watcher.fetchval(
            "SELECT count(*) > 0 FROM pg_locks"
            " WHERE NOT granted AND $1 = ANY(pg_blocking_pids(pid))",
            pid,
        ):
            assert time.monotonic() < deadline, f"nothing blocked behind backend {pid}"
            await asyncio.sleep(0.01)
    finally:
        await watcher.close()


async def test_two_stores_on_one_database_are_two_nodes(dsn: str) -> None:
    """One node's raise refuses the other node's stale append; each reads what both wrote."""
    async with PostgresLogStore(dsn=dsn) as first, PostgresLogStore(dsn=dsn) as second:
        await first.raise_fence(S, 10)
        await first.append(S, [task("first")], fence=10)
        assert await second.raise_fence(S, 20) == 20
        with pytest.raises(ActivationFenced):
            await first.append(S, [task("stale"), task("batch")], fence=10)
        await second.append(S, [task("second")], fence=20)
        assert await first.raise_fence(S, 15) == 20
        assert contents(await first.read(S)) == ["first", "second"]
        assert contents(await second.read(S)) == ["first", "second"]


async def test_a_stale_batch_blocked_by_a_raise_is_refused_whole(
    dsn: str, store: PostgresLogStore, holder: asyncpg.Connection
) -> None:
    """The new activation's raise holds the fence row; the old activation's batch waits for it,
    then finds the raised fence and writes nothing."""
    await store.raise_fence(S, 10)
    await store.append(S, [task("before")], fence=10)
    raise_ = holder.transaction()
    await raise_.start()
    await holder.execute("SELECT fence FROM fences WHERE session = $1 FOR UPDATE", S)
    stale = asyncio.create_task(store.append(S, [task("d"), task("e")], fence=10))
    try:
        await blocked_behind(dsn, holder)
        await holder.execute("UPDATE fences SET fence = GREATEST(fence, 20) WHERE session = $1", S)
        await raise_.commit()
        with pytest.raises(ActivationFenced):
            await stale
    finally:
        stale.cancel()
    assert contents(await store.read(S)) == ["before"]
    assert await store.raise_fence(S, 0) == 20


async def test_an_append_blocked_by_another_lands_whole_after_it(
    dsn: str, store: PostgresLogStore, holder: asyncpg.Connection
) -> None:
    """Two appends of one activation from two connections: the second waits for the first's
    lock, then sees its entry (a statement after the wait, a snapshot after the commit) and
    takes the next seqs."""
    await store.raise_fence(S, 10)
    first = holder.transaction()
    await first.start()
    await holder.execute("SELECT fence FROM fences WHERE session = $1 FOR UPDATE", S)
    second = asyncio.create_task(store.append(S, [task("b"), task("c")], fence=10))
    try:
        await blocked_behind(dsn, holder)
        entry = encode_entry(TaskEntry(content="a"), recorded_at=datetime.now(UTC))
        await holder.execute(INSERT_ENTRY, S, 1, entry)
        await first.commit()
        written = await second
    finally:
        second.cancel()
    assert [w.record.seq for w in written] == [2, 3]
    assert contents(await store.read(S)) == ["a", "b", "c"]


async def test_a_key_raced_in_from_another_session_is_answered_not_failed(
    dsn: str, store: PostgresLogStore, holder: asyncpg.Connection
) -> None:
    """An append to another session inserts the same key at the same moment (under its own
    fence lock, not ours): our insert waits on the key, then the unique violation rolls our
    append back and a new try answers the key's first acceptance."""
    await store.raise_fence(S, 10)
    await store.raise_fence(OTHER, 10)
    racing = keyed("x", "k")  # an acceptance in S, asked of an append to OTHER
    assert racing.idempotency is not None
    key, asked = racing.idempotency
    other = holder.transaction()
    await other.start()
    await holder.execute("SELECT fence FROM fences WHERE session = $1 FOR UPDATE", S)
    entry = encode_entry(TaskEntry(content="x"), recorded_at=datetime.now(UTC))
    await holder.execute(INSERT_ENTRY, S, 1, entry)
    first = encode_acceptance(dataclasses.replace(asked, seq=1))
    await holder.execute(
        "INSERT INTO idempotency (principal, key, target, at, data) VALUES ($1, $2, $3, now(), $4)",
        key.principal,
        key.key,
        S,
        first,
    )
    ours = asyncio.create_task(store.append(OTHER, [racing, task("unkeyed")], fence=10))
    try:
        await blocked_behind(dsn, holder)
        await other.commit()
        answered, unkeyed = await ours
    finally:
        ours.cancel()
    assert answered.known is not None and answered.record.seq == 1
    assert unkeyed.known is None and unkeyed.record.seq == 1
    assert contents(await store.read(OTHER)) == ["unkeyed"]
    assert await store.lookup(IdempotencyKey(principal=key.principal, key=key.key)) is not None


async def test_a_transaction_still_open_holds_the_horizon_back(
    store: PostgresLogStore, holder: asyncpg.Connection
) -> None:
    """Another node's append takes its transaction id, then commits after ours: its record's
    position is below ours. The horizon stays below both until it ends, so a feed reading up
    to the horizon gets both, in position order, and misses neither."""
    await store.raise_fence(S, 10)
    await store.raise_fence(OTHER, 10)
    cursor = await store.horizon()
    slow = holder.transaction()
    await slow.start()
    entry = encode_entry(TaskEntry(content="slow"), recorded_at=datetime.now(UTC))
    await holder.execute(INSERT_ENTRY, S, 1, entry)
    [fast] = await store.append(OTHER, [task("fast")], fence=10)
    [landed] = await store.since([OTHER], after=cursor, upto=2**63 - 1)
    assert landed.record == fast.record
    held = await store.horizon()
    assert cursor <= held < landed.position
    assert await store.since([S, OTHER], after=cursor, upto=held) == []
    await slow.commit()
    top = await store.horizon()
    assert top >= landed.position
    logged = await store.since([S, OTHER], after=held, upto=top)
    assert contents([entry.record for entry in logged]) == ["slow", "fast"]
    assert logged[1] == landed


async def test_a_rolled_back_transaction_releases_the_horizon(
    store: PostgresLogStore, holder: asyncpg.Connection
) -> None:
    await store.raise_fence(S, 10)
    idle = holder.transaction()
    await idle.start()
    await holder.fetchval("SELECT pg_current_xact_id()")  # takes an id, writes nothing
    [written] = await store.append(S, [task("after it")], fence=10)
    [landed] = await store.since([S], after=0, upto=2**63 - 1)
    assert await store.horizon() < landed.position
    await idle.rollback()
    assert await store.horizon() >= landed.position
    assert landed.record == written.record


async def test_nodes_opening_one_new_database_at_once_all_open(dsn: str) -> None:
    """CREATE TABLE IF NOT EXISTS races itself; the stores take turns on an advisory lock."""
    stores = [PostgresLogStore(dsn=dsn) for _ in range(4)]
    try:
        await asyncio.gather(*(s.__aenter__() for s in stores))
        await asyncio.gather(*(s.raise_fence(S, n) for n, s in enumerate(stores, 1)))
        assert await stores[0].raise_fence(S, 0) == 4
    finally:
        await asyncio.gather(*(s.aclose() for s in stores))


async def test_a_store_keeps_everything_across_a_reopen(dsn: str) -> None:
    async with PostgresLogStore(dsn=dsn) as before:
        await before.raise_fence(S, 10)
        await before.append(S, [keyed("kept", "k")], fence=10)
    async with PostgresLogStore(dsn=dsn) as after:
        assert contents(await after.read(S)) == ["kept"]
        assert await after.lookup(IdempotencyKey(principal="s-9", key="k")) is not None
        assert await after.raise_fence(S, 5) == 10
        await after.aclose()  # idempotent: the block closes it again


async def test_a_stopped_server_is_registry_unavailable(private_server: PostgresServer) -> None:
    dsn = private_server.create_database("log")
    async with PostgresLogStore(dsn=dsn, call_timeout=timedelta(seconds=2)) as store:
        await store.raise_fence(S, 10)
        await store.append(S, [task("landed")], fence=10)
        await asyncio.to_thread(private_server.stop)
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: store.append(S, [task("lost")], fence=10),
            lambda: store.raise_fence(S, 20),
            lambda: store.read(S),
            lambda: store.lookup(IdempotencyKey(principal="s-9", key="k")),
        ]
        for call in calls:
            with pytest.raises(RegistryUnavailable) as caught:
                await call()
            assert caught.value.__cause__ is not None


async def test_an_append_cut_off_by_a_stop_is_registry_unavailable(
    private_server: PostgresServer,
) -> None:
    """The server goes away while an append waits inside its transaction."""
    dsn = private_server.create_database("log")
    async with PostgresLogStore(dsn=dsn) as store:
        await store.raise_fence(S, 10)
        holder = await asyncpg.connect(dsn)
        try:
            await holder.execute("BEGIN")
            await holder.execute("SELECT fence FROM fences WHERE session = $1 FOR UPDATE", S)
            cut = asyncio.create_task(store.append(S, [task("cut off")], fence=10))
            try:
                await blocked_behind(dsn, holder)
                await asyncio.to_thread(private_server.stop)
                with pytest.raises(RegistryUnavailable) as caught:
                    await cut
            finally:
                cut.cancel()
            assert caught.value.__cause__ is not None
        finally:
            holder.terminate()


async def test_an_append_waiting_past_its_timeout_is_registry_unavailable(
    dsn: str, holder: asyncpg.Connection
) -> None:
    """A lock held longer than ``call_timeout``: the append gives up, writes nothing, and its
    connection serves the next call."""
    async with PostgresLogStore(dsn=dsn, pool_size=1, call_timeout=timedelta(seconds=0.3)) as store:
        await store.raise_fence(S, 10)
        async with holder.transaction():
            await holder.execute("SELECT fence FROM fences WHERE session = $1 FOR UPDATE", S)
            with pytest.raises(RegistryUnavailable) as caught:
                await store.append(S, [task("timed out")], fence=10)
            assert isinstance(caught.value.__cause__, TimeoutError)
        await store.append(S, [task("next")], fence=10)
        assert contents(await store.read(S)) == ["next"]


async def test_a_store_that_cannot_connect_is_registry_unavailable_and_closes(
    private_server: PostgresServer,
) -> None:
    dsn = private_server.dsn
    await asyncio.to_thread(private_server.stop)
    store = PostgresLogStore(dsn=dsn, call_timeout=timedelta(seconds=2))
    with pytest.raises(RegistryUnavailable) as caught:
        await store.read(S)
    assert isinstance(caught.value.__cause__, OSError)
    await store.aclose()
    await store.aclose()
    with pytest.raises(RegistryUnavailable):  # closed: no call may follow
        await store.read(S)


async def test_a_node_stopped_inside_an_append_does_not_hold_its_session_for_good(
    dsn: str,
) -> None:
    """A node frozen (SIGSTOP) in the middle of an append holds the session's fence row. The
    server ends a store's transaction left idle past the store's call timeout, so the next
    activation's raise goes through soon after instead of waiting for the zombie forever; the
    zombie's transaction is gone and writes nothing."""
    async with (
        PostgresLogStore(dsn=dsn, call_timeout=timedelta(seconds=1)) as zombie,
        PostgresLogStore(dsn=dsn) as successor,
    ):
        await zombie.raise_fence(S, 10)
        async with zombie._connection() as db:  # the zombie's own pooled connection
            frozen = db.transaction()
            await frozen.start()
            await db.execute("SELECT fence FROM fences WHERE session = $1 FOR UPDATE", S)
            await db.execute(
                "INSERT INTO entries (session, seq, position, data) VALUES"
                " ($1, 1, pg_current_xact_id()::text::bigint * 1024, $2)",
                S,
                encode_entry(TaskEntry(content="never")),
            )
            # ...and the node stops here, its transaction open and idle.
            started = time.monotonic()
            assert await successor.raise_fence(S, 20) == 20
            assert time.monotonic() - started < WAIT
            with pytest.raises(
                (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)
            ):
                await frozen.commit()
        assert await successor.read(S) == []
