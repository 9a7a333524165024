"""The registry at etcd's edges, against a real etcd:

- a watch asked to start past any revision etcd can name is refused as ``InvalidArgument`` and
  leaves the client's shared watcher working (it used to wedge every later watch of that
  client);
- a feed (``WatchSession``) follows log-store positions, not etcd revisions: one resumed after
  any position a signed 64-bit integer can name is refused, one resumed at the last of them or
  ahead of the log store waits for records above it, the records of one group commit each have
  a position of their own, and residency lost to an etcd compaction while the activation watch
  was down is recovered from a fresh snapshot (transcript records are never compacted away);
- a transcript page reads only its own records (and one more) from the log store, none from etcd;
- concurrent appends under one idempotency key are decided one after the other: one is
  accepted, the same request gets that acceptance back, another request a conflict, and none
  fails as an outage (etcd refuses a transaction that writes one key twice);
- a request etcd refuses as malformed (too large, a key twice) is ``InvalidArgument``, not a
  retryable ``RegistryUnavailable``, while an unreachable or frozen etcd still is; an entry over
  the store's own limit is refused alone, before anything is written.

Every test works under a key prefix of its own; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    DeliveryKind,
    Entry,
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
from dsh_mesh.logstore import MemoryLogStore
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
from dsh_mesh.registry._etcd import MAX_REVISION, put
from dsh_mesh.registry._group_commit import BATCH_BYTES
from dsh_mesh.registry._reads import MAX_POSITION
from dsh_mesh.runtime import Acceptance, IdempotencyKey, Write
from dsh_mesh.testing import EtcdAddress, EtcdServer, FaultyLogStore, Proceed, StoreCall

WAIT = 10.0
"""Upper bound of any wait in this module."""
POLL = timedelta(seconds=0.05)
"""How often the feeds of this module poll the log store."""
SESSION = SessionId("s-fixes")
MIB = 1024 * 1024


# -- helpers ------------------------------------------------------------------------------------


@dataclass
class Counted:
    """What a log store was asked (:func:`counting_log`)."""

    appends: list[int] = field(default_factory=list)
    """Writes per append (one group commit each)."""
    commits: list[list[Entry]] = field(default_factory=list)
    """The entries of each append."""
    reads: list[tuple[int, int]] = field(default_factory=list)
    """(limit asked, records returned) per read."""


def counting_log() -> tuple[FaultyLogStore, Counted]:
    """The memory log store, noting the size of every append and every read it is asked."""
    log, counted = FaultyLogStore(MemoryLogStore()), Counted()

    async def append(call: StoreCall, proceed: Proceed) -> object:
        writes = cast(Sequence[Write], call.arguments["writes"])
        counted.appends.append(len(writes))
        counted.commits.append([write.entry for write in writes])
        return await proceed()

    async def read(call: StoreCall, proceed: Proceed) -> list[Record]:
        records = cast(list[Record], await proceed())
        counted.reads.append((cast(int, call.arguments["limit"]), len(records)))
        return records

    log.faults.around("append", append, times=None)
    log.faults.around("read", read, times=None)
    return log, counted


@dataclass
class Registry:
    etcd: Etcd
    keys: Keys
    log: FaultyLogStore
    counted: Counted
    store: EtcdSessionStore
    reads: RegistryReads
    activation: Activation


@pytest.fixture
async def registry(etcd: EtcdAddress) -> AsyncIterator[Registry]:
    async with opened(etcd.endpoint) as made:
        yield made


@asynccontextmanager
async def opened(endpoint: str, **store_options: Any) -> AsyncIterator[Registry]:
    """A client, a lease, a log store of its own (in memory), a store with one resident root
    session, and the reads, under a key prefix of their own."""
    async with Etcd(EtcdConfig(endpoint=endpoint, call_timeout=timedelta(seconds=3))) as etcd:
        lease = LeaseKeeper(etcd, LeaseConfig())
        await lease.grant()
        log, counted = counting_log()
        try:
            keys = Keys(f"/fix-{secrets.token_hex(4)}/".encode())
            store = EtcdSessionStore(
                etcd, keys, log=log, lease=lambda: lease.lease_id, **store_options
            )
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
            reads = RegistryReads(etcd, keys, log, poll=POLL)
            yield Registry(etcd, keys, log, counted, store, reads, activation)
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
    """Close a watch or a feed (an async generator); anything the close raises fails the test."""
    assert isinstance(events, AsyncGenerator)
    await events.aclose()


async def revision_now(etcd: Etcd) -> int:
    return int((await etcd.range(b"/no-such-key")).header.revision)


async def first_event(feed: AsyncIterator[FeedEvent]) -> FeedEvent:
    async with asyncio.timeout(WAIT):
        return await anext(feed)


async def next_record(feed: AsyncIterator[FeedEvent]) -> FeedEvent:
    """The feed's next record event, past any residency events before it."""
    async with asyncio.timeout(WAIT):
        while True:
            event = await anext(feed)
            if event.record is not None:
                return event


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


# -- the feed: log-store positions --------------------------------------------------------------


@pytest.mark.parametrize("after", [MAX_POSITION + 1, 2**64 - 1, -1])
async def test_a_feed_resumed_past_any_position_is_refused_and_feeds_still_follow(
    registry: Registry, after: int
) -> None:
    reads, store, writer = registry.reads, registry.store, registry.activation.activation_id
    for _ in range(2):  # a refusal leaves nothing behind that wedges the next feed
        with pytest.raises(InvalidArgument, match="after_event_seq"):
            await first_event(reads.follow(SESSION, tree=False, after_position=after))
    # A feed from now sees a record appended after it started, its position above the horizon.
    horizon = await registry.log.horizon()
    feed = reads.follow(SESSION, tree=False, after_position=horizon)
    try:
        resident = await first_event(feed)
        assert (resident.activated, resident.position) == (registry.activation, horizon)
        record, _ = await store.append(SESSION, prompt("live"), writer=writer)
        event = await next_record(feed)
        assert event.record == record and event.position > horizon
    finally:
        await closed(feed)


async def test_closing_a_feed_ends_it_without_an_error(registry: Registry) -> None:
    """A client that stops watching closes its feed (``aclose``): that must end it quietly,
    its residency watch cancelled, as closing any async generator does."""
    feed = registry.reads.follow(SESSION, tree=False)
    assert isinstance(feed, AsyncGenerator)
    assert (await first_event(feed)).activated == registry.activation
    await feed.aclose()


async def test_a_feed_resumed_at_the_last_position_tells_residency_and_waits(
    registry: Registry,
) -> None:
    """2**63 - 1 is a position a feed can name: no record follows it, so the feed tells the
    current residency and then waits, while a feed from now sees the same append."""
    reads, store, writer = registry.reads, registry.store, registry.activation.activation_id
    far = reads.follow(SESSION, tree=False, after_position=MAX_POSITION)
    near = reads.follow(SESSION, tree=False, after_position=await registry.log.horizon())
    try:
        resident = await first_event(far)
        assert (resident.activated, resident.position) == (registry.activation, MAX_POSITION)
        waiting = asyncio.ensure_future(anext(far))
        record, _ = await store.append(SESSION, prompt("never followed"), writer=writer)
        assert (await next_record(near)).record == record
        done, _ = await asyncio.wait({waiting}, timeout=5 * POLL.total_seconds())
        assert not done, waiting.result()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    finally:
        await closed(far)
        await closed(near)


async def test_a_feed_resumed_ahead_of_the_log_store_waits_for_that_position(
    registry: Registry,
) -> None:
    reads, store, writer = registry.reads, registry.store, registry.activation.activation_id
    ahead = await registry.log.horizon() + 2  # memory store: positions count appends
    feed = reads.follow(SESSION, tree=False, after_position=ahead)
    try:
        resident = await first_event(feed)  # residency first, at the position resumed from
        assert (resident.activated, resident.position) == (registry.activation, ahead)
        seqs = [(await store.append(SESSION, prompt(f"p{n}"), writer=writer))[0].seq for n in "abc"]
        event = await next_record(feed)
        assert event.position == ahead + 1  # the first two appends were at or before `ahead`
        assert event.record is not None and event.record.seq == seqs[2]
    finally:
        await closed(feed)


async def test_entries_of_one_group_commit_have_their_own_positions_and_a_resume_splits_it(
    registry: Registry,
) -> None:
    """A group commit writes several entries in one log-store transaction: each still gets a
    position of its own, and a feed resumed after one of them goes on with the next, not after
    the whole commit (the event_seq of a watch must strictly increase and resume exactly)."""
    reads, store, writer = registry.reads, registry.store, registry.activation.activation_id
    log = registry.counted
    appended = await asyncio.gather(
        *(store.append(SESSION, prompt(f"batched {n}"), writer=writer) for n in range(8))
    )
    assert any(size > 1 for size in log.appends), f"no two appends shared a commit: {log.appends}"
    shared = next(n for n, size in enumerate(log.appends) if size > 1)
    shared = sum(log.appends[:shared]) + 1  # the second record of that commit
    seqs = sorted(record.seq for record, _ in appended)
    feed = reads.follow(SESSION, tree=False)
    try:
        first = [await next_record(feed) for _ in seqs]
    finally:
        await closed(feed)
    assert [e.record.seq for e in first if e.record] == seqs
    positions = [e.position for e in first]
    assert positions == sorted(set(positions)), "positions must strictly increase"
    resumed = reads.follow(SESSION, tree=False, after_position=positions[shared - 1])
    try:
        rest = [await next_record(resumed) for _ in first[shared:]]
    finally:
        await closed(resumed)
    assert [(e.position, e.record) for e in rest] == [
        (e.position, e.record) for e in first[shared:]
    ]


async def test_a_page_reads_only_its_own_entries_from_the_log_store(registry: Registry) -> None:
    """``GetSession`` reads a long transcript page by page: each page must fetch its own
    records (and one more, to know that more follow) from the log store, not the whole rest of
    the transcript, and nothing from etcd."""
    store, writer = registry.store, registry.activation.activation_id
    log = registry.counted
    for n in range(30):
        await store.append(SESSION, prompt(f"p{n}"), writer=writer)
    log.reads.clear()
    etcd_before = (registry.etcd.reads, registry.etcd.txns)
    first, more = await registry.reads.page(SESSION, after_seq=0, limit=5)
    last, done = await registry.reads.page(SESSION, after_seq=28, limit=5)
    assert [r.seq for r in first] == [1, 2, 3, 4, 5] and more
    assert [r.seq for r in last] == [29, 30] and not done
    assert log.reads == [(6, 6), (6, 2)]
    assert (registry.etcd.reads, registry.etcd.txns) == etcd_before


async def test_residency_lost_to_a_compaction_is_recovered_from_a_fresh_snapshot(
    etcd_server: EtcdServer,
) -> None:
    """The activation watch resumes after the last revision it saw; when etcd compacted that
    history meanwhile (the stream was down), the feed reads who is resident now and tells the
    difference: the activation that ended, then the one current now; an activation that came
    and went in the lost history is not told. A private etcd: compaction would disturb other
    tests' watches.

    The first watch of the feed is held back (as a broken stream would hold it) until the
    residency changed and etcd compacted past the feed's snapshot."""
    async with opened(etcd_server.address.endpoint) as registry:
        etcd, store, old = registry.etcd, registry.store, registry.activation
        original = etcd.watch_prefix
        gate, asked = asyncio.Event(), asyncio.Event()
        held: list[int] = []

        async def held_back(prefix: bytes, *, start_revision: int) -> AsyncIterator[Any]:
            held.append(start_revision)
            asked.set()
            await gate.wait()
            async for change in original(prefix, start_revision=start_revision):
                yield change

        def activation(name: str) -> Activation:
            return Activation(
                session_id=SESSION, activation_id=ActivationId(name), node_id=NodeId("n-1")
            )

        etcd.watch_prefix = held_back  # type: ignore[method-assign]
        feed = registry.reads.follow(SESSION, tree=False)
        try:
            resident = await first_event(feed)
            assert resident.activated == old
            snapshot = await revision_now(etcd)
            await store.release(old)
            passing, new = activation("a-2"), activation("a-3")
            assert await store.try_activate(passing) == passing
            await store.release(passing)
            assert await store.try_activate(new) == new
            await etcd._client.compact(await revision_now(etcd))
            await asyncio.wait_for(asked.wait(), WAIT)
            assert held[0] <= snapshot + 1  # the watch asked for history from the snapshot on
            gate.set()
            ended = await first_event(feed)
            began = await first_event(feed)
            assert (ended.session, ended.deactivated, ended.activated) == (SESSION, old, None)
            assert (began.session, began.activated, began.deactivated) == (SESSION, new, None)
            assert ended.position == began.position == 0
            # The watch goes on after the snapshot: a later release is the very next event.
            await store.release(new)
            later = await first_event(feed)
            assert (later.deactivated, later.activated) == (new, None)
            assert len(held) >= 2  # and a watch was asked for again, after the compaction
        finally:
            await closed(feed)
        await watch_sees_a_put(etcd, registry.keys.prefix + b"w/k")


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


async def test_an_entry_over_the_limit_is_refused_alone_and_commits_stay_bounded(
    registry: Registry,
) -> None:
    """Entries go to the log store, not etcd, so etcd's request limit is no longer theirs: the
    store's own limit refuses an entry before anything is written, the appends around it go in
    in order, and a group commit carries at most ``BATCH_BYTES`` beyond its first entry (two
    entries of nearly 1 MiB never share one)."""
    store, writer = registry.store, registry.activation.activation_id
    log = registry.counted
    with pytest.raises(InvalidArgument, match="limit is"):
        await store.append(SESSION, prompt("z" * 2 * MIB), writer=writer)
    assert await store.read(SESSION) == [] and log.appends == []
    big = "y" * (MIB - 1024)  # fits alone; two of them do not fit one commit
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
    assert sum(log.appends) == 4, log.appends
    assert 2 * len(big) > BATCH_BYTES
    assert all(commit.count(prompt(big)) < 2 for commit in log.commits), log.appends


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
