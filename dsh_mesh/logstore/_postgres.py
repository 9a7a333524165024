"""The log store in PostgreSQL: one database shared by the nodes of every host (ADR 0026, 0027).

Each store object owns an asyncpg pool. An append is one transaction at PostgreSQL's default
isolation (read committed): it locks the session's fence row first, so appends to one session,
and a raise of its fence, take turns on that row, whichever node or process they come from.
Appends to different sessions do not wait for each other.

Appends thus commit in any order, and positions from a counter would not follow the commits: a
feed could read past a position whose record commits later, and miss it. A record's position
is instead its transaction's id times 1024 (``_RANKS``) plus its rank in the transaction. The
horizon is just below the oldest transaction id still running anywhere on the server (the
snapshot's ``xmin``): every transaction with a smaller id has ended, and any that commits later
has an id at least as high.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from dsh_mesh.core import (
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    Record,
    RegistryUnavailable,
    SessionId,
    StoreRefused,
)
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

_SCHEMA_LOCK = 0x64_73_68_6C_6F_67  # "dshlog": any constant all stores agree on
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS fences (session TEXT PRIMARY KEY, fence BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS entries ("
    " session TEXT NOT NULL, seq BIGINT NOT NULL, position BIGINT NOT NULL,"
    " data BYTEA NOT NULL, PRIMARY KEY (session, seq))",
    "CREATE UNIQUE INDEX IF NOT EXISTS entries_by_position ON entries (position)",
    # A feed's poll reads only the new records of its sessions, not their whole transcripts.
    "CREATE INDEX IF NOT EXISTS entries_by_session_position ON entries (session, position)",
    # ``target`` and ``at`` serve retention: a deleted session's keys go with it, and keys
    # expire by age.
    "CREATE TABLE IF NOT EXISTS idempotency ("
    " principal TEXT NOT NULL, key TEXT NOT NULL, target TEXT NOT NULL,"
    " at TIMESTAMPTZ NOT NULL, data BYTEA NOT NULL, PRIMARY KEY (principal, key))",
    "CREATE INDEX IF NOT EXISTS idempotency_by_target ON idempotency (target)",
    "CREATE INDEX IF NOT EXISTS idempotency_by_age ON idempotency (at)",
    # The seqs of a session's compactions: a cold resume starts at its last one.
    "CREATE TABLE IF NOT EXISTS compactions ("
    " session TEXT NOT NULL, seq BIGINT NOT NULL, PRIMARY KEY (session, seq))",
    # Each call's pending approval request (docs/approvals.md): a decision removes it.
    "CREATE TABLE IF NOT EXISTS approvals ("
    " session TEXT NOT NULL, call_id TEXT NOT NULL, seq BIGINT NOT NULL, expires TIMESTAMPTZ,"
    " decided BOOLEAN NOT NULL DEFAULT FALSE, PRIMARY KEY (session, call_id))",
    "CREATE INDEX IF NOT EXISTS approvals_by_expiry ON approvals (expires)",
    # Each session's usage, kept as its model calls are appended (issue 34).
    "CREATE TABLE IF NOT EXISTS usage (session TEXT PRIMARY KEY,"
    " through BIGINT NOT NULL, calls BIGINT NOT NULL, input_tokens BIGINT NOT NULL,"
    " output_tokens BIGINT NOT NULL, cached_input_tokens BIGINT NOT NULL,"
    " first_input_tokens BIGINT, first_output_tokens BIGINT, first_cached_input_tokens BIGINT)",
)
_ENSURE_FENCE = "INSERT INTO fences (session, fence) VALUES ($1, 0) ON CONFLICT DO NOTHING"
_LOCK_FENCE = "SELECT fence FROM fences WHERE session = $1 FOR UPDATE"
_LAST_SEQ = "SELECT max(seq) FROM entries WHERE session = $1"
_KNOWN_KEYS = (
    "SELECT i.principal, i.key, i.data FROM idempotency i"
    " JOIN unnest($1::text[], $2::text[]) AS k (principal, key)"
    " ON i.principal = k.principal AND i.key = k.key"
)
_RECORDS_AT = (
    "SELECT e.session, e.seq, e.data FROM entries e"
    " JOIN unnest($1::text[], $2::bigint[]) AS r (session, seq)"
    " ON e.session = r.session AND e.seq = r.seq"
)
_RANKS = 1024
"""Positions per transaction: an append writes at most this many records."""
_INSERT_ENTRIES = (
    "INSERT INTO entries (session, seq, position, data)"
    f" SELECT $1, seq, pg_current_xact_id()::text::bigint * {_RANKS} + rank - 1, data"
    " FROM unnest($2::bigint[], $3::bytea[]) WITH ORDINALITY AS n (seq, data, rank)"
)
_INSERT_KEYS = (
    "INSERT INTO idempotency (principal, key, target, at, data)"
    " SELECT principal, key, $1, at, data"
    " FROM unnest($2::text[], $3::text[], $4::timestamptz[], $5::bytea[])"
    " AS k (principal, key, at, data)"
)
_LAST = "SELECT seq, data FROM entries WHERE session = $1 ORDER BY seq DESC LIMIT 1"
_INSERT_COMPACTIONS = "INSERT INTO compactions (session, seq) SELECT $1, unnest($2::bigint[])"
_LAST_COMPACTION = (
    "SELECT e.seq, e.data FROM entries e"
    " JOIN (SELECT max(seq) AS seq FROM compactions WHERE session = $1) c"
    " ON e.session = $1 AND e.seq = c.seq"
)
_FORGET_COMPACTIONS = "DELETE FROM compactions WHERE session = $1"
_INSERT_REQUESTS = (
    "INSERT INTO approvals (session, call_id, seq, expires, decided)"
    " SELECT $1, call_id, seq, expires, FALSE"
    " FROM unnest($2::text[], $3::bigint[], $4::timestamptz[]) AS r (call_id, seq, expires)"
    " ON CONFLICT (session, call_id)"
    " DO UPDATE SET seq = excluded.seq, expires = excluded.expires, decided = FALSE"
)
_DECIDE_REQUESTS = (
    "UPDATE approvals SET decided = TRUE WHERE session = $1 AND call_id = ANY($2::text[])"
)
_STRANDED_APPROVALS = (
    "SELECT e.session, e.seq, e.data, a.decided FROM approvals a"
    " JOIN entries e ON e.session = a.session AND e.seq = a.seq"
    " WHERE a.decided OR a.expires <= $1 ORDER BY a.session, a.seq LIMIT $2"
)
_FORGET_REQUESTS = "DELETE FROM approvals WHERE session = $1 AND call_id = ANY($2::text[])"
_PENDING_APPROVALS = (
    "SELECT e.session, e.seq, e.data FROM approvals a"
    " JOIN entries e ON e.session = a.session AND e.seq = a.seq"
    " WHERE a.session = ANY($1::text[]) AND NOT a.decided ORDER BY e.session, e.seq"
)
_FORGET_APPROVALS = "DELETE FROM approvals WHERE session = $1"
_WAITING = (
    "SELECT a.call_id, e.seq, e.data, a.decided FROM approvals a"
    " JOIN entries e ON e.session = a.session AND e.seq = a.seq"
    " WHERE a.session = $1 AND a.call_id = ANY($2::text[])"
)
_USAGE = f"SELECT {', '.join(USAGE_COLUMNS)} FROM usage WHERE session = $1"
_SAVE_USAGE = (
    f"INSERT INTO usage (session, {', '.join(USAGE_COLUMNS)})"
    f" VALUES ({', '.join(f'${n}' for n in range(1, len(USAGE_COLUMNS) + 2))})"
    " ON CONFLICT (session) DO UPDATE SET "
    + ", ".join(f"{column} = excluded.{column}" for column in USAGE_COLUMNS)
)
_RECORDS_UPTO = "SELECT seq, data FROM entries WHERE session = $1 AND seq <= $2 ORDER BY seq"
_FORGET_USAGE = "DELETE FROM usage WHERE session = $1"
_FORGET_ENTRIES = "DELETE FROM entries WHERE session = $1"
_FORGET_KEYS = "DELETE FROM idempotency WHERE target = $1"
_EXPIRE_KEYS = "DELETE FROM idempotency WHERE at < $1"
_SET_FENCE = "UPDATE fences SET fence = $2 WHERE session = $1"
_RAISE_FENCE = (
    "INSERT INTO fences (session, fence) VALUES ($1, $2)"
    " ON CONFLICT (session) DO UPDATE SET fence = GREATEST(fences.fence, EXCLUDED.fence)"
    " RETURNING fence"
)
_READ = "SELECT seq, data FROM entries WHERE session = $1 AND seq > $2 ORDER BY seq LIMIT $3"
_HORIZON = f"SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint * {_RANKS} - 1"
_SINCE = (
    "SELECT session, position, seq, data FROM entries"
    " WHERE session = ANY($1::text[]) AND position > $2 AND position <= $3"
    " ORDER BY position LIMIT $4"
)
_LOOKUP = "SELECT data FROM idempotency WHERE principal = $1 AND key = $2"

_PASSWORD_SETTING = re.compile(r"password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)")
_RACE_ATTEMPTS = 3
"""Tries of an append that lost a race it cannot see under its own lock: another session's
append inserting the same idempotency key at once, or a deadlock between two such appends."""

# The failures of the connection or the server, not of the request: retry the same request.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,  # refused, reset, unreachable
    TimeoutError,  # connect, pool acquire or a statement past call_timeout
    asyncpg.PostgresConnectionError,  # class 08: the connection broke or was refused
    asyncpg.exceptions.OperatorInterventionError,  # class 57: shutting down, not yet up
    asyncpg.exceptions.InsufficientResourcesError,  # class 53: too many connections, disk full
    # A transaction the server ended while its node was stopped (idle past the timeout), and
    # what using that connection afterwards raises: the append may not have landed, retry.
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InternalClientError,
)


_RACES = (asyncpg.UniqueViolationError, asyncpg.exceptions.TransactionRollbackError)
"""What an append that lost a race to another transaction raises (see :func:`_lost_race`)."""

_PASSING_CLASSES = frozenset({"08", "25", "40", "53", "55", "57", "58"})
"""SQLSTATE classes of refusals that pass by themselves, retried as an outage: a connection
exception, an invalid transaction state (``25006``: the database is read-only, as a standby
before its promotion), a rollback (serialization failure, deadlock), insufficient resources
(disk full, too many connections), an object in use (``55P03``: a lock not available), an
operator's intervention (shutting down, a cancelled statement), a system error (I/O). Every
other refusal (``42501`` a missing privilege, ``42P01`` a missing table, ``3D000`` a missing
database, ``28P01`` a wrong password...) needs an operator: :class:`StoreRefused`."""

_MAX_WORDS = 500
"""Characters of the database's own words an error message quotes."""


class PostgresLogStore:
    """A :class:`LogStore` in the PostgreSQL database at ``dsn``, shared by every node that
    names it. Its tables are created when the store opens (on ``async with`` or the first call).

    ``pool_size`` bounds this store's connections; ``call_timeout`` bounds each connect, each
    wait for a pooled connection and each statement. A connection that fails or times out
    raises ``RegistryUnavailable`` (retryable; the cause chained). As with any database, a
    commit cut off mid-way leaves the caller in doubt: the append may have landed, so a retry
    with the same idempotency key answers it, and an unkeyed one may write twice.

    An append takes at most 1024 writes (``ValueError`` past that). A transaction left open
    on the server, by anyone, holds :meth:`horizon` back until it ends.

    Safe to call concurrently from one event loop. :meth:`aclose` is idempotent."""

    def __init__(
        self, *, dsn: str, pool_size: int = 8, call_timeout: timedelta = timedelta(seconds=5)
    ) -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        if call_timeout <= timedelta(0):
            raise ValueError("call_timeout must be positive")
        self.dsn = dsn
        self._where = _without_password(dsn)
        self._pool_size = pool_size
        self._timeout = call_timeout.total_seconds()
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        self._closed = False
        self.condition = StoreCondition()

    async def __aenter__(self) -> PostgresLogStore:
        await self._ready_pool()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def raise_fence(self, session: SessionId, fence: int) -> int:
        async with self._connection() as db:
            raised: int = await db.fetchval(_RAISE_FENCE, session, fence)
            return raised

    async def append(
        self, session: SessionId, writes: Sequence[Write], *, fence: int, unfenced: bool = False
    ) -> list[Written]:
        if len(writes) > _RANKS:
            raise ValueError(f"an append takes at most {_RANKS} writes, not {len(writes)}")
        keys = [w.idempotency[0] for w in writes if w.idempotency is not None]
        attempt = 1
        while True:
            try:
                written = await self._append_once(session, writes, keys, fence, unfenced)
                self.condition.accepted()
                return written
            except _RACES as race:
                # Rolled back whole; the next try sees the other append's keys as known.
                if not _lost_race(race):
                    raise self._refusal(race) from race
                if attempt == _RACE_ATTEMPTS:
                    raise RegistryUnavailable(
                        f"the log store at {self._where}: an append to {session} lost"
                        f" {_RACE_ATTEMPTS} races in a row: {race}"
                    ) from race
                attempt += 1

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int = DEFAULT_PAGE
    ) -> list[Record]:
        async with self._connection() as db:
            rows = await db.fetch(_READ, session, after_seq, limit)
        return [decode_record(row[0], row[1]) for row in rows]

    async def horizon(self) -> int:
        async with self._connection() as db:
            horizon: int = await db.fetchval(_HORIZON)
            return horizon

    async def since(
        self, sessions: Collection[SessionId], *, after: int, upto: int, limit: int = DEFAULT_PAGE
    ) -> list[Logged]:
        async with self._connection() as db:
            rows = await db.fetch(_SINCE, list(sessions), after, upto, limit)
        return [
            Logged(session=SessionId(row[0]), position=row[1], record=decode_record(row[2], row[3]))
            for row in rows
        ]

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        async with self._connection() as db:
            data: bytes | None = await db.fetchval(_LOOKUP, key.principal, key.key)
        return None if data is None else decode_acceptance(data)

    async def last(self, session: SessionId) -> Record | None:
        async with self._connection() as db:
            row = await db.fetchrow(_LAST, session)
        return None if row is None else decode_record(row[0], row[1])

    async def usage(self, session: SessionId) -> KeptUsage | None:
        async with self._connection() as db:
            row = await db.fetchrow(_USAGE, session)
        return None if row is None else usage_of_row(tuple(row))

    async def last_compaction(self, session: SessionId) -> Record | None:
        async with self._connection() as db:
            row = await db.fetchrow(_LAST_COMPACTION, session)
        return None if row is None else decode_record(row[0], row[1])

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        async with self._connection() as db:
            rows = await db.fetch(_PENDING_APPROVALS, sorted(set(sessions)))
        return [(SessionId(row[0]), decode_record(row[1], row[2])) for row in rows]

    async def stranded_approvals(
        self, now: datetime, *, limit: int
    ) -> list[tuple[SessionId, Record, bool]]:
        async with self._connection() as db:
            rows = await db.fetch(_STRANDED_APPROVALS, now, limit)
        return [(SessionId(row[0]), decode_record(row[1], row[2]), row[3]) for row in rows]

    async def delete(self, session: SessionId, fence: int) -> None:
        async with self._connection() as db, db.transaction():
            await db.fetchval(_RAISE_FENCE, session, fence)  # holds the row: appends wait
            await db.execute(_FORGET_ENTRIES, session)
            await db.execute(_FORGET_COMPACTIONS, session)
            await db.execute(_FORGET_APPROVALS, session)
            await db.execute(_FORGET_USAGE, session)
            await db.execute(_FORGET_KEYS, session)

    async def expire_keys(self, before: datetime) -> int:
        async with self._connection() as db:
            status: str = await db.execute(_EXPIRE_KEYS, before)
        return int(status.split()[-1])  # "DELETE <n>"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._opening:
            pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), self._timeout)
            except _UNAVAILABLE:
                pool.terminate()  # the server is gone or stuck: drop the sockets

    async def _append_once(
        self,
        session: SessionId,
        writes: Sequence[Write],
        keys: list[IdempotencyKey],
        fence: int,
        unfenced: bool,
    ) -> list[Written]:
        async with self._connection(racing=True) as db, db.transaction():
            await db.execute(_ENSURE_FENCE, session)
            current: int = await db.fetchval(_LOCK_FENCE, session)
            # Read committed: each statement below sees every transaction committed before it
            # started, so also the append that held the lock we waited for. (One statement
            # that locked and read max(seq) at once would read with its snapshot from before
            # the wait, and miss it.)
            last: int | None = await db.fetchval(_LAST_SEQ, session)
            known = await _known(db, keys)
            waiting = await _waiting(db, session, writes)
            plan = plan_append(
                session,
                writes,
                fence=fence,
                unfenced=unfenced,
                current_fence=current,
                last_seq=last or 0,
                known=known.get,
                waiting=waiting.get,
                now=datetime.now(UTC),
            )
            if plan.records:
                await db.execute(
                    _INSERT_ENTRIES,
                    session,
                    [record.seq for record, _ in plan.records],
                    [encode_entry(r.entry, recorded_at=r.recorded_at) for r, _ in plan.records],
                )
            guarded = [(r, guard) for r, guard in plan.records if guard is not None]
            if guarded:
                await db.execute(
                    _INSERT_KEYS,
                    session,
                    [key.principal for _, (key, _) in guarded],
                    [key.key for _, (key, _) in guarded],
                    [r.recorded_at for r, _ in guarded],
                    [encode_acceptance(acceptance) for _, (_, acceptance) in guarded],
                )
            if plan.compactions:
                await db.execute(_INSERT_COMPACTIONS, session, plan.compactions)
            if plan.requests:
                calls, seqs, expiries = zip(*plan.requests, strict=True)
                await db.execute(_INSERT_REQUESTS, session, list(calls), list(seqs), list(expiries))
            if plan.decided:
                await db.execute(_DECIDE_REQUESTS, session, plan.decided)
            if plan.answered:
                await db.execute(_FORGET_REQUESTS, session, plan.answered)
            if plan.keeps_usage(last or 0):
                row = await db.fetchrow(_USAGE, session) if last else None
                prior = None if row is None else usage_of_row(tuple(row))
                earlier: list[Record] = []
                if prior is None and last:  # a transcript from before usage was kept
                    rows = await db.fetch(_RECORDS_UPTO, session, last)
                    earlier = [decode_record(seq, data) for seq, data in rows]
                kept = kept_usage(plan, prior, last_seq=last or 0, earlier=lambda: earlier)
                if kept is not None:
                    await db.execute(_SAVE_USAGE, session, *usage_row(kept))
            if plan.new_fence is not None:
                await db.execute(_SET_FENCE, session, plan.new_fence)
            return plan.written

    @asynccontextmanager
    async def _connection(
        self, *, racing: bool = False
    ) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
        """A pooled connection. A failure of the connection or the server raises
        ``RegistryUnavailable`` from it, and so does a refusal that passes by itself; any other
        refusal of the database raises :class:`StoreRefused` (see :data:`_PASSING_CLASSES`).
        With ``racing``, a lost race (a unique violation, a rollback) is raised as it is, for
        :meth:`append` to try again."""
        pool = await self._ready_pool()
        try:
            async with pool.acquire(timeout=self._timeout) as db:
                yield db
        except _UNAVAILABLE as failure:
            raise self._unavailable(failure) from failure
        except asyncpg.PostgresError as refused:
            if racing and isinstance(refused, _RACES):
                raise
            raise self._refusal(refused) from refused
        except asyncpg.InterfaceError as failure:
            # Raised when a connection that broke is touched again (rolling back the
            # transaction it was in, say): an outage if it broke, a bug in this module if not.
            broke = _connection_failure(failure)
            if broke is None:
                raise
            raise self._unavailable(broke) from broke

    async def _ready_pool(self) -> asyncpg.Pool:
        """The pool, opened (with the schema) by the first caller; a failed open is tried
        again by the next call."""
        if self._closed:
            raise RegistryUnavailable(f"the log store at {self._where} is closed")
        if self._pool is not None:
            return self._pool
        async with self._opening:
            if self._closed:
                raise RegistryUnavailable(f"the log store at {self._where} is closed")
            if self._pool is None:
                self._pool = await self._open()
            return self._pool

    async def _open(self) -> asyncpg.Pool:
        pool = asyncpg.create_pool(
            self.dsn,
            # No floor: with one, asyncpg keeps a task reconnecting through an outage, logging
            # a warning each time; without, a call that needs a connection makes it.
            min_size=0,
            max_size=self._pool_size,
            timeout=self._timeout,  # to connect
            command_timeout=self._timeout,  # every statement
            # A node stopped (SIGSTOP, a frozen VM) inside an append holds its session's fence
            # row: the server ends such a transaction after half a call timeout, so the
            # session's next activation, waiting on that row for up to a whole one, gets
            # through (and the zombie's commit fails).
            server_settings={
                "idle_in_transaction_session_timeout": str(int(self._timeout * 500)),
            },
        )
        opened = False
        try:
            await pool
            async with pool.acquire(timeout=self._timeout) as db, db.transaction():
                # CREATE TABLE IF NOT EXISTS races itself when two nodes open one new
                # database at once (both pass the check, one fails on the catalog's unique
                # index); a lock held until commit makes them take turns.
                await db.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                for statement in _SCHEMA:
                    await db.execute(statement)
            opened = True
        except _UNAVAILABLE as failure:
            raise self._unavailable(failure) from failure
        except asyncpg.PostgresError as refused:  # a wrong password, no database, no CREATE
            raise self._refusal(refused) from refused
        finally:
            if not opened:
                pool.terminate()
        return pool

    def _unavailable(self, failure: BaseException) -> RegistryUnavailable:
        detail = str(failure) or type(failure).__name__
        unavailable = RegistryUnavailable(f"the log store at {self._where}: {detail[:_MAX_WORDS]}")
        self.condition.refused(unavailable)
        return unavailable

    def _refusal(self, refused: asyncpg.PostgresError) -> RegistryUnavailable | StoreRefused:
        """The typed outcome of the database's refusal: an outage when it passes by itself,
        else :class:`StoreRefused` with the database's words and SQLSTATE."""
        code = str(refused.sqlstate or "")
        words = (str(refused) or type(refused).__name__)[:_MAX_WORDS]
        outcome: RegistryUnavailable | StoreRefused
        if code[:2] in _PASSING_CLASSES:
            outcome = RegistryUnavailable(f"the log store at {self._where}: {words} ({code})")
        else:
            outcome = StoreRefused(
                f"the log store at {self._where} refused: {words} (SQLSTATE {code})",
                metadata={"store": self._where, "code": code},
            )
        self.condition.refused(outcome)
        return outcome


async def _known(
    db: asyncpg.pool.PoolConnectionProxy, keys: Sequence[IdempotencyKey]
) -> dict[IdempotencyKey, tuple[Acceptance, Record]]:
    """The first acceptance under each of ``keys`` recorded before, with its record."""
    if not keys:
        return {}
    rows = await db.fetch(_KNOWN_KEYS, [k.principal for k in keys], [k.key for k in keys])
    accepted = {
        IdempotencyKey(principal=row[0], key=row[1]): decode_acceptance(row[2]) for row in rows
    }
    if not accepted:
        return {}
    records = {
        (row[0], row[1]): decode_record(row[1], row[2])
        for row in await db.fetch(
            _RECORDS_AT,
            [a.target for a in accepted.values()],
            [a.seq for a in accepted.values()],
        )
    }
    return {key: (a, records[(a.target, a.seq)]) for key, a in accepted.items()}


async def _waiting(
    db: asyncpg.pool.PoolConnectionProxy, session: SessionId, writes: Sequence[Write]
) -> dict[str, tuple[ApprovalRequestEntry, bool]]:
    """What the index of approval requests holds for each call that ``writes`` decide (read
    under the session's fence lock: no other append to it runs meanwhile)."""
    calls = [w.entry.call_id for w in writes if isinstance(w.entry, ApprovalDecisionEntry)]
    if not calls:
        return {}
    waiting: dict[str, tuple[ApprovalRequestEntry, bool]] = {}
    for row in await db.fetch(_WAITING, session, calls):
        entry = decode_record(row[1], row[2]).entry
        assert isinstance(entry, ApprovalRequestEntry)
        waiting[row[0]] = (entry, row[3])
    return waiting


def _connection_failure(failure: BaseException) -> BaseException | None:
    """The failure of the connection or the server that ``failure`` was raised during (its
    ``__cause__`` or ``__context__``, at any depth), if any."""
    seen: BaseException | None = failure
    while seen is not None:
        if isinstance(seen, _UNAVAILABLE):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _lost_race(failure: asyncpg.PostgresError) -> bool:
    """A failure that another transaction caused, which a new try gets past: a deadlock or a
    serialization failure, or the same idempotency key inserted by an append to another
    session (under its own fence lock, not ours). A duplicate seq would be a bug: not a race."""
    if isinstance(failure, asyncpg.UniqueViolationError):
        return failure.constraint_name == "idempotency_pkey"
    return True


def _without_password(dsn: str) -> str:
    """``dsn`` fit for an error message: the password left out, in a URL or in
    ``key=value`` form, and a URL's query (which may carry one) too."""
    if "://" not in dsn:
        return _PASSWORD_SETTING.sub("password=...", dsn)
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "(an unparsable DSN)"
    netloc = f"{parts.username}@{host}" if parts.username else host
    if port is not None:
        netloc += f":{port}"
    return urlunsplit(parts._replace(netloc=netloc, query=""))
