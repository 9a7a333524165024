"""The log store in one SQLite file: the embedded default for a mesh on one host.

Node processes on one host share the file (WAL journal, so readers never block the writer).
Each store object owns one connection, used only by its own worker thread; a write is one
``BEGIN IMMEDIATE`` transaction, which SQLite serialises across processes, so the fence check
and the inserts of an append see no other writer in between (ADR 0026). For the same reason
appends commit in the order they take positions from the one-row clock: the horizon is the
clock's value. Appends that wait at once, of any sessions, share one transaction (one commit,
one fsync), each in a savepoint of its own (ADR 0047).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from dsh_mesh.core import ApprovalRequestEntry, Record, RegistryUnavailable, SessionId, StoreRefused
from dsh_mesh.logstore._batch import (
    USAGE_COLUMNS,
    kept_usage,
    plan_append,
    usage_of_row,
    usage_row,
)
from dsh_mesh.registry import decode_acceptance, decode_record, encode_acceptance, encode_entry
from dsh_mesh.runtime import (
    DEFAULT_PAGE,
    Acceptance,
    IdempotencyKey,
    KeptUsage,
    Logged,
    StoreCondition,
    Write,
    Written,
)

T = TypeVar("T")
_Work = Callable[[sqlite3.Connection], Any]
_MAX_TOGETHER = 256
"""Appends committed in one transaction at most."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS fences ("
    " session TEXT PRIMARY KEY, fence INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS entries ("
    " session TEXT NOT NULL, seq INTEGER NOT NULL, position INTEGER NOT NULL,"
    " data BLOB NOT NULL, PRIMARY KEY (session, seq)) WITHOUT ROWID",
    "CREATE UNIQUE INDEX IF NOT EXISTS entries_by_position ON entries (position)",
    # A feed's poll reads only the new records of its sessions, not their whole transcripts.
    "CREATE INDEX IF NOT EXISTS entries_by_session_position ON entries (session, position)",
    # The last position given; a row of its own (not max(position)) so that it never goes
    # down when old entries are deleted.
    "CREATE TABLE IF NOT EXISTS clock ("
    " id INTEGER PRIMARY KEY CHECK (id = 0), position INTEGER NOT NULL)",
    # ``target`` and ``at`` (microseconds since the epoch) serve retention: a deleted session's
    # keys go with it, and keys expire by age.
    "CREATE TABLE IF NOT EXISTS idempotency ("
    " principal TEXT NOT NULL, key TEXT NOT NULL, target TEXT NOT NULL, at INTEGER NOT NULL,"
    " data BLOB NOT NULL, PRIMARY KEY (principal, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS idempotency_by_target ON idempotency (target)",
    "CREATE INDEX IF NOT EXISTS idempotency_by_age ON idempotency (at)",
    # The seqs of a session's compactions: a cold resume starts at its last one.
    "CREATE TABLE IF NOT EXISTS compactions ("
    " session TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (session, seq)) WITHOUT ROWID",
    # Each call's pending approval request (docs/approvals.md): a decision removes it.
    "CREATE TABLE IF NOT EXISTS approvals ("
    " session TEXT NOT NULL, call_id TEXT NOT NULL, seq INTEGER NOT NULL, expires INTEGER,"
    " decided INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (session, call_id)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS approvals_by_expiry ON approvals (expires)",
    # Each session's usage, kept as its model calls are appended (issue 34).
    "CREATE TABLE IF NOT EXISTS usage (session TEXT PRIMARY KEY,"
    " through INTEGER NOT NULL, calls INTEGER NOT NULL, input_tokens INTEGER NOT NULL,"
    " output_tokens INTEGER NOT NULL, cached_input_tokens INTEGER NOT NULL,"
    " first_input_tokens INTEGER, first_output_tokens INTEGER,"
    " first_cached_input_tokens INTEGER) WITHOUT ROWID",
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_BUSY_TIMEOUT_MS = 10_000
"""How long a write waits for another process's transaction on the same file."""
_PASSING_ERRORS = (
    "SQLITE_BUSY",
    "SQLITE_LOCKED",
    "SQLITE_FULL",
    "SQLITE_READONLY",
    "SQLITE_IOERR",
    "SQLITE_CANTOPEN",
    "SQLITE_PROTOCOL",
)
"""SQLite's refusals that pass by themselves (extended names start with these), retried as an
outage. Every other one (``SQLITE_ERROR``: a missing table; ``SQLITE_NOTADB``,
``SQLITE_CORRUPT``, ``SQLITE_PERM``...) needs an operator: :class:`StoreRefused`."""
_MAX_WORDS = 500
"""Characters of SQLite's own words an error message quotes."""


class SqliteLogStore:
    """A :class:`LogStore` in the SQLite file at ``path`` (created if missing). Use
    ``async with`` or call :meth:`aclose`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-log")
        self._connection: sqlite3.Connection | None = None
        self._closed = False
        self.condition = StoreCondition()
        self._waiting: list[tuple[_Work, asyncio.Future[Any]]] = []
        """Appends waiting for the next shared transaction."""
        self._committing: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SqliteLogStore:
        await self._run(lambda _: None)  # opens the file and creates the schema
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def raise_fence(self, session: SessionId, fence: int) -> int:
        def work(db: sqlite3.Connection) -> int:
            with _immediate(db):
                db.execute(
                    "INSERT INTO fences (session, fence) VALUES (?, ?)"
                    " ON CONFLICT (session) DO UPDATE SET fence = max(fence, excluded.fence)",
                    (session, fence),
                )
                return _fence_of(db, session)

        return await self._run(work)

    async def append(
        self, session: SessionId, writes: Sequence[Write], *, fence: int, unfenced: bool = False
    ) -> list[Written]:
        def work(db: sqlite3.Connection) -> list[Written]:
            row = db.execute(
                "SELECT max(seq) FROM entries WHERE session = ?", (session,)
            ).fetchone()
            last_seq = row[0] or 0
            plan = plan_append(
                session,
                writes,
                fence=fence,
                unfenced=unfenced,
                current_fence=_fence_of(db, session),
                last_seq=last_seq,
                known=lambda key: _known(db, key),
                waiting=lambda call: _waiting(db, session, call),
                now=datetime.now(UTC),
            )
            last = _clock(db)
            db.executemany(
                "INSERT INTO entries (session, seq, position, data) VALUES (?, ?, ?, ?)",
                [
                    (session, r.seq, last + n, encode_entry(r.entry, recorded_at=r.recorded_at))
                    for n, (r, _) in enumerate(plan.records, 1)
                ],
            )
            db.execute(
                "INSERT INTO clock (id, position) VALUES (0, ?)"
                " ON CONFLICT (id) DO UPDATE SET position = excluded.position",
                (last + len(plan.records),),
            )
            db.executemany(
                "INSERT INTO idempotency (principal, key, target, at, data) VALUES (?, ?, ?, ?, ?)",
                [
                    (
                        guard[0].principal,
                        guard[0].key,
                        session,
                        _micros(r.recorded_at),
                        encode_acceptance(guard[1]),
                    )
                    for r, guard in plan.records
                    if guard is not None
                ],
            )
            db.executemany(
                "INSERT INTO compactions (session, seq) VALUES (?, ?)",
                [(session, seq) for seq in plan.compactions],
            )
            db.executemany(
                "INSERT INTO approvals (session, call_id, seq, expires, decided)"
                " VALUES (?, ?, ?, ?, 0) ON CONFLICT (session, call_id)"
                " DO UPDATE SET seq = excluded.seq, expires = excluded.expires, decided = 0",
                [
                    (session, call, seq, None if expires is None else _micros(expires))
                    for call, seq, expires in plan.requests
                ],
            )
            db.executemany(
                "UPDATE approvals SET decided = 1 WHERE session = ? AND call_id = ?",
                [(session, call) for call in plan.decided],
            )
            db.executemany(
                "DELETE FROM approvals WHERE session = ? AND call_id = ?",
                [(session, call) for call in plan.answered],
            )
            if plan.keeps_usage(last_seq):
                kept = kept_usage(
                    plan,
                    _usage(db, session) if last_seq else None,
                    last_seq=last_seq,
                    earlier=lambda: _records(db, session, upto=last_seq),
                )
                if kept is not None:
                    db.execute(_SAVE_USAGE, (session, *usage_row(kept)))
            if plan.new_fence is not None:
                db.execute(
                    "INSERT INTO fences (session, fence) VALUES (?, ?)"
                    " ON CONFLICT (session) DO UPDATE SET fence = excluded.fence",
                    (session, plan.new_fence),
                )
            return plan.written

        written = await self._together(work)
        self.condition.accepted()
        return written

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int = DEFAULT_PAGE
    ) -> list[Record]:
        def work(db: sqlite3.Connection) -> list[Record]:
            rows = db.execute(
                "SELECT seq, data FROM entries WHERE session = ? AND seq > ? ORDER BY seq LIMIT ?",
                (session, after_seq, limit),
            ).fetchall()
            return [decode_record(seq, data) for seq, data in rows]

        return await self._run(work)

    async def horizon(self) -> int:
        return await self._run(_clock)

    async def since(
        self, sessions: Collection[SessionId], *, after: int, upto: int, limit: int = DEFAULT_PAGE
    ) -> list[Logged]:
        def work(db: sqlite3.Connection) -> list[Logged]:
            rows = db.execute(
                "SELECT session, position, seq, data FROM entries"
                " WHERE session IN (SELECT value FROM json_each(?))"
                " AND position > ? AND position <= ? ORDER BY position LIMIT ?",
                (json.dumps(list(sessions)), after, upto, limit),
            ).fetchall()
            return [
                Logged(session=SessionId(s), position=p, record=decode_record(seq, data))
                for s, p, seq, data in rows
            ]

        return await self._run(work)

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        def work(db: sqlite3.Connection) -> Acceptance | None:
            found = _known(db, key)
            return None if found is None else found[0]

        return await self._run(work)

    async def last(self, session: SessionId) -> Record | None:
        def work(db: sqlite3.Connection) -> Record | None:
            row = db.execute(
                "SELECT seq, data FROM entries WHERE session = ? ORDER BY seq DESC LIMIT 1",
                (session,),
            ).fetchone()
            return None if row is None else decode_record(row[0], row[1])

        return await self._run(work)

    async def usage(self, session: SessionId) -> KeptUsage | None:
        return await self._run(lambda db: _usage(db, session))

    async def last_compaction(self, session: SessionId) -> Record | None:
        def work(db: sqlite3.Connection) -> Record | None:
            row = db.execute(
                "SELECT e.seq, e.data FROM entries e JOIN"
                " (SELECT max(seq) AS seq FROM compactions WHERE session = ?) c"
                " ON e.session = ? AND e.seq = c.seq",
                (session, session),
            ).fetchone()
            return None if row is None else decode_record(row[0], row[1])

        return await self._run(work)

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        def work(db: sqlite3.Connection) -> list[tuple[SessionId, Record]]:
            rows = db.execute(
                "SELECT e.session, e.seq, e.data FROM approvals a"
                " JOIN entries e ON e.session = a.session AND e.seq = a.seq"
                " WHERE a.session IN (SELECT value FROM json_each(?)) AND NOT a.decided"
                " ORDER BY e.session, e.seq",
                (json.dumps(sorted(set(sessions))),),
            ).fetchall()
            return [(SessionId(s), decode_record(seq, data)) for s, seq, data in rows]

        return await self._run(work)

    async def stranded_approvals(
        self, now: datetime, *, limit: int
    ) -> list[tuple[SessionId, Record, bool]]:
        def work(db: sqlite3.Connection) -> list[tuple[SessionId, Record, bool]]:
            rows = db.execute(
                "SELECT e.session, e.seq, e.data, a.decided FROM approvals a"
                " JOIN entries e ON e.session = a.session AND e.seq = a.seq"
                " WHERE a.decided OR a.expires <= ? ORDER BY a.session, a.seq LIMIT ?",
                (_micros(now), limit),
            ).fetchall()
            return [
                (SessionId(s), decode_record(seq, data), bool(decided))
                for s, seq, data, decided in rows
            ]

        return await self._run(work)

    async def delete(self, session: SessionId, fence: int) -> None:
        def work(db: sqlite3.Connection) -> None:
            with _immediate(db):
                db.execute(
                    "INSERT INTO fences (session, fence) VALUES (?, ?)"
                    " ON CONFLICT (session) DO UPDATE SET fence = max(fence, excluded.fence)",
                    (session, fence),
                )
                db.execute("DELETE FROM entries WHERE session = ?", (session,))
                db.execute("DELETE FROM compactions WHERE session = ?", (session,))
                db.execute("DELETE FROM approvals WHERE session = ?", (session,))
                db.execute("DELETE FROM usage WHERE session = ?", (session,))
                db.execute("DELETE FROM idempotency WHERE target = ?", (session,))

        await self._run(work)

    async def expire_keys(self, before: datetime) -> int:
        def work(db: sqlite3.Connection) -> int:
            with _immediate(db):
                return db.execute(
                    "DELETE FROM idempotency WHERE at < ?", (_micros(before),)
                ).rowcount

        return await self._run(work)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        committing = self._committing
        if committing is not None:
            await asyncio.wait({committing})  # what waits is committed or refused first

        def close() -> None:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

        await asyncio.get_running_loop().run_in_executor(self._worker, close)
        self._worker.shutdown(wait=True)

    async def _together(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` in one transaction with the appends that wait beside it: one commit,
        one fsync for all of them, whichever sessions they write. Each runs in a savepoint of
        its own, so one that is refused (a stale fence, a conflicting key, a constraint) is
        undone alone and the others commit; a refusal of the whole file (busy past the
        timeout, full, read-only, an I/O error) or of the commit refuses them all, none
        having landed. Durable when it returns, as a transaction of its own was."""
        if self._closed:
            raise RegistryUnavailable(f"the log store {self.path} is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((work, future))
        if self._committing is None:
            self._committing = asyncio.create_task(self._commit_waiting(), name="sqlite commits")
        outcome: T | sqlite3.Error = await future
        if isinstance(outcome, sqlite3.Error):
            raise self._refusal(outcome) from outcome
        return outcome

    async def _commit_waiting(self) -> None:
        """Commit what waits, a transaction at a time, until nothing does. An append whose
        caller left before its transaction began is not run (as a job never started)."""
        loop = asyncio.get_running_loop()
        batch: list[tuple[_Work, asyncio.Future[Any]]] = []
        try:
            while self._waiting:
                batch = [(w, f) for w, f in self._waiting[:_MAX_TOGETHER] if not f.cancelled()]
                del self._waiting[:_MAX_TOGETHER]
                if not batch:
                    continue
                works = [work for work, _ in batch]
                try:
                    outcomes = await loop.run_in_executor(self._worker, self._in_one, works)
                except sqlite3.Error as failure:
                    outcomes = [(False, failure)] * len(batch)
                for (_, future), (ok, value) in zip(batch, outcomes, strict=True):
                    if future.done():
                        continue
                    if ok or isinstance(value, sqlite3.Error):
                        future.set_result(value)  # a store's refusal is typed by the caller
                    else:
                        future.set_exception(value)
                batch = []
        finally:
            self._committing = None
            # Stopped mid-way (the store closing, the loop ending): nothing may wait forever.
            for _, future in (*batch, *self._waiting):
                if not future.done():
                    future.set_exception(
                        RegistryUnavailable(f"the log store {self.path} is closed")
                    )
            self._waiting.clear()

    def _in_one(self, works: Sequence[_Work]) -> list[tuple[bool, Any]]:
        """On the worker thread: every work in one ``BEGIN IMMEDIATE`` ... ``COMMIT``, each in
        a savepoint; its outcome, or its exception (a passing SQLite error raises, for all)."""
        db = self._connection or self._open()
        outcomes: list[tuple[bool, Any]] = []
        try:
            with _immediate(db):
                for work in works:
                    db.execute("SAVEPOINT one")
                    try:
                        value = work(db)
                    except Exception as refused:
                        if isinstance(refused, sqlite3.Error) and _passes(refused):
                            raise
                        db.execute("ROLLBACK TO one")
                        db.execute("RELEASE one")
                        outcomes.append((False, refused))
                    else:
                        db.execute("RELEASE one")
                        outcomes.append((True, value))
        except sqlite3.Error as failure:
            self._forget_after(failure, db)
            raise
        return outcomes

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise RegistryUnavailable(f"the log store {self.path} is closed")

        def call() -> T:
            db = self._connection or self._open()
            try:
                return work(db)
            except sqlite3.Error as failure:
                self._forget_after(failure, db)
                raise

        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, call)
        except sqlite3.Error as failure:
            raise self._refusal(failure) from failure

    def _forget_after(self, failure: sqlite3.Error, db: sqlite3.Connection) -> None:
        """On the worker thread: after a refusal that passes by itself, drop ``db``, opened
        afresh by the next call (one opened on a file system since remounted may hold on to its
        old state)."""
        if _passes(failure) and self._connection is db:
            self._connection = None
            _close_quietly(db)

    def _refusal(self, failure: sqlite3.Error) -> RegistryUnavailable | StoreRefused:
        """The typed outcome of SQLite's refusal: an outage when it passes by itself (locked
        past the busy timeout, a full disk, a read-only file or file system, an I/O error),
        else :class:`StoreRefused` with SQLite's words and error name (a missing table, a
        file that is not a database)."""
        name = _error_name(failure)
        words = str(failure)[:_MAX_WORDS]
        outcome: RegistryUnavailable | StoreRefused
        if _passes(failure):
            outcome = RegistryUnavailable(f"the log store {self.path}: {words} ({name})")
        else:
            outcome = StoreRefused(
                f"the log store {self.path} refused: {words} ({name})",
                metadata={"store": str(self.path), "code": name},
            )
        self.condition.refused(outcome)
        return outcome

    def _open(self) -> sqlite3.Connection:
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
            try:
                db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
                _write_ahead(db)
                db.execute("PRAGMA synchronous = FULL")  # durable when an append returns
                for statement in _SCHEMA:
                    db.execute(statement)
            except BaseException:
                db.close()
                raise
            self._connection = db
        return self._connection


def _error_name(failure: sqlite3.Error) -> str:
    return getattr(failure, "sqlite_errorname", "") or type(failure).__name__


def _passes(failure: sqlite3.Error) -> bool:
    """Whether SQLite's refusal passes by itself (see :data:`_PASSING_ERRORS`)."""
    return _error_name(failure).startswith(_PASSING_ERRORS)


def _close_quietly(db: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        db.close()


def _write_ahead(db: sqlite3.Connection) -> None:
    """Put the file in WAL mode. On a new file, two processes (the nodes of a cluster that start
    together) switching it at once can get "database is locked" at once, without the busy
    timeout's wait (SQLite refuses an upgrade that could deadlock): try again until it holds,
    for as long as the busy timeout."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class _immediate:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any exception)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _fence_of(db: sqlite3.Connection, session: SessionId) -> int:
    row = db.execute("SELECT fence FROM fences WHERE session = ?", (session,)).fetchone()
    return 0 if row is None else int(row[0])


def _clock(db: sqlite3.Connection) -> int:
    """The last position given (0 before the first append)."""
    row = db.execute("SELECT position FROM clock").fetchone()
    return 0 if row is None else int(row[0])


def _known(db: sqlite3.Connection, key: IdempotencyKey) -> tuple[Acceptance, Record] | None:
    row = db.execute(
        "SELECT data FROM idempotency WHERE principal = ? AND key = ?", (key.principal, key.key)
    ).fetchone()
    if row is None:
        return None
    acceptance = decode_acceptance(row[0])
    found = db.execute(
        "SELECT data FROM entries WHERE session = ? AND seq = ?",
        (acceptance.target, acceptance.seq),
    ).fetchone()
    return acceptance, decode_record(acceptance.seq, found[0])


_SAVE_USAGE = (
    f"INSERT INTO usage (session, {', '.join(USAGE_COLUMNS)})"
    f" VALUES ({', '.join('?' * (len(USAGE_COLUMNS) + 1))}) ON CONFLICT (session) DO UPDATE SET "
    + ", ".join(f"{column} = excluded.{column}" for column in USAGE_COLUMNS)
)


def _usage(db: sqlite3.Connection, session: SessionId) -> KeptUsage | None:
    row = db.execute(
        f"SELECT {', '.join(USAGE_COLUMNS)} FROM usage WHERE session = ?", (session,)
    ).fetchone()
    return None if row is None else usage_of_row(row)


def _records(db: sqlite3.Connection, session: SessionId, *, upto: int) -> list[Record]:
    """``session``'s records up to seq ``upto`` (summed once, for a transcript written before
    the store kept usage)."""
    rows = db.execute(
        "SELECT seq, data FROM entries WHERE session = ? AND seq <= ? ORDER BY seq",
        (session, upto),
    ).fetchall()
    return [decode_record(seq, data) for seq, data in rows]


def _waiting(
    db: sqlite3.Connection, session: SessionId, call: str
) -> tuple[ApprovalRequestEntry, bool] | None:
    """What the index of approval requests holds for ``call`` of ``session``."""
    row = db.execute(
        "SELECT e.seq, e.data, a.decided FROM approvals a"
        " JOIN entries e ON e.session = a.session AND e.seq = a.seq"
        " WHERE a.session = ? AND a.call_id = ?",
        (session, call),
    ).fetchone()
    if row is None:
        return None
    entry = decode_record(row[0], row[1]).entry
    assert isinstance(entry, ApprovalRequestEntry)
    return entry, bool(row[2])


def _micros(at: datetime | None) -> int:
    """``at`` (now, when None) as microseconds since the epoch."""
    return ((at or datetime.now(UTC)) - _EPOCH) // timedelta(microseconds=1)
