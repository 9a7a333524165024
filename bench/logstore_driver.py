"""Which PostgreSQL driver the log store uses: asyncpg or psycopg 3, measured (ADR 0027).

    python -m bench.logstore_driver [--calls 2000] [--in-flight 16] [--only asyncpg]

Starts a real PostgreSQL (``dsh_mesh.testing.PostgresServer``) with ``fsync`` on, then off, and
times the fenced append's transaction (ADR 0026) through each driver's own pool of
``--in-flight`` connections: ``BEGIN``; create the session's fence row if missing (``INSERT ...
ON CONFLICT DO NOTHING``); lock it (``SELECT fence ... FOR UPDATE``); read the last seq; insert
one 200-byte entry; ``COMMIT``. Each caller appends to a session of its own, so the callers
contend for the pool and the server, not for one row lock.

For each driver it prints p50 and p99 of one transaction at 1 in flight and the transactions
per second at ``--in-flight``. psycopg is timed twice: one round trip per statement, as asyncpg
must, and in pipeline mode (the statements up to the lock and those after the decision each
sent in one round trip), which is how a psycopg backend would send them.

The project pins only the driver it chose, asyncpg; a driver that is not installed is left out
of the table, with a note. psycopg installs with ``pip install 'psycopg[binary,pool]==3.3.9'``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from bench._measure import Load, run_load
from dsh_mesh.testing import PostgresServer

_SCHEMA = (
    "CREATE TABLE fences (session TEXT PRIMARY KEY, fence BIGINT NOT NULL)",
    "CREATE TABLE entries (session TEXT NOT NULL, seq BIGINT NOT NULL, data BYTEA NOT NULL,"
    " PRIMARY KEY (session, seq))",
)
_PAYLOAD = b"x" * 200
_WARMUP = 100
_CLIENT = "client"
"""This process: the driver's CPU time per transaction, which a node pays beside its agents."""

Append = Callable[[str], Awaitable[None]]
"""One fenced append's transaction to the given session."""


@dataclass(frozen=True)
class Row:
    """One driver's figures on one server."""

    driver: str
    fsync: bool
    serial: Load
    loaded: Load


@asynccontextmanager
async def asyncpg_append(dsn: str, size: int) -> AsyncIterator[Append]:
    """The append through an asyncpg pool (prepared statements, one round trip each)."""
    import asyncpg

    pool: Any = await asyncpg.create_pool(dsn, min_size=size, max_size=size)
    try:

        async def append(session: str) -> None:
            async with pool.acquire() as db, db.transaction():
                await db.execute(
                    "INSERT INTO fences VALUES ($1, 0) ON CONFLICT DO NOTHING", session
                )
                await db.fetchval("SELECT fence FROM fences WHERE session = $1 FOR UPDATE", session)
                last = await db.fetchval("SELECT max(seq) FROM entries WHERE session = $1", session)
                await db.execute(
                    "INSERT INTO entries VALUES ($1, $2, $3)", session, (last or 0) + 1, _PAYLOAD
                )

        yield append
    finally:
        await pool.close()


@asynccontextmanager
async def psycopg_append(dsn: str, size: int, *, pipeline: bool) -> AsyncIterator[Append]:
    """The append through a psycopg pool (server-side binding, prepared after 5 uses); with
    ``pipeline``, the statements before the decision go in one round trip, the rest in one."""
    from psycopg_pool import AsyncConnectionPool

    pool = AsyncConnectionPool(dsn, min_size=size, max_size=size, open=False)
    await pool.open(wait=True)
    try:

        async def plain(session: str) -> None:
            async with pool.connection() as db, db.transaction():
                await db.execute(
                    "INSERT INTO fences VALUES (%s, 0) ON CONFLICT DO NOTHING", (session,)
                )
                await db.execute(
                    "SELECT fence FROM fences WHERE session = %s FOR UPDATE", (session,)
                )
                cursor = await db.execute(
                    "SELECT max(seq) FROM entries WHERE session = %s", (session,)
                )
                last = await cursor.fetchone()
                await db.execute(
                    "INSERT INTO entries VALUES (%s, %s, %s)",
                    (session, ((last and last[0]) or 0) + 1, _PAYLOAD),
                )

        async def pipelined(session: str) -> None:
            async with pool.connection() as db, db.pipeline() as pipe, db.transaction():
                await db.execute(
                    "INSERT INTO fences VALUES (%s, 0) ON CONFLICT DO NOTHING", (session,)
                )
                await db.execute(
                    "SELECT fence FROM fences WHERE session = %s FOR UPDATE", (session,)
                )
                cursor = await db.execute(
                    "SELECT max(seq) FROM entries WHERE session = %s", (session,)
                )
                await pipe.sync()
                last = await cursor.fetchone()
                await db.execute(
                    "INSERT INTO entries VALUES (%s, %s, %s)",
                    (session, ((last and last[0]) or 0) + 1, _PAYLOAD),
                )

        yield pipelined if pipeline else plain
    finally:
        await pool.close()


DRIVERS: dict[str, Callable[[str, int], contextlib.AbstractAsyncContextManager[Append]]] = {
    "asyncpg": asyncpg_append,
    "psycopg": lambda dsn, size: psycopg_append(dsn, size, pipeline=False),
    "psycopg pipeline": lambda dsn, size: psycopg_append(dsn, size, pipeline=True),
}
MODULES = {
    "asyncpg": ("asyncpg", "pip install asyncpg==0.32.0"),
    "psycopg": ("psycopg_pool", "pip install 'psycopg[binary,pool]==3.3.9'"),
    "psycopg pipeline": ("psycopg_pool", "pip install 'psycopg[binary,pool]==3.3.9'"),
}
"""The module each driver needs, and how to install it."""


async def measure(dsn: str, driver: str, *, calls: int, in_flight: int) -> tuple[Load, Load]:
    """The driver's p50 at 1 in flight and its throughput at ``in_flight``."""
    async with DRIVERS[driver](dsn, in_flight) as append:
        sessions: dict[int, str] = {}

        async def call(_: int) -> None:
            # One session per caller task: callers contend for connections, not for one lock.
            task = id(asyncio.current_task())
            await append(sessions.setdefault(task, f"{driver}-{len(sessions)}"))

        watch = {_CLIENT: None}
        serial = await run_load(call, calls=calls, in_flight=1, warmup=_WARMUP, watch=watch)
        loaded = await run_load(call, calls=calls * 2, in_flight=in_flight, watch=watch)
    return serial, loaded


def prepare(server: PostgresServer, name: str) -> str:
    """A fresh database with the benchmark's tables; returns its DSN."""
    dsn = server.create_database(name)
    for statement in _SCHEMA:
        server.execute(statement, database=name)
    return dsn


async def run(drivers: list[str], *, calls: int, in_flight: int) -> list[Row]:
    """Every driver of ``drivers`` on a durable server, then on one with ``fsync`` off."""
    rows: list[Row] = []
    for fsync in (True, False):
        with PostgresServer(fsync=fsync) as server:
            for index, driver in enumerate(drivers):
                dsn = await asyncio.to_thread(prepare, server, f"bench_{index}")
                serial, loaded = await measure(dsn, driver, calls=calls, in_flight=in_flight)
                rows.append(Row(driver=driver, fsync=fsync, serial=serial, loaded=loaded))
    return rows


def render(rows: list[Row], in_flight: int) -> str:
    """The figures as a table."""
    header = (
        f"{'driver':<18} {'fsync':<6} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'tx/s @1':>9} {f'tx/s @{in_flight}':>10} {f'p50 ms @{in_flight}':>11}"
        f" {f'cpu ms/tx @{in_flight}':>14}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.driver:<18} {'on' if row.fsync else 'off':<6} {row.serial.p50:>8.3f} "
            f"{row.serial.p99:>8.3f} {row.serial.throughput:>9.0f} "
            f"{row.loaded.throughput:>10.0f} {row.loaded.p50:>11.3f}"
            f" {row.loaded.cpu_ms[_CLIENT]:>14.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print its table."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.logstore_driver", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--calls", type=int, default=2000, help="timed appends at 1 in flight")
    parser.add_argument("--in-flight", type=int, default=16, help="the loaded level (pool size)")
    parser.add_argument("--only", action="append", choices=sorted(DRIVERS), help="repeatable")
    args = parser.parse_args(argv)
    drivers = []
    for driver in args.only or list(DRIVERS):
        module, install = MODULES[driver]
        if importlib.util.find_spec(module) is None:
            print(f"{driver}: not installed, left out ({install})", file=sys.stderr)
        else:
            drivers.append(driver)
    if not drivers:
        return 2
    rows = asyncio.run(run(drivers, calls=args.calls, in_flight=args.in_flight))
    print(render(rows, args.in_flight))
    return 0


if __name__ == "__main__":
    sys.exit(main())
