"""The registry at etcd's edges, against a real etcd:

- a watch asked to start past any revision etcd can name is refused as ``InvalidArgument`` and
  leaves the client's shared watcher working (it used to wedge every later watch of that
  client); a feed resumed after such a revision is refused the same way, one resumed ahead of
  etcd's current revision waits for it, and one resumed from compacted history is refused;
- concurrent appends under one idempotency key are decided one after the other: one is
  accepted, the same request gets that acceptance back, another request a conflict, and none
  fails as an outage (etcd refuses a transaction that writes one key twice);
- a request etcd refuses as malformed (too large, a key twice) is ``InvalidArgument``, not a
  retryable ``RegistryUnavailable``, while an unreachable or frozen etcd still is.

Every test works under a key prefix of its own; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    DeliveryKind,
    HumanPromptEntry,
    IdempotencyConflict,
    InvalidArgument,
    NodeId,
    Record,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
)
from dsh_mesh.registry import (
    Etcd,
    EtcdConfig,
    EtcdSessionStore,
    FeedEvent,
    Keys,
    LeaseConfig,
    LeaseKeeper,
    RegistryReads,
)
from dsh_mesh.registry import _store as store_module
from dsh_mesh.registry._etcd import MAX_REVISION, put
from dsh_mesh.registry._reads import EVENTS_PER_REVISION, MAX_POSITION
from dsh_mesh.runtime import Acceptance, IdempotencyKey
from dsh_mesh.testing import EtcdAddress, EtcdServer

WAIT = 10.0
"""Upper bound of any wait in this module."""
SESSION = SessionId("s-fixes")
MIB = 1024 * 1024


# -- helpers ------------------------------------------------------------------------------------


@dataclass
class Registry:
    etcd: Etcd
    keys: Keys
    store: EtcdSessionStore
    reads: RegistryReads
    activation: Activation


@pytest.fixture
async def registry(etcd: EtcdAddress) -> AsyncIterator[Registry]:
    async with opened(etcd.endpoint) as made:
        yield made


@asynccontextmanager
async def opened(endpoint: str, **store_options: Any) -> AsyncIterator[Registry]:
    """A client, a lease, a store with one resident root session, and the reads, under a key
    prefix of their own."""
    async with Etcd(EtcdConfig(endpoint=endpoint, call_timeout=timedelta(seconds=3))) as etcd:
        lease = LeaseKeeper(etcd, LeaseConfig())
        await lease.grant()
        try:
            keys = Keys(f"/fix-{secrets.token_hex(4)}/".encode())
            store = EtcdSessionStore(etcd, keys, lease=lambda: lease.lease_id, **store_options)
            await store.create_header(
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
            await store.try_activate(activation)
            yield Registry(etcd, keys, store, RegistryReads(etcd, keys), activation)
        finally:
            with contextlib.suppress(RegistryUnavailable):  # a test may have stopped etcd
                await lease.revoke()


def prompt(text: str) -> HumanPromptEntry:
    return HumanPromptEntry(content=text)


def message(text: str) -> AgentMessageEntry:
    return AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId("s-sender")), content=text
    )


def asked(fingerprint: str) -> Acceptance:
    return Acceptance(
        target=SESSION,
        seq=0,
        target_activation=ActivationId("a-1"),
        kind=DeliveryKind.STEERED,
        fingerprint=fingerprint,
    )


def seq_and_known(outcome: object) -> tuple[Record, Acceptance | None]:
    """An append's outcome that must be a success."""
    assert isinstance(outcome, tuple), outcome
    record, known = outcome
    assert isinstance(record, Record) and (known is None or isinstance(known, Acceptance))
    return record, known


async def closed(events: AsyncIterator[Any]) -> None:
    """Close a watch or a feed (an async generator)."""
    assert isinstance(events, AsyncGenerator)
    await events.aclose()


async def revision_now(etcd: Etcd) -> int:
    return int((await etcd.range(b"/no-such-key")).header.revision)


def after_all_of(revision: int) -> int:
    """The feed position after every event of ``revision``."""
    return revision * EVENTS_PER_REVISION + EVENTS_PER_REVISION - 1


async def first_event(feed: AsyncIterator[FeedEvent]) -> FeedEvent:
    async with asyncio.timeout(WAIT):
        return await anext(feed)


async def drain(events: AsyncIterator[Any]) -> None:
    async with asyncio.timeout(WAIT):
        async for _ in events:
            pass


async def watch_sees_a_put(etcd: Etcd, key: bytes) -> None:
    """A new watch on ``etcd`` (from now) sees a put made after it started."""
    prefix = key.rsplit(b"/", 1)[0] + b"/"
    start = await revision_now(etcd) + 1
    watch = etcd.watch_prefix(prefix, start_revision=start)
    try:
        async with asyncio.timeout(WAIT):
            pending = asyncio.ensure_future(anext(watch))
            await asyncio.sleep(0.2)  # let the watch be created before the put
            await etcd.txn([], [put(key, b"live")])
            event = await pending
        assert event.kv.key == key and event.kv.value == b"live"
    finally:
        await closed(watch)


# -- R1: watches from past any revision ---------------------------------------------------------


@pytest.mark.parametrize("start", [MAX_REVISION + 1, 2**64 - 1, -1])
async def test_a_watch_past_any_revision_is_refused_and_the_client_still_watches(
    registry: Registry, start: int
) -> None:
    etcd, prefix = registry.etcd, registry.keys.prefix + b"w/"
    for _ in range(3):  # it used to wedge the shared watcher: the second attempt hung
        with pytest.raises(InvalidArgument, match="revision"):
            await drain(etcd.watch_prefix(prefix, start_revision=start))
    await watch_sees_a_put(etcd, prefix + b"k")


async def test_a_watch_at_the_last_revision_waits_and_leaves_other_watches_live(
    registry: Registry,
) -> None:
    """2**63 - 1 is a revision etcd can name: far ahead of it, but valid; it waits."""
    etcd, prefix = registry.etcd, registry.keys.prefix + b"w/"
    far = etcd.watch_prefix(prefix, start_revision=MAX_REVISION)
    waiting = asyncio.ensure_future(anext(far))
    try:
        await watch_sees_a_put(etcd, prefix + b"k")
        assert not waiting.done()
    finally:
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await closed(far)


async def test_watches_cancelled_while_being_created_are_dropped_and_leave_the_client_watching(
    registry: Registry,
) -> None:
    """A caller cancelled while its watch is created (a WatchSession whose deadline fires)
    never leaves the shared watcher half-way through a create; the watch, if etcd made it,
    is cancelled rather than left to collect events nobody reads."""
    etcd, prefix = registry.etcd, registry.keys.prefix + b"w/"
    start = await revision_now(etcd) + 1
    for delay in [0.0, 0.0005, 0.001, 0.002, 0.005] * 4:
        watch = etcd.watch_prefix(prefix, start_revision=start)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(anext(watch), delay)
        await closed(watch)
    await watch_sees_a_put(etcd, prefix + b"k")
    watcher = etcd._client._watcher
    async with asyncio.timeout(WAIT):
        while True:  # every watch above is cancelled, sooner or later
            if not watcher._callbacks:
                return
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("after", [MAX_POSITION, MAX_POSITION + 1])
async def test_a_feed_resumed_past_any_revision_is_refused_and_feeds_still_follow(
    registry: Registry, after: int
) -> None:
    reads, store, writer = registry.reads, registry.store, registry.activation.activation_id
    with pytest.raises(InvalidArgument, match="after_event_seq"):
        await first_event(reads.follow(SESSION, tree=False, after_position=after))
    # The same client's feeds (and so its shared watcher) still work: a feed from now sees a
    # record appended after it started.
    start = await revision_now(registry.etcd)
    feed = reads.follow(SESSION, tree=False, after_position=after_all_of(start))
    pending = asyncio.ensure_future(first_event(feed))
    try:
        await asyncio.sleep(0.2)
        record, _ = await store.append(SESSION, prompt("live"), writer=writer)
        event = await pending
        assert event.record == record and event.revision > start
    finally:
        await closed(feed)


async def test_a_feed_resumed_ahead_of_etcd_waits_for_that_revision(registry: Registry) -> None:
    reads, store, writer = registry.reads, registry.store, registry.activation.activation_id
    ahead = await revision_now(registry.etcd) + 2
    feed = reads.follow(SESSION, tree=False, after_position=after_all_of(ahead))
    pending = asyncio.ensure_future(first_event(feed))
    try:
        seqs = [(await store.append(SESSION, prompt(f"p{n}"), writer=writer))[0].seq for n in "abc"]
        event = await pending
        assert event.revision == ahead + 1  # the first two appends were at or before `ahead`
        assert event.record is not None and event.record.seq == seqs[2]
    finally:
        await closed(feed)


async def test_entries_of_one_group_commit_have_their_own_positions_and_a_resume_splits_it(
    registry: Registry,
) -> None:
    """A group commit writes several entries in one etcd revision: each still gets a position
    of its own, and a feed resumed after one of them goes on with the next, not after the
    whole revision (the event_seq of a watch must strictly increase and resume exactly)."""
    reads, store, writer = registry.reads, registry.store, registry.activation.activation_id
    appended = await asyncio.gather(
        *(store.append(SESSION, prompt(f"batched {n}"), writer=writer) for n in range(8))
    )
    seqs = sorted(record.seq for record, _ in appended)
    feed = reads.follow(SESSION, tree=False)
    first: list[FeedEvent] = []
    try:
        while len(first) < len(seqs):
            event = await first_event(feed)
            if event.record is not None:  # not the activation the fixture made
                first.append(event)
    finally:
        await closed(feed)
    assert [e.record.seq for e in first if e.record] == seqs
    positions = [e.position for e in first]
    assert positions == sorted(set(positions)), "positions must strictly increase"
    revisions = [e.revision for e in first]
    shared = next((n for n in range(1, len(first)) if revisions[n] == revisions[n - 1]), None)
    assert shared is not None, f"no two appends shared a commit: revisions {revisions}"
    resumed = reads.follow(SESSION, tree=False, after_position=positions[shared - 1])
    try:
        rest = [await first_event(resumed) for _ in first[shared:]]
    finally:
        await closed(resumed)
    assert [(e.position, e.record) for e in rest] == [
        (e.position, e.record) for e in first[shared:]
    ]


async def test_a_page_reads_only_its_own_entries_from_etcd(registry: Registry) -> None:
    """``GetSession`` reads a long transcript page by page: each page must fetch its own
    entries (and one more, to know that more follow), not the whole rest of the transcript."""
    store, writer = registry.store, registry.activation.activation_id
    for n in range(30):
        await store.append(SESSION, prompt(f"p{n}"), writer=writer)
    fetched: list[int] = []
    original = registry.etcd.range

    async def counting(*args: Any, **kwargs: Any) -> Any:
        response = await original(*args, **kwargs)
        fetched.append(len(response.kvs))
        return response

    registry.etcd.range = counting  # type: ignore[method-assign]
    try:
        first, more = await registry.reads.page(SESSION, after_seq=0, limit=5)
        last, done = await registry.reads.page(SESSION, after_seq=28, limit=5)
    finally:
        registry.etcd.range = original  # type: ignore[method-assign]
    assert [r.seq for r in first] == [1, 2, 3, 4, 5] and more
    assert [r.seq for r in last] == [29, 30] and not done
    assert fetched == [6, 2]


async def test_a_feed_resumed_from_compacted_history_is_refused(etcd_server: EtcdServer) -> None:
    """A private etcd: compaction would disturb other tests' watches."""
    async with opened(etcd_server.address.endpoint) as registry:
        writer = registry.activation.activation_id
        old = await revision_now(registry.etcd)
        for n in range(3):
            await registry.store.append(SESSION, prompt(f"p{n}"), writer=writer)
        await registry.etcd._client.compact(await revision_now(registry.etcd))
        with pytest.raises(InvalidArgument, match="compacted"):
            await first_event(
                registry.reads.follow(SESSION, tree=False, after_position=after_all_of(old))
            )
        await watch_sees_a_put(registry.etcd, registry.keys.prefix + b"w/k")


# -- R2: one idempotency key, concurrent appends ------------------------------------------------


async def test_concurrent_appends_under_one_key_are_decided_one_after_the_other(
    registry: Registry,
) -> None:
    store, writer = registry.store, registry.activation.activation_id
    key = IdempotencyKey(principal="s-sender", key="raced")
    contents = ["race A", "race B"]
    racers = [contents[n % 2] for n in range(8)]
    outcomes = await asyncio.gather(
        *(
            store.append(SESSION, message(c), writer=writer, idempotency=(key, asked(c)))
            for c in racers
        ),
        return_exceptions=True,
    )
    assert not any(isinstance(o, RegistryUnavailable) for o in outcomes), outcomes
    accepted = [(c, o) for c, o in zip(racers, outcomes, strict=True) if isinstance(o, tuple)]
    refused = [(c, o) for c, o in zip(racers, outcomes, strict=True) if isinstance(o, Exception)]
    firsts = [(c, record) for c, (record, known) in accepted if known is None]
    assert len(firsts) == 1, outcomes
    [(winner, first)] = firsts
    assert winner == racers[0]  # arrival order
    for content, (record, known) in accepted:
        assert content == winner and record == first
        assert known is None or known.seq == first.seq
    assert len(accepted) == racers.count(winner)
    assert all(c != winner and isinstance(o, IdempotencyConflict) for c, o in refused), refused
    assert len(refused) == racers.count(contents[1])
    stored = await store.read(SESSION)
    assert [(r.seq, r.entry) for r in stored] == [(first.seq, message(winner))]


async def test_a_repeated_key_splits_the_batch_and_the_other_appends_go_in(
    registry: Registry,
) -> None:
    store, writer = registry.store, registry.activation.activation_id
    key = IdempotencyKey(principal="s-sender", key="k")

    def keyed(text: str) -> Any:
        return store.append(SESSION, message(text), writer=writer, idempotency=(key, asked(text)))

    def plain(text: str) -> Any:
        return store.append(SESSION, prompt(text), writer=writer)

    results = await asyncio.gather(
        plain("a"), keyed("m"), plain("b"), keyed("m"), plain("c"), keyed("other"), plain("d"),
        return_exceptions=True,
    )  # fmt: skip
    other = results.pop(5)
    assert isinstance(other, IdempotencyConflict), results
    a, m1, b, m2, c, d = [seq_and_known(outcome) for outcome in results]
    assert m1[1] is None and m2[1] is not None and m2[0] == m1[0]
    assert [r[0].seq for r in (a, m1, b, c, d)] == [1, 2, 3, 4, 5]  # arrival order
    assert [r.entry for r in await store.read(SESSION)] == [
        prompt("a"), message("m"), prompt("b"), prompt("c"), prompt("d"),
    ]  # fmt: skip


# -- R3: requests etcd refuses are invalid, not an outage ---------------------------------------


async def test_requests_etcd_refuses_as_malformed_are_invalid_arguments(
    registry: Registry,
) -> None:
    etcd, prefix = registry.etcd, registry.keys.prefix
    # Over --max-request-bytes (etcd: INVALID_ARGUMENT) and over its gRPC receive limit
    # (RESOURCE_EXHAUSTED): both are the request's fault, retried unchanged they fail again.
    for size in (int(1.6 * MIB), 2 * MIB, 3 * MIB):
        with pytest.raises(InvalidArgument, match="too large for etcd") as refused:
            await etcd.txn([], [put(prefix + b"big", b"v" * size)])
        assert refused.value.retryable is False
    with pytest.raises(InvalidArgument, match="duplicate key"):
        await etcd.txn([], [put(prefix + b"k", b"1"), put(prefix + b"k", b"2")])
    with pytest.raises(InvalidArgument, match="too many operations"):
        await etcd.txn([], [put(prefix + f"k{n}".encode(), b"1") for n in range(200)])
    with pytest.raises(InvalidArgument, match="revision"):
        await etcd.get_prefix(prefix, revision=MAX_REVISION + 1)
    # A header too big to store (a 2,000,000-character model).
    huge = SessionHeader(
        session_id=SessionId("s-huge"),
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset="p", model="m" * 2_000_000),
    )
    with pytest.raises(InvalidArgument, match="too large for etcd"):
        await registry.store.create_header(huge)
    assert await registry.store.get_header(SessionId("s-huge")) is None


async def test_an_entry_over_etcds_limit_is_invalid_and_a_refused_batch_spares_the_rest(
    etcd: EtcdAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store allowed entries etcd refuses, batching more than etcd takes in one request.
    monkeypatch.setattr(store_module, "_BATCH_BYTES", 8 * MIB)
    async with opened(etcd.endpoint, max_entry_bytes=4 * MIB) as registry:
        store, writer = registry.store, registry.activation.activation_id
        with pytest.raises(InvalidArgument, match="too large for etcd"):
            await store.append(SESSION, prompt("z" * 2 * MIB), writer=writer)
        big = "y" * (MIB - 1024)  # fits alone; two of them do not
        texts = ["a", big, big, "z" * 2 * MIB, "b"]
        results = await asyncio.gather(
            *(store.append(SESSION, prompt(t), writer=writer) for t in texts),
            return_exceptions=True,
        )
        refused = results.pop(3)
        assert isinstance(refused, InvalidArgument), results
        assert [seq_and_known(r)[0].seq for r in results] == [1, 2, 3, 4], results
        assert [r.entry for r in await store.read(SESSION)] == [
            prompt("a"), prompt(big), prompt(big), prompt("b"),
        ]  # fmt: skip


async def test_an_unreachable_or_frozen_etcd_is_still_unavailable(
    etcd_server: EtcdServer,
) -> None:
    config = EtcdConfig(endpoint=etcd_server.address.endpoint, call_timeout=timedelta(seconds=1))
    async with Etcd(config) as etcd:
        await etcd.txn([], [put(b"/u/k", b"1")])
        etcd_server.pause()  # frozen: every call runs into its deadline
        try:
            with pytest.raises(RegistryUnavailable) as timed_out:
                await etcd.txn([], [put(b"/u/k", b"2")])
            assert timed_out.value.retryable is True
        finally:
            etcd_server.resume()
        etcd_server.kill()  # gone: the connection is refused
        with pytest.raises(RegistryUnavailable):
            await etcd.txn([], [put(b"/u/k", b"3")])
        with pytest.raises(RegistryUnavailable):
            await etcd.get(b"/u/k")
