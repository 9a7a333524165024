"""The log store's conformance suite (tests/logstore_conformance.py) on the backends that run
without a server, in memory and SQLite, and what only SQLite does: two stores on one file, and
everything (positions too) kept across a reopen."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsh_mesh.core import ActivationFenced, SessionId
from dsh_mesh.logstore import MemoryLogStore, SqliteLogStore
from dsh_mesh.logstore._sqlite import _write_ahead
from dsh_mesh.runtime import IdempotencyKey, LogStore
from tests.logstore_conformance import (
    OTHER,
    THIRD,
    LogStoreConformance,
    S,
    contents,
    keyed,
    rising,
    step,
    task,
)


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LogStore]:
    if request.param == "memory":
        yield MemoryLogStore()
        return
    async with SqliteLogStore(tmp_path / "log.sqlite") as sqlite:
        yield sqlite


class TestConformance(LogStoreConformance):
    """The shared suite, in memory and on SQLite."""


async def test_two_stores_on_one_sqlite_file_share_the_fence(tmp_path: Path) -> None:
    """Two node processes on one host share the file: one's raise refuses the other's write."""
    path = tmp_path / "shared.sqlite"
    async with SqliteLogStore(path) as first, SqliteLogStore(path) as second:
        await first.raise_fence(S, 10)
        await first.append(S, [task("first")], fence=10)
        assert await second.raise_fence(S, 20) == 20
        with pytest.raises(ActivationFenced):
            await first.append(S, [task("stale")], fence=10)
        await second.append(S, [task("second")], fence=20)
        assert contents(await first.read(S)) == ["first", "second"]


def test_connections_switching_one_new_sqlite_file_to_wal_at_once_all_succeed(
    tmp_path: Path,
) -> None:
    """The nodes of a cluster start together and open one new file at the same moment. SQLite
    may refuse one of two connections switching it to WAL at once ("database is locked",
    without its busy wait); a store's open tries again, so each connection gets there."""
    refused: list[BaseException] = []
    for attempt in range(100):
        path = tmp_path / f"new-{attempt}.sqlite"
        together = threading.Barrier(4)

        def switch(path: Path = path, together: threading.Barrier = together) -> None:
            db = sqlite3.connect(path, isolation_level=None)
            try:
                db.execute("PRAGMA busy_timeout = 10000")
                together.wait()
                _write_ahead(db)
                assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            except BaseException as failure:
                refused.append(failure)
            finally:
                db.close()

        threads = [threading.Thread(target=switch) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert refused == []


async def test_two_stores_on_one_sqlite_file_share_the_positions(tmp_path: Path) -> None:
    """Appends from two node processes, one after the other and at once: one order of positions,
    each given once, following each session's seqs."""
    path = tmp_path / "shared.sqlite"
    async with SqliteLogStore(path) as first, SqliteLogStore(path) as second:
        await first.raise_fence(S, 10)
        await second.raise_fence(OTHER, 10)
        await first.append(S, [task("a")], fence=10)
        await second.append(OTHER, [task("b"), task("c")], fence=10)
        await second.append(S, [task("d")], fence=10)
        await first.append(OTHER, [task("e")], fence=10)
        await asyncio.gather(
            *(
                store.append(session, [task(f"{n}")], fence=10)
                for n in range(10)
                for store, session in [(first, S), (second, OTHER), (second, S), (first, OTHER)]
            )
        )
        top = await first.horizon()
        assert await second.horizon() == top
        logged = await second.since([S, OTHER], after=0, upto=top)
        assert len(logged) == 45 and rising(logged)
        assert contents([entry.record for entry in logged[:5]]) == ["a", "b", "c", "d", "e"]
        for session in (S, OTHER):
            seqs = [entry.record.seq for entry in logged if entry.session == session]
            assert seqs == list(range(1, len(seqs) + 1))
        assert await first.since([S, OTHER], after=0, upto=top) == logged


async def test_a_sqlite_store_keeps_everything_across_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    async with SqliteLogStore(path) as before:
        await before.raise_fence(S, 10)
        await before.append(S, [keyed("kept", "k")], fence=10)
        horizon = await before.horizon()
    async with SqliteLogStore(path) as after:
        assert contents(await after.read(S)) == ["kept"]
        assert await after.horizon() == horizon
        await after.append(S, [task("next")], fence=10)
        assert rising(await after.since([S], after=0, upto=await after.horizon()))
        assert await after.lookup(IdempotencyKey(principal="s-9", key="k")) is not None
        assert await after.raise_fence(S, 5) == 10
        await after.aclose()  # idempotent: the block closes it again


async def test_a_transcript_from_before_usage_was_kept_is_summed_once_at_its_next_call(
    tmp_path: Path,
) -> None:
    """A file written before the store kept usage has no usage row: it reads as none (the
    control plane sums such a transcript itself) until its next model call, which sums the
    transcript once, in that append's transaction, then keeps adding. An append with no
    call (an agent message: the warm path) neither reads nor writes it."""
    path = tmp_path / "old.sqlite"
    async with SqliteLogStore(path) as sqlite:
        await sqlite.raise_fence(S, 10)
        await sqlite.append(S, [task("a"), step(100, 5), step(50, 5)], fence=10)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM usage")  # as a file from before the usage table
    memory = MemoryLogStore()
    await memory.raise_fence(S, 10)
    await memory.append(S, [task("a"), step(100, 5), step(50, 5)], fence=10)
    memory.forget_usage(S)
    async with SqliteLogStore(path) as sqlite:
        for store in (sqlite, memory):
            assert await store.usage(S) is None
            await store.append(S, [task("b")], fence=10)  # no call: nothing read or kept
            assert await store.usage(S) is None
            await store.append(S, [step(10, 1)], fence=10)
            kept = await store.usage(S)
            assert kept is not None and kept.through == 5
            assert (kept.usage.model_calls, kept.usage.input_tokens) == (3, 160)
            assert kept.usage.first_call is not None
            assert kept.usage.first_call.input_tokens == 100


async def test_appends_of_many_sessions_waiting_together_share_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Appends of different sessions that wait at once commit together (one commit and one
    fsync), each with its own records, positions rising across them (ADR 0047)."""
    transactions: list[int] = []
    together = SqliteLogStore._in_one

    def counted(self: SqliteLogStore, works: list[object]) -> object:
        transactions.append(len(works))
        return together(self, works)  # type: ignore[arg-type]

    monkeypatch.setattr(SqliteLogStore, "_in_one", counted)
    sessions = [SessionId(f"s-{n}") for n in range(50)]
    async with SqliteLogStore(tmp_path / "log.sqlite") as store:
        await asyncio.gather(*(store.append(s, [task(f"for {s}")], fence=0) for s in sessions))
        for session in sessions:
            assert contents(await store.read(session)) == [f"for {session}"]
        feed = await store.since(sessions, after=0, upto=await store.horizon())
    assert sum(transactions) == 50
    assert len(transactions) < 50  # fewer transactions than appends
    assert rising(feed) and len(feed) == 50


async def test_an_append_refused_among_others_committed_with_it_is_undone_alone(
    tmp_path: Path,
) -> None:
    """One append of a shared transaction is refused (a stale fence): it leaves nothing, and
    the appends beside it land, each answered once."""
    async with SqliteLogStore(tmp_path / "log.sqlite") as store:
        await store.raise_fence(S, 10)
        outcomes = await asyncio.gather(
            store.append(OTHER, [task("before")], fence=0),
            store.append(S, [task("stale"), task("stale too")], fence=5),
            store.append(THIRD, [task("after")], fence=0),
            return_exceptions=True,
        )
        assert isinstance(outcomes[1], ActivationFenced)
        assert not isinstance(outcomes[0], BaseException)
        assert not isinstance(outcomes[2], BaseException)
        assert await store.read(S) == []
        assert contents(await store.read(OTHER)) == ["before"]
        assert contents(await store.read(THIRD)) == ["after"]
        await store.append(S, [task("current")], fence=10)
        assert contents(await store.read(S)) == ["current"]
