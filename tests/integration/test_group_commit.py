"""Group commit on a real etcd: concurrent appends to one session share transactions without
giving up order, fencing, idempotency or durability."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    DeliveryKind,
    HumanPromptEntry,
    NodeId,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
)
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys, LeaseConfig, LeaseKeeper
from dsh_mesh.runtime import Acceptance, IdempotencyKey
from dsh_mesh.testing import EtcdAddress

SESSION = SessionId("s-group")


@pytest.fixture
async def store(etcd: EtcdAddress) -> AsyncIterator[tuple[Etcd, EtcdSessionStore, Activation]]:
    async with Etcd(EtcdConfig(endpoint=etcd.endpoint)) as client:
        lease = LeaseKeeper(client, LeaseConfig())
        await lease.grant()
        keys = Keys(f"/gc-{secrets.token_hex(4)}/".encode())
        sessions = EtcdSessionStore(client, keys, lease=lambda: lease.lease_id)
        await sessions.create_header(
            SessionHeader(
                session_id=SESSION,
                kind=SessionKind.ROOT,
                parent_session=None,
                spec=SessionSpec(preset="p", model="m"),
            )
        )
        activation = Activation(
            session_id=SESSION, activation_id=ActivationId("a-1"), node_id=NodeId("n-1")
        )
        await sessions.try_activate(activation)
        yield client, sessions, activation
        await lease.revoke()


def prompt(n: int) -> HumanPromptEntry:
    return HumanPromptEntry(content=f"prompt {n}")


async def test_concurrent_appends_share_transactions_and_keep_their_order(
    store: tuple[Etcd, EtcdSessionStore, Activation],
) -> None:
    etcd, sessions, activation = store
    before = etcd.txns
    results = await asyncio.gather(
        *(sessions.append(SESSION, prompt(n), writer=activation.activation_id) for n in range(100))
    )
    used = etcd.txns - before
    assert [record.seq for record, _ in results] == list(range(1, 101))  # arrival order
    assert used < 100 // 4, f"{used} transactions for 100 concurrent appends"
    stored = await sessions.read(SESSION)
    assert [r.entry for r in stored] == [prompt(n) for n in range(100)]


async def test_a_known_key_in_a_batch_returns_its_first_acceptance_and_the_rest_go_in(
    store: tuple[Etcd, EtcdSessionStore, Activation],
) -> None:
    _, sessions, activation = store
    key = IdempotencyKey(principal="human:s-group", key="k")
    asked = Acceptance(
        target=SESSION,
        seq=0,
        target_activation=activation.activation_id,
        kind=DeliveryKind.STARTED_TURN,
        fingerprint="f",
    )
    first, _ = await sessions.append(
        SESSION, prompt(0), writer=activation.activation_id, idempotency=(key, asked)
    )
    results = await asyncio.gather(
        sessions.append(SESSION, prompt(1), writer=activation.activation_id),
        sessions.append(
            SESSION, prompt(0), writer=activation.activation_id, idempotency=(key, asked)
        ),
        sessions.append(SESSION, prompt(2), writer=activation.activation_id),
    )
    (one, none1), (retry, known), (two, none2) = results
    assert none1 is None and none2 is None
    assert known is not None and retry.seq == first.seq == 1
    assert (one.seq, two.seq) == (2, 3)
    stored = await sessions.read(SESSION)
    assert [r.entry for r in stored] == [prompt(0), prompt(1), prompt(2)]


async def test_a_fenced_batch_writes_nothing_and_fails_every_caller(
    store: tuple[Etcd, EtcdSessionStore, Activation],
) -> None:
    _, sessions, activation = store
    await sessions.release(activation)
    outcomes = await asyncio.gather(
        *(sessions.append(SESSION, prompt(n), writer=activation.activation_id) for n in range(10)),
        return_exceptions=True,
    )
    assert all(isinstance(o, ActivationFenced) for o in outcomes), outcomes
    assert await sessions.read(SESSION) == []


async def test_appends_arriving_as_a_commit_ends_are_never_stranded(
    store: tuple[Etcd, EtcdSessionStore, Activation],
) -> None:
    # An append that arrives in the step a commit finishes must start a commit of its own;
    # bursts of concurrent appends, spaced by a yield, hit that step many times.
    _, sessions, activation = store
    sent = 0
    for _ in range(150):
        burst = [
            sessions.append(SESSION, prompt(sent + n), writer=activation.activation_id)
            for n in range(8)
        ]
        sent += len(burst)
        await asyncio.wait_for(asyncio.gather(*burst), timeout=10)
        await asyncio.sleep(0)
    stored = await sessions.read(SESSION)
    assert [r.seq for r in stored] == list(range(1, sent + 1))
