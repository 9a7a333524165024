"""A root is created whole on a real etcd and a log store: ``create_header`` writes the root's
task first (to the log store, under its creation keys) and then, in one etcd transaction, the
header with its listing and tree-index keys, so no reader ever sees a root without its task, and
a replay of a creation cut between the two completes it (tests/unit/test_root_creation.py
states the rest; tests/integration/test_registry.py the cut and the replay).

Every test works under a key prefix of its own; its nodes share one SQLite log store file.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationId,
    HumanPromptEntry,
    InvalidArgument,
    NodeId,
    Record,
    SessionExists,
    SessionId,
    TaskEntry,
)
from dsh_mesh.logstore import SqliteLogStore
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys, LeaseConfig, LeaseKeeper
from dsh_mesh.testing import EtcdAddress, FaultyLogStore
from tests.conftest import created_whole, root_header

SESSION = SessionId("s-whole")


@dataclass
class Node:
    """One node's view: its own etcd client, lease, log store connection and store, on the
    test's key prefix and log store file."""

    etcd: Etcd
    keys: Keys
    log: FaultyLogStore
    store: EtcdSessionStore
    lease: LeaseKeeper


async def opened(client: Etcd, keys: Keys, log: SqliteLogStore) -> Node:
    lease = LeaseKeeper(client, LeaseConfig())
    await lease.grant()
    probed = FaultyLogStore(log)
    store = EtcdSessionStore(client, keys, log=probed, lease=lambda: lease.lease_id)
    return Node(client, keys, probed, store, lease)


@pytest.fixture
async def nodes(etcd: EtcdAddress, tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    """Two nodes on one key prefix and one log store file."""
    keys = Keys(f"/root-{secrets.token_hex(4)}/".encode())
    path = tmp_path / "log.sqlite"
    async with (
        Etcd(EtcdConfig(endpoint=etcd.endpoint)) as one,
        Etcd(EtcdConfig(endpoint=etcd.endpoint)) as two,
        SqliteLogStore(path) as log_one,
        SqliteLogStore(path) as log_two,
    ):
        a, b = await opened(one, keys, log_one), await opened(two, keys, log_two)
        yield a, b
        for node in (a, b):
            await node.store.aclose()
            await node.lease.revoke()


async def test_the_etcd_store_creates_a_session_with_its_first_entries(
    nodes: tuple[Node, Node],
) -> None:
    a, _ = nodes
    await created_whole(a.store, SESSION)


async def test_a_roots_task_goes_first_then_its_header_in_one_etcd_transaction(
    nodes: tuple[Node, Node],
) -> None:
    a, b = nodes
    task = TaskEntry(content="Do it.")
    txns, reads = a.etcd.txns, a.etcd.reads
    await a.store.create_header(root_header(SESSION), [task])
    # One read (no header yet, at the revision the task is written under), one transaction
    # (the header and its index keys), and one log-store append (the task).
    assert (a.etcd.txns - txns, a.etcd.reads - reads) == (1, 1)
    assert a.log.faults.calls["append"] == 1
    assert await b.log.read(SESSION) == [Record(seq=1, entry=task)]  # seq 1 is the task
    assert await b.store.read(SESSION) == [Record(seq=1, entry=task)]  # another node sees it
    activation = Activation(
        session_id=SESSION, activation_id=ActivationId("a-1"), node_id=NodeId("n-1")
    )
    await a.store.try_activate(activation)
    txns, reads = a.etcd.txns, a.etcd.reads
    record, _ = await a.store.append(
        SESSION, HumanPromptEntry(content="Next."), writer=activation.activation_id
    )
    assert record.seq == 2
    assert (a.etcd.txns, a.etcd.reads) == (txns, reads)  # the fence is cached: no etcd request


async def test_a_concurrent_creation_of_one_session_fails_whole(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    tasks = {"p-a": TaskEntry(content="From a."), "p-b": TaskEntry(content="From b.")}
    outcomes = await asyncio.gather(
        a.store.create_header(root_header(SESSION, "p-a"), [tasks["p-a"]]),
        b.store.create_header(root_header(SESSION, "p-b"), [tasks["p-b"]]),
        return_exceptions=True,
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["NoneType", "SessionExists"], outcomes
    winner = "p-a" if outcomes[0] is None else "p-b"
    loser = b if winner == "p-a" else a
    header = await loser.store.get_header(SESSION)
    assert header == root_header(SESSION, winner)
    assert await loser.store.read(SESSION) == [Record(seq=1, entry=tasks[winner])]
    # The loser's task never reached the log store: seq 1 is the winner's, and alone.
    assert await a.log.read(SESSION) == [Record(seq=1, entry=tasks[winner])]
    with pytest.raises(SessionExists):  # and again, later: still nothing written
        await loser.store.create_header(root_header(SESSION, "p-c"), [TaskEntry(content="c")])
    assert await a.store.read(SESSION) == [Record(seq=1, entry=tasks[winner])]
    assert await b.log.read(SESSION) == [Record(seq=1, entry=tasks[winner])]


async def test_a_task_too_large_to_store_refuses_the_creation_whole(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    keys = Keys(f"/root-{secrets.token_hex(4)}/".encode())
    async with (
        Etcd(EtcdConfig(endpoint=etcd.endpoint)) as client,
        SqliteLogStore(tmp_path / "log.sqlite") as sqlite,
    ):
        log = FaultyLogStore(sqlite)
        store = EtcdSessionStore(client, keys, log=log, lease=lambda: 0, max_entry_bytes=64)
        txns = client.txns
        with pytest.raises(InvalidArgument):
            await store.create_header(root_header(SESSION), [TaskEntry(content="x" * 64)])
        assert client.txns == txns  # refused before anything was written: not in etcd
        assert log.faults.calls["append"] == 0  # nor in the log store
        assert await client.get(keys.header(SESSION)) is None
        assert await log.read(SESSION) == []
