"""A log store that refuses never ends a node (issue 30, point 2): two node processes on a real
PostgreSQL, under traffic, while the nodes' database user loses its INSERT privilege and gets it
back, then while the database is read-only (as a standby before its promotion) and writable
again. Clients get a typed refusal (``STORE_REFUSED`` with the database's SQLSTATE, or the
retryable ``REGISTRY_UNAVAILABLE``), never ``UNKNOWN``; the agent caught mid-turn waits at its
step boundary and finishes by itself; every acknowledged prompt is answered once; no node is
restarted. The same for SQLite: its files made immutable (read-only even for root), and its
file system full."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2, mesh_pb2_grpc
from dsh_mesh.client import HealthStatus, MeshClient
from dsh_mesh.core import (
    AssistantStepEntry,
    HumanPromptEntry,
    MeshError,
    Record,
    RegistryUnavailable,
    SessionId,
    StoreRefused,
    TaskEntry,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.logstore import PostgresLogStore, SqliteLogStore
from dsh_mesh.runtime import Write
from dsh_mesh.testing import (
    EtcdAddress,
    LocalCluster,
    MeshReader,
    PatientReader,
    PostgresServer,
    calls_without_one_answer,
    create_root,
)
from dsh_mesh.transport import error_from_rpc
from tests.integration.scenarios import PATIENT_PRESETS

_PATIENCE = 60.0


@pytest.fixture
def refusing(etcd: EtcdAddress, postgres: PostgresServer, tmp_path: Path) -> Iterator[Refusals]:
    suffix = secrets.token_hex(4)
    database, role = f"refuse_{suffix}", f"mesh_{suffix}"
    postgres.execute(f"CREATE ROLE {role} LOGIN")
    postgres.create_database(database)
    postgres.execute(f"ALTER DATABASE {database} OWNER TO {role}")  # it creates the tables
    dsn = postgres.dsn_for(database).replace(f"//{postgres.user}@", f"//{role}@")
    presets = tmp_path / "presets.toml"
    presets.write_text(PATIENT_PRESETS)
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:PATIENT",
        presets_file=presets,
        nodes=("node-a", "node-b"),
        placement="local",
        log_store=dsn,
    ) as cluster:
        yield Refusals(cluster, postgres, database, role)


class Refusals:
    """The cluster, and the database's levers."""

    def __init__(
        self, cluster: LocalCluster, postgres: PostgresServer, database: str, role: str
    ) -> None:
        self.cluster, self.postgres, self.database, self.role = cluster, postgres, database, role

    def sql(self, statement: str) -> None:
        self.postgres.execute(statement, database=self.database)

    def read_only(self, on: bool) -> None:
        """Make the database read-only (or writable again) for new connections. Said from
        another database: a session in this one is read-only too."""
        setting = "SET default_transaction_read_only = on" if on else "RESET ALL"
        self.postgres.execute(f"ALTER DATABASE {self.database} {setting}")

    def reconnect_all(self) -> None:
        """End the nodes' connections: a database setting holds for new ones only."""
        self.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            f" WHERE datname = '{self.database}' AND usename = '{self.role}'"
        )


async def test_a_revoked_privilege_and_a_read_only_database_leave_every_node_serving(
    refusing: Refusals,
) -> None:
    cluster = refusing.cluster
    pids = {node.node_id: node.pid for node in cluster}
    acknowledged: list[str] = []
    # Patient: ending the nodes' connections ends the reader's too (the same database user).
    async with PatientReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Begin.", preset="patient")
        await _until_turns_ended(reader, root, 1)

        # 1. REVOKE INSERT while a turn is in its tool call, then GRANT it back.
        acknowledged.append(await _accepted(cluster, "node-a", root, "before-revoke"))
        await _until_calls(reader, root, 2)  # the second turn's pause is running
        refusing.sql(f"REVOKE INSERT ON entries FROM {refusing.role}")
        for node in ("node-a", "node-b"):
            refused = await _refusal(cluster, node, root, f"during-revoke-{node}")
            assert isinstance(refused, StoreRefused), refused
            assert refused.metadata["code"] == "42501", refused.metadata  # insufficient privilege
            assert "permission denied" in refused.detail
        # The root's node (node-b forwards to it) says why its log store is degraded: its
        # agent waits at its step boundary, writing again and again.
        degraded = await _log_store_health(cluster, "node-a")
        assert degraded is not None and degraded.startswith("STORE_REFUSED: "), degraded
        assert "permission denied for table entries" in degraded
        assert all(node.running for node in cluster)
        refusing.sql(f"GRANT INSERT ON entries TO {refusing.role}")
        for node in ("node-a", "node-b"):
            acknowledged.append(await _accepted(cluster, node, root, f"during-revoke-{node}"))

        # 2. The database read-only (a fail-over to a standby), then writable again.
        acknowledged.append(await _accepted(cluster, "node-b", root, "before-read-only"))
        await _until_calls(reader, root, 2 + 3)
        refusing.read_only(True)
        refusing.reconnect_all()
        for node in ("node-a", "node-b"):
            refused = await _refusal(cluster, node, root, f"during-read-only-{node}")
            assert isinstance(refused, RegistryUnavailable), refused  # retryable
            assert refused.reason.value == "REGISTRY_UNAVAILABLE"
        assert all(node.running for node in cluster)
        refusing.read_only(False)
        refusing.reconnect_all()
        for node in ("node-a", "node-b"):
            acknowledged.append(await _accepted(cluster, node, root, f"during-read-only-{node}"))

        records = await _until_turns_ended(reader, root, 1 + len(acknowledged))
    prompts = [r.entry.idempotency_key for r in records if isinstance(r.entry, HumanPromptEntry)]
    assert sorted(prompts) == sorted(acknowledged)  # each once: none lost, none twice
    ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended == [TurnOutcome.COMPLETED] * (1 + len(acknowledged))
    assert calls_without_one_answer(records) == []
    assert {node.node_id: node.pid for node in cluster} == pids  # nobody restarted a node
    assert all(node.running for node in cluster)


@contextlib.contextmanager
def _one_node(etcd: EtcdAddress, tmp_path: Path, store: Path) -> Iterator[LocalCluster]:
    """One node of the PATIENT scenario on the SQLite file ``store``."""
    presets = tmp_path / "presets.toml"
    presets.write_text(PATIENT_PRESETS)
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:PATIENT",
        presets_file=presets,
        nodes=("node-a",),
        log_store=f"sqlite:{store}",
    ) as cluster:
        yield cluster


@pytest.fixture
def sqlite_on_tmpfs(etcd: EtcdAddress, tmp_path: Path) -> Iterator[tuple[LocalCluster, Path]]:
    """One node on a SQLite file in a file system of 8 MiB of its own, unmounted after."""
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    try:
        with _one_node(etcd, tmp_path, mount / "log.db") as cluster:
            yield cluster, mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


@pytest.fixture
def sqlite_on_disk(etcd: EtcdAddress, tmp_path: Path) -> Iterator[tuple[LocalCluster, Path]]:
    """One node on a SQLite file in the test's directory (made writable again after)."""
    store = tmp_path / "store"
    store.mkdir()
    try:
        with _one_node(etcd, tmp_path, store / "log.db") as cluster:
            yield cluster, store
    finally:
        _immutable(store, False)


def _immutable(directory: Path, on: bool) -> None:
    """``chattr +i`` (or ``-i``) on every file of ``directory``: no process may write them,
    root's included (a mode of 0444 stops no root)."""
    files = [str(path) for path in directory.iterdir()]
    if files:
        subprocess.run(["chattr", "+i" if on else "-i", *files], check=True)


async def test_a_sqlite_file_made_read_only_then_writable_leaves_its_node_serving(
    sqlite_on_disk: tuple[LocalCluster, Path],
) -> None:
    cluster, store = sqlite_on_disk
    pid = cluster["node-a"].pid
    async with PatientReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Begin.", preset="patient")
        await _until_turns_ended(reader, root, 1)
        _immutable(store, True)
        try:
            refused = await _refusal(cluster, "node-a", root, "read-only")
            assert isinstance(refused, RegistryUnavailable), refused
            assert cluster["node-a"].running
        finally:
            _immutable(store, False)
        await _accepted(cluster, "node-a", root, "read-only")
        records = await _until_turns_ended(reader, root, 2)
    assert [r.entry.idempotency_key for r in records if isinstance(r.entry, HumanPromptEntry)] == [
        "read-only"
    ]
    assert cluster["node-a"].pid == pid


async def test_a_full_disk_under_sqlite_leaves_its_node_serving(
    sqlite_on_tmpfs: tuple[LocalCluster, Path],
) -> None:
    cluster, mount = sqlite_on_tmpfs
    pid = cluster["node-a"].pid
    async with PatientReader(cluster.settings) as reader:
        root = await create_root(cluster, on="node-a", task="Begin.", preset="patient")
        await _until_turns_ended(reader, root, 1)
        filler = mount / "filler"
        _fill(filler)
        try:
            refused = await _refusal(cluster, "node-a", root, "on-a-full-disk")
            assert isinstance(refused, RegistryUnavailable), refused
            assert "full" in refused.detail
            assert cluster["node-a"].running
        finally:
            filler.unlink()
        await _accepted(cluster, "node-a", root, "on-a-full-disk")
        await _until_turns_ended(reader, root, 2)
    assert cluster["node-a"].pid == pid
    assert shutil.disk_usage(mount).free > 0


def _fill(path: Path) -> None:
    """Write ``path`` until its file system has no space left."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(descriptor, b"\0" * 65536)
    except OSError as full:
        if full.errno != errno.ENOSPC:
            raise
    finally:
        os.close(descriptor)


async def _log_store_health(cluster: LocalCluster, node: str) -> str | None:
    """Why ``node`` says its log store is degraded (None: it accepts)."""
    address = cluster[node].address
    assert address is not None
    async with MeshClient(address, token=cluster.settings.cluster_token) as client:
        health = await client.log_store_health()
    assert (health.status is HealthStatus.SERVING) == (health.degraded is None)
    return health.degraded


async def _submit(cluster: LocalCluster, node: str, session: str, key: str) -> None:
    async with cluster.channel(node) as channel:
        stub = mesh_pb2_grpc.MeshControlStub(channel)
        try:
            await stub.SubmitPrompt(
                mesh_pb2.SubmitPromptRequest(
                    session_id=session, text=f"Prompt {key}.", idempotency_key=key
                ),
                metadata=cluster.metadata("a-human"),
                timeout=20,
            )
        except grpc.aio.AioRpcError as failure:
            if failure.code() is grpc.StatusCode.UNKNOWN:
                pytest.fail(f"{node} answered UNKNOWN: {failure.details()}")
            raise error_from_rpc(failure) from failure


async def _refusal(cluster: LocalCluster, node: str, session: str, key: str) -> MeshError:
    """The typed refusal ``node`` answers a prompt with now."""
    with pytest.raises(MeshError) as refused:
        await _submit(cluster, node, session, key)
    return refused.value


async def _accepted(cluster: LocalCluster, node: str, session: str, key: str) -> str:
    """Submit the prompt ``key`` until ``node`` acknowledges it (the same key: one prompt)."""
    deadline = time.monotonic() + _PATIENCE
    while True:
        try:
            await _submit(cluster, node, session, key)
            return key
        except (RegistryUnavailable, StoreRefused):
            # The database was just mended: the node's pooled connections may still meet
            # the old state once. A typed refusal either way; try again.
            if time.monotonic() > deadline:
                raise


async def _until_turns_ended(reader: MeshReader, session: SessionId, count: int) -> list[Record]:
    return await reader.wait_for(
        lambda: reader.transcript(session),
        lambda rs: sum(isinstance(r.entry, TurnEndedEntry) for r in rs) >= count,
        what=f"{count} turns ended",
        within=_PATIENCE,
    )


async def _until_calls(reader: MeshReader, session: SessionId, count: int) -> list[Record]:
    return await reader.wait_for(
        lambda: reader.transcript(session),
        lambda rs: (
            sum(isinstance(r.entry, AssistantStepEntry) and bool(r.entry.tool_calls) for r in rs)
            >= count
        ),
        what=f"{count} tool calls made",
        within=_PATIENCE,
    )


async def test_a_missing_table_is_store_refused_with_the_databases_words_on_both_backends(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """A refusal an operator must mend is not dressed as an outage to retry: before, SQLite's
    ``no such table`` was REGISTRY_UNAVAILABLE and PostgreSQL's ``UndefinedTableError`` reached
    the caller raw."""
    database = f"missing_{secrets.token_hex(4)}"
    dsn = postgres.create_database(database)
    async with PostgresLogStore(dsn=dsn) as store:
        await store.raise_fence(SessionId("s-1"), 1)
        await store.append(SessionId("s-1"), [Write(entry=TaskEntry(content="one"))], fence=1)
        postgres.execute("DROP TABLE entries", database=database)
        with pytest.raises(StoreRefused) as refused:
            await store.read(SessionId("s-1"))
    assert refused.value.metadata["code"] == "42P01"  # undefined_table
    assert 'relation "entries" does not exist' in refused.value.detail
    path = tmp_path / "log.db"
    async with SqliteLogStore(path) as lite:
        await lite.raise_fence(SessionId("s-1"), 1)
        await lite.append(SessionId("s-1"), [Write(entry=TaskEntry(content="one"))], fence=1)
        with sqlite3.connect(path) as db:
            db.execute("DROP TABLE entries")
        with pytest.raises(StoreRefused) as refused:
            await lite.read(SessionId("s-1"))
    assert refused.value.metadata["code"] == "SQLITE_ERROR"
    assert "no such table: entries" in refused.value.detail
