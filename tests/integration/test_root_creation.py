"""A root is created whole on a real etcd: ``create_header`` writes the header, the transcript
head and the root's task in one transaction, so a node that dies mid-creation can no longer
leave a root without its task (tests/unit/test_root_creation.py states the rest).

Every test works under a key prefix of its own.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

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
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys, LeaseConfig, LeaseKeeper
from dsh_mesh.testing import EtcdAddress
from tests.unit.test_root_creation import created_whole, root_header

SESSION = SessionId("s-whole")


@dataclass
class Node:
    """One node's view: its own etcd client, lease and store, on the test's key prefix."""

    etcd: Etcd
    keys: Keys
    store: EtcdSessionStore
    lease: LeaseKeeper


async def opened(client: Etcd, keys: Keys) -> Node:
    lease = LeaseKeeper(client, LeaseConfig())
    await lease.grant()
    store = EtcdSessionStore(client, keys, lease=lambda: lease.lease_id)
    return Node(client, keys, store, lease)


@pytest.fixture
async def nodes(etcd: EtcdAddress) -> AsyncIterator[tuple[Node, Node]]:
    """Two nodes on one key prefix."""
    keys = Keys(f"/root-{secrets.token_hex(4)}/".encode())
    async with (
        Etcd(EtcdConfig(endpoint=etcd.endpoint)) as one,
        Etcd(EtcdConfig(endpoint=etcd.endpoint)) as two,
    ):
        a, b = await opened(one, keys), await opened(two, keys)
        yield a, b
        for node in (a, b):
            await node.lease.revoke()


async def test_the_etcd_store_creates_a_session_with_its_first_entries(
    nodes: tuple[Node, Node],
) -> None:
    a, _ = nodes
    await created_whole(a.store, SESSION)


async def test_a_root_and_its_task_are_one_transaction(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    task = TaskEntry(content="Do it.")
    before = a.etcd.txns
    await a.store.create_header(root_header(SESSION), [task])
    assert a.etcd.txns - before == 1
    head = await a.etcd.get(a.keys.head(SESSION))
    assert head is not None and head.value == b"1"
    assert await b.store.read(SESSION) == [Record(seq=1, entry=task)]  # another node sees it
    activation = Activation(
        session_id=SESSION, activation_id=ActivationId("a-1"), node_id=NodeId("n-1")
    )
    await a.store.try_activate(activation)
    before = a.etcd.txns
    record, _ = await a.store.append(
        SESSION, HumanPromptEntry(content="Next."), writer=activation.activation_id
    )
    assert record.seq == 2
    assert a.etcd.txns - before == 1  # the cached head was right: no retry on a stale one


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
    head = await a.etcd.get(a.keys.head(SESSION))
    assert head is not None and head.value == b"1"
    with pytest.raises(SessionExists):  # and again, later: still nothing written
        await loser.store.create_header(root_header(SESSION, "p-c"), [TaskEntry(content="c")])
    assert await a.store.read(SESSION) == [Record(seq=1, entry=tasks[winner])]


async def test_a_task_too_large_to_store_refuses_the_creation_whole(etcd: EtcdAddress) -> None:
    keys = Keys(f"/root-{secrets.token_hex(4)}/".encode())
    async with Etcd(EtcdConfig(endpoint=etcd.endpoint)) as client:
        store = EtcdSessionStore(client, keys, lease=lambda: 0, max_entry_bytes=64)
        before = client.txns
        with pytest.raises(InvalidArgument):
            await store.create_header(root_header(SESSION), [TaskEntry(content="x" * 64)])
        assert client.txns == before  # refused before anything was sent
        assert await client.get(keys.header(SESSION)) is None
