"""Bytes stored per agent step with a 4 KB tool output, in the log store and in etcd.

For each log store (SQLite, ``LocalCluster``'s default, then PostgreSQL, fsync on) one node
process runs the ``STORAGE`` scenario. Roots are created one after the other, each taking its
steps then stalling, resident: a first one of ``storage_steps[0]`` steps, not counted (the
first rows of each table and index take their first pages), then one of ``storage_steps[0]``
and one of ``storage_steps[1]`` steps. Each step is one model call that calls the scoped tool
``fetch`` (4 KB of incompressible text) and records the assistant step and the tool result, as
a real agent's step does. What is stored is read after the first root, and after each counted
root's last step:

- the log store: SQLite, the pages in use of the file after a WAL checkpoint (``page_count``
  less ``freelist_count``, times ``page_size``); PostgreSQL, ``pg_relation_size`` of the main
  fork of ``entries``, ``idempotency`` and ``fences``, of their TOAST tables and of every
  index of either (free-space and visibility maps, which vacuum writes when it likes, left
  out);
- etcd: the bytes of every key and value under the cluster's prefix, the store's revision
  (one per write) and ``dbSizeInUse`` from the Status call. Each reading waits until the node
  has published its load (the count of its resident agents, a write of its registration) with
  the new root.

Per step: (what the second root added - what the first added) / (its steps - the first's), so
what a session costs once (its header, index keys, activation, task, turn start) cancels out.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
from aetcd import rpc

from bench._cluster import node_processes
from bench._common import POSTGRES, SQLITE, Bed
from bench._report import Figure
from bench.scenarios import STORAGE_STEPS
from dsh_mesh.core import NodeId, SessionId, ToolResultEntry
from dsh_mesh.logstore import open_log_store
from dsh_mesh.registry import Etcd, Keys, NodeInfo
from dsh_mesh.runtime import LogStore
from dsh_mesh.testing import LocalCluster, create_root

NODE = "node-b"
_WAIT = 120.0
_POLL = 0.05
_PG_BYTES = """
WITH tables AS (
    SELECT oid, reltoastrelid FROM pg_class
    WHERE relname IN ('entries', 'idempotency', 'fences') AND relkind = 'r'
), relations AS (
    SELECT oid FROM tables
    UNION SELECT reltoastrelid FROM tables WHERE reltoastrelid <> 0
    UNION SELECT indexrelid FROM pg_index
    WHERE indrelid IN (SELECT oid FROM tables UNION SELECT reltoastrelid FROM tables)
)
SELECT coalesce(sum(pg_relation_size(oid)), 0)::bigint FROM relations
"""


@dataclass(frozen=True)
class Stored:
    """What is stored at one moment."""

    log: int
    """Bytes the log store uses."""
    etcd: int
    """Bytes of the keys and values under the cluster's prefix."""
    revision: int
    etcd_in_use: int
    """etcd's ``dbSizeInUse``: the bytes of its database file in use (all prefixes)."""

    def __sub__(self, other: Stored) -> Stored:
        return Stored(
            log=self.log - other.log,
            etcd=self.etcd - other.etcd,
            revision=self.revision - other.revision,
            etcd_in_use=self.etcd_in_use - other.etcd_in_use,
        )


async def measure_storage(bed: Bed) -> None:
    """Bytes per step in each log store and in etcd."""
    small, large = bed.sizes.storage_steps
    if not {small, large} <= set(STORAGE_STEPS) or small >= large:
        raise ValueError(f"storage_steps {small, large}: two of {STORAGE_STEPS}, smaller first")
    for backend in (SQLITE, POSTGRES):
        url = (
            bed.sqlite_store("storage")
            if backend == SQLITE
            else await bed.postgres_store("storage")
        )
        added = await _two_roots(bed, url, small, large)
        record_storage(bed, backend, small, large, added)


async def _two_roots(bed: Bed, url: str, small: int, large: int) -> dict[int, Stored]:
    """What a root of ``small`` steps, then one of ``large`` steps, added to what is stored."""
    added: dict[int, Stored] = {}
    seconds: dict[str, float] = bed.report.run.setdefault("storage_step_seconds", {})
    with node_processes(bed, "STORAGE", (NODE,), placement="local", log_store=url) as cluster:
        prefix = cluster.settings.key_prefix.encode()
        config = cluster.settings.etcd_config()
        async with (
            Etcd(config) as etcd,
            grpc.aio.insecure_channel(config.endpoint) as channel,
        ):
            log = open_log_store(url)
            try:
                status = rpc.MaintenanceStub(channel)
                # A first root, not counted: the first rows of every table and index take
                # their first pages, which no later session pays for.
                await _agent(cluster, etcd, log, small, resident=1)
                before = await _stored(url, etcd, prefix, status)
                for resident, steps in enumerate((small, large), start=2):
                    started = time.perf_counter()
                    await _agent(cluster, etcd, log, steps, resident=resident)
                    seconds[f"{url.partition(':')[0]} {steps}"] = round(
                        time.perf_counter() - started, 2
                    )
                    after = await _stored(url, etcd, prefix, status)
                    added[steps] = after - before
                    before = after
            finally:
                await log.aclose()
    return added


def record_storage(
    bed: Bed, backend: str, small: int, large: int, added: dict[int, Stored]
) -> None:
    """The figures of what a root of ``small`` steps and one of ``large`` steps ``added``."""
    report = bed.report
    steps = large - small

    def per_step(field: str) -> float:
        difference: int = getattr(added[large], field) - getattr(added[small], field)
        return max(0.0, difference / steps)  # a few bytes of noise below zero read as none

    name = f"storage ({backend} log store), a step with a 4 KB tool output"
    report.add(
        Figure(f"{name}: log-store bytes per step", per_step("log"), "bytes"),
        Figure(f"{name}: etcd bytes per step (keys + values)", per_step("etcd"), "bytes"),
        Figure(f"{name}: etcd writes per step", per_step("revision"), "writes"),
        Figure(f"{name}: etcd dbSizeInUse growth per step", per_step("etcd_in_use"), "bytes"),
    )
    for count in (small, large):
        stored = added[count]
        whole = f"storage ({backend} log store), one agent after {count} steps"
        report.add(
            Figure(f"{whole}: log-store bytes", max(0, stored.log), "bytes"),
            Figure(f"{whole}: etcd bytes (keys + values)", max(0, stored.etcd), "bytes"),
            Figure(f"{whole}: etcd writes", max(0, stored.revision), "writes"),
        )
    curve = report.curve(
        "storage", "bytes stored by one agent, by its steps", "steps (4 KB tool outputs)", "bytes"
    )
    for count in (small, large):
        curve.add(f"{backend} log store", count, max(0, added[count].log))
        curve.add(f"etcd, keys + values ({backend} run)", count, max(0, added[count].etcd))


async def _stored(url: str, etcd: Etcd, prefix: bytes, status: rpc.MaintenanceStub) -> Stored:
    listing = await etcd.get_prefix(prefix)
    etcd_bytes = sum(len(kv.key) + len(kv.value) for kv in listing.kvs)
    state = await status.Status(rpc.StatusRequest(), timeout=10)
    return Stored(
        log=await _log_bytes(url),
        etcd=etcd_bytes,
        revision=int(listing.header.revision),
        etcd_in_use=int(state.dbSizeInUse),
    )


async def _log_bytes(url: str) -> int:
    scheme, _, rest = url.partition(":")
    if scheme == "sqlite":
        return await asyncio.to_thread(_sqlite_bytes, Path(rest))
    connection = await asyncpg.connect(url)
    try:
        size: int = await connection.fetchval(_PG_BYTES)
    finally:
        await connection.close()
    return size


def _sqlite_bytes(path: Path) -> int:
    """The bytes of the file's pages in use, once the WAL is checkpointed into it."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA busy_timeout = 10000")
        busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise RuntimeError(f"{path}: the WAL checkpoint could not complete")
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)
    finally:
        db.close()


async def _agent(
    cluster: LocalCluster, etcd: Etcd, log: LogStore, steps: int, *, resident: int
) -> None:
    """Create a root of preset ``steps-<steps>``; return once it took every step and the node
    published its load with it (``resident`` agents: one write per change of its load, which
    would otherwise land before or after a reading depending on the moment)."""
    root = await create_root(cluster, on=NODE, task="Fetch.", preset=f"steps-{steps}")
    await _all_steps_taken(log, root, steps)
    key = Keys(cluster.settings.key_prefix.encode()).node(NodeId(NODE))
    deadline = time.monotonic() + _WAIT
    while True:
        kv = await etcd.get(key)
        if kv is not None and NodeInfo.decode(kv.value).load == resident:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{NODE} did not publish a load of {resident} within {_WAIT:g} s")
        await asyncio.sleep(_POLL)


async def _all_steps_taken(log: LogStore, root: SessionId, steps: int) -> None:
    """Return once the root's last step's tool result is its last record (it then stalls)."""
    last_call = f"call-{root}-{steps - 1}-0"
    deadline = time.monotonic() + _WAIT
    while True:
        last = await log.last(root)
        if (
            last is not None
            and isinstance(last.entry, ToolResultEntry)
            and last.entry.call_id == last_call
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{root}: {steps} steps not taken within {_WAIT:g} s; last {last}")
        await asyncio.sleep(_POLL)
