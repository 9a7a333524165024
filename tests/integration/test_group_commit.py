"""Group commit on a real etcd and a SQLite log store: concurrent appends to one session share
log-store transactions without giving up order, fencing, idempotency or durability, and a
fenced append costs no etcd request at all once its activation's fence is cached."""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsh_mesh.core import (
    EXPIRED_APPROVAL_REASON,
    Activation,
    ActivationFenced,
    ActivationId,
    ApprovalRequestEntry,
    ApprovalStale,
    DeliveryKind,
    HumanPromptEntry,
    IdempotencyConflict,
    NodeId,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    mesh_denial,
)
from dsh_mesh.logstore import SqliteLogStore
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys, LeaseConfig, LeaseKeeper
from dsh_mesh.registry._group_commit import BATCH_ENTRIES
from dsh_mesh.runtime import Acceptance, IdempotencyKey
from dsh_mesh.testing import EtcdAddress, FaultyLogStore

SESSION = SessionId("s-group")


@dataclass
class Bed:
    """One node's store with its session activated, over a probed SQLite log store."""

    etcd: Etcd
    keys: Keys
    log_path: Path
    log: FaultyLogStore
    sessions: EtcdSessionStore
    activation: Activation


@pytest.fixture
async def bed(etcd: EtcdAddress, tmp_path: Path) -> AsyncIterator[Bed]:
    log_path = tmp_path / "log.sqlite"
    async with Etcd(EtcdConfig(endpoint=etcd.endpoint)) as client, SqliteLogStore(log_path) as db:
        lease = LeaseKeeper(client, LeaseConfig())
        await lease.grant()
        keys = Keys(f"/gc-{secrets.token_hex(4)}/".encode())
        log = FaultyLogStore(db)
        sessions = EtcdSessionStore(client, keys, log=log, lease=lambda: lease.lease_id)
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
        yield Bed(client, keys, log_path, log, sessions, activation)
        await sessions.aclose()
        await lease.revoke()


def prompt(n: int) -> HumanPromptEntry:
    return HumanPromptEntry(content=f"prompt {n}")


async def test_concurrent_appends_share_transactions_and_keep_their_order(bed: Bed) -> None:
    sessions, activation = bed.sessions, bed.activation
    requests, appends = (bed.etcd.txns, bed.etcd.reads), bed.log.faults.calls["append"]
    results = await asyncio.gather(
        *(sessions.append(SESSION, prompt(n), writer=activation.activation_id) for n in range(100))
    )
    used = bed.log.faults.calls["append"] - appends
    assert [record.seq for record, _ in results] == list(range(1, 101))  # arrival order
    # All 100 wait while the first commit starts: full batches, one log transaction each.
    assert used == math.ceil(100 / BATCH_ENTRIES), f"{used} transactions for 100 appends"
    # The activation's fence is cached since its win: not one etcd request for 100 appends.
    assert (bed.etcd.txns, bed.etcd.reads) == requests
    stored = await sessions.read(SESSION)
    assert [r.entry for r in stored] == [prompt(n) for n in range(100)]


async def test_a_known_key_in_a_batch_returns_its_first_acceptance_and_the_rest_go_in(
    bed: Bed,
) -> None:
    sessions, activation = bed.sessions, bed.activation
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


async def test_a_retry_whose_key_was_used_for_another_request_is_refused_alone(
    bed: Bed,
) -> None:
    """A batch holding a retried key with a conflicting request is refused whole by the log
    store; it is then committed one by one, so only that append fails and the others go in,
    in order."""
    sessions, writer = bed.sessions, bed.activation.activation_id
    key = IdempotencyKey(principal="human:s-group", key="k")

    def asked(fingerprint: str) -> Acceptance:
        return Acceptance(
            target=SESSION,
            seq=0,
            target_activation=writer,
            kind=DeliveryKind.STARTED_TURN,
            fingerprint=fingerprint,
        )

    await sessions.append(SESSION, prompt(0), writer=writer, idempotency=(key, asked("f")))
    appends = bed.log.faults.calls["append"]
    one, conflicting, two = await asyncio.gather(
        sessions.append(SESSION, prompt(1), writer=writer),
        sessions.append(SESSION, prompt(9), writer=writer, idempotency=(key, asked("other"))),
        sessions.append(SESSION, prompt(2), writer=writer),
        return_exceptions=True,
    )
    assert isinstance(conflicting, IdempotencyConflict), conflicting
    assert not isinstance(one, BaseException) and not isinstance(two, BaseException)
    assert (one[0].seq, two[0].seq) == (2, 3)
    assert bed.log.faults.calls["append"] == appends + 1 + 3  # the batch, then each on its own
    stored = await sessions.read(SESSION)
    assert [r.entry for r in stored] == [prompt(0), prompt(1), prompt(2)]


async def test_a_second_decision_on_a_request_is_refused_alone(bed: Bed) -> None:
    """The log store refuses a batch holding a decision on a request decided already
    (docs/approvals.md, "decided once"); it is then committed one by one, so only that
    decision is refused and the appends around it go in, in order."""
    sessions, writer = bed.sessions, bed.activation.activation_id
    request = ApprovalRequestEntry(
        call_id="c-1", step_seq=1, tool="deploy", arguments_json="{}", descriptor_digest="d"
    )
    first = mesh_denial(request, "the turn was cancelled")
    await sessions.append(SESSION, request, writer=writer)
    await sessions.append(SESSION, first, writer=writer)
    appends = bed.log.faults.calls["append"]
    one, second, two = await asyncio.gather(
        sessions.append(SESSION, prompt(1), writer=writer),
        sessions.append(SESSION, mesh_denial(request, EXPIRED_APPROVAL_REASON), writer=writer),
        sessions.append(SESSION, prompt(2), writer=writer),
        return_exceptions=True,
    )
    assert isinstance(second, ApprovalStale), second
    assert not isinstance(one, BaseException) and not isinstance(two, BaseException)
    assert (one[0].seq, two[0].seq) == (3, 4)
    assert bed.log.faults.calls["append"] == appends + 1 + 3  # the batch, then each on its own
    stored = await sessions.read(SESSION)
    assert [r.entry for r in stored] == [request, first, prompt(1), prompt(2)]


async def test_a_fenced_batch_writes_nothing_and_fails_every_caller(bed: Bed) -> None:
    sessions, activation = bed.sessions, bed.activation
    await sessions.release(activation)
    appends = bed.log.faults.calls["append"]
    outcomes = await asyncio.gather(
        *(sessions.append(SESSION, prompt(n), writer=activation.activation_id) for n in range(10)),
        return_exceptions=True,
    )
    assert all(isinstance(o, ActivationFenced) for o in outcomes), outcomes
    assert bed.log.faults.calls["append"] == appends  # refused in etcd: the key is gone
    assert await sessions.read(SESSION) == []


async def test_a_batch_of_a_zombie_is_refused_whole_by_the_log_store(bed: Bed) -> None:
    """The store never learns its activation ended (its lease was revoked and another node won
    the session, raising the fence): its cached fence takes its batch to the log store, which
    refuses all of it in one transaction."""
    sessions, activation = bed.sessions, bed.activation
    await sessions.append(SESSION, prompt(0), writer=activation.activation_id)
    async with SqliteLogStore(bed.log_path) as other_log:
        other_lease = await bed.etcd.grant(LeaseConfig().ttl)
        successor = EtcdSessionStore(bed.etcd, bed.keys, log=other_log, lease=lambda: other_lease)
        [kv] = (await bed.etcd.get_prefix(bed.keys.activations)).kvs
        await bed.etcd.revoke(kv.lease)
        new = Activation(
            session_id=SESSION, activation_id=ActivationId("a-2"), node_id=NodeId("n-2")
        )
        assert (await successor.try_resume(new)).current == new

        requests, appends = (bed.etcd.txns, bed.etcd.reads), bed.log.faults.calls["append"]
        outcomes = await asyncio.gather(
            *(
                sessions.append(SESSION, prompt(n), writer=activation.activation_id)
                for n in range(1, 11)
            ),
            return_exceptions=True,
        )
        assert all(isinstance(o, ActivationFenced) for o in outcomes), outcomes
        assert bed.log.faults.calls["append"] == appends + 1
        assert (bed.etcd.txns, bed.etcd.reads) == requests
        assert [r.entry for r in await successor.read(SESSION)] == [prompt(0)]
        await successor.aclose()
        await bed.etcd.revoke(other_lease)


async def test_appends_arriving_as_a_commit_ends_are_never_stranded(bed: Bed) -> None:
    # An append that arrives in the step a commit finishes must start a commit of its own;
    # bursts of concurrent appends, spaced by a yield, hit that step many times.
    sessions, activation = bed.sessions, bed.activation
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
