"""The registry against a real etcd: the store keeps the SessionStore contract the in-memory
store keeps, a node whose activation is gone can never append again, the lease keeper fences
its node, and the directory follows etcd through lease expiry and an etcd crash.

Every test works under a key prefix of its own; every etcd call has a deadline (the facade's
``call_timeout``) and every wait is for a condition, bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationFenced,
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    DeliveryKind,
    HumanPromptEntry,
    IdempotencyConflict,
    InvalidArgument,
    MeshError,
    NodeFenced,
    NodeId,
    Record,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SessionUnknown,
)
from dsh_mesh.registry import (
    ActivationEnded,
    ActivationStarted,
    Directory,
    DirectoryEvent,
    Etcd,
    EtcdConfig,
    EtcdSessionStore,
    Keys,
    LeaseConfig,
    LeaseKeeper,
    LeaseLost,
    NodeInfo,
)
from dsh_mesh.registry._codec import decode_activation
from dsh_mesh.registry._etcd import put
from dsh_mesh.registry._store import MAX_ENTRY_BYTES
from dsh_mesh.runtime import Acceptance, IdempotencyKey
from dsh_mesh.testing import EtcdAddress, EtcdServer

T = TypeVar("T")

CALL_TIMEOUT = timedelta(seconds=3)
WAIT = 10.0
"""Upper bound of any wait for a condition (lease expiry with a 1 s TTL takes up to ~1.5 s)."""
POLL = 0.01
RACE_ROUNDS = 25
SHORTEST_TTL = timedelta(seconds=1)
LONG_TTL = timedelta(seconds=30)
ETCD_MAX_REQUEST_BYTES = 3 * 512 * 1024
"""etcd's default ``--max-request-bytes`` (1.5 MiB)."""


# -- helpers ----------------------------------------------------------------------------------


def fresh_keys() -> Keys:
    return Keys(prefix=f"/t-{secrets.token_hex(4)}/".encode())


def root_header(name: str = "s-root") -> SessionHeader:
    return SessionHeader(
        session_id=SessionId(name),
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset="lead", model="m"),
    )


def child_header(name: str, parent: str) -> SessionHeader:
    return SessionHeader(
        session_id=SessionId(name),
        kind=SessionKind.CONTINUABLE_CHILD,
        parent_session=SessionId(parent),
        spec=SessionSpec(preset="helper", model="m"),
    )


def activation_of(
    session: SessionId | str, node: str, *, parent: ActivationId | None = None
) -> Activation:
    return Activation(
        session_id=SessionId(session),
        activation_id=ActivationId(f"a-{secrets.token_hex(6)}"),
        node_id=NodeId(node),
        parent_activation=parent,
    )


def prompt(text: str) -> HumanPromptEntry:
    return HumanPromptEntry(content=text)


def message(sender: str, text: str) -> AgentMessageEntry:
    return AgentMessageEntry(
        source=AgentMessageSource(sender_session_id=SessionId(sender)), content=text
    )


def acceptance(target: SessionId, writer: ActivationId, fingerprint: str) -> Acceptance:
    return Acceptance(
        target=target,
        seq=0,
        target_activation=writer,
        kind=DeliveryKind.STEERED,
        fingerprint=fingerprint,
    )


def contents(records: list[Record]) -> list[tuple[int, str]]:
    return [(r.seq, getattr(r.entry, "content", "")) for r in records]


@dataclass
class Node:
    """One node's view of the registry: its own etcd connection, lease and store."""

    name: str
    etcd: Etcd
    keeper: LeaseKeeper
    store: EtcdSessionStore

    @property
    def lease(self) -> int:
        return self.keeper.lease_id

    def activation(self, session: SessionId | str, **kwargs: ActivationId | None) -> Activation:
        return activation_of(session, self.name, **kwargs)


@asynccontextmanager
async def connected(endpoint: str) -> AsyncIterator[Etcd]:
    async with Etcd(EtcdConfig(endpoint=endpoint, call_timeout=CALL_TIMEOUT)) as etcd:
        yield etcd


@asynccontextmanager
async def node(
    endpoint: str,
    keys: Keys,
    name: str,
    *,
    ttl: timedelta = LONG_TTL,
    directory: Directory | None = None,
    max_entry_bytes: int = MAX_ENTRY_BYTES,
) -> AsyncIterator[Node]:
    """A node with a granted (not kept alive) lease; the lease is revoked on exit."""
    async with connected(endpoint) as etcd:
        keeper = LeaseKeeper(etcd, LeaseConfig(ttl=ttl))
        await keeper.grant()
        store = EtcdSessionStore(
            etcd,
            keys,
            lease=lambda: keeper.lease_id,
            directory=directory,
            max_entry_bytes=max_entry_bytes,
        )
        try:
            yield Node(name=name, etcd=etcd, keeper=keeper, store=store)
        finally:
            with contextlib.suppress(MeshError):
                await keeper.revoke()


async def until(predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate`` holds, re-checking every few milliseconds, for at most
    ``WAIT`` seconds (a bounded wait for a condition, never a fixed sleep)."""
    async with asyncio.timeout(WAIT):
        while True:
            if predicate():
                return
            await asyncio.sleep(POLL)


async def until_async(predicate: Callable[[], Awaitable[bool]]) -> None:
    """The same for a predicate that reads etcd."""
    async with asyncio.timeout(WAIT):
        while True:
            if await predicate():
                return
            await asyncio.sleep(POLL)


async def stored_activation(etcd: Etcd, keys: Keys, session: SessionId) -> tuple[Activation, int]:
    """The activation etcd holds for ``session`` and the lease it is bound to."""
    kv = await etcd.get(keys.activation(session))
    assert kv is not None, f"{session} has no activation in etcd"
    return decode_activation(kv.value), int(kv.lease)


async def head(etcd: Etcd, keys: Keys, session: SessionId) -> int:
    kv = await etcd.get(keys.head(session))
    assert kv is not None
    return int(kv.value)


def run_elsewhere(work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` on an event loop of its own in another thread and wait for it *blocking
    this thread's loop*: nothing on this loop (a directory's watch, above all) can run until
    it is done. That is how a test orders "etcd changed" strictly before "the directory looked"
    without sleeping."""

    async def main() -> T:
        return await work()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result(timeout=WAIT)


@dataclass
class EventLog:
    """Collects a directory's events; ``snapshots`` keeps, per event, what the directory said
    about that event's session at the moment the event was applied."""

    directory: Directory | None = None
    events: list[DirectoryEvent] = field(default_factory=list)
    snapshots: list[Activation | None] = field(default_factory=list)

    def __call__(self, event: DirectoryEvent) -> None:
        self.events.append(event)
        if self.directory is not None:
            self.snapshots.append(self.directory.activation(event.activation.session_id))

    def ended(self) -> list[Activation]:
        return [e.activation for e in self.events if isinstance(e, ActivationEnded)]

    def started(self) -> list[Activation]:
        return [e.activation for e in self.events if isinstance(e, ActivationStarted)]


@asynccontextmanager
async def following(etcd: Etcd, keys: Keys) -> AsyncIterator[tuple[Directory, EventLog]]:
    """A directory following ``keys`` until the block ends, with its event log."""
    log = EventLog()
    directory = Directory(etcd, keys, on_event=log)
    log.directory = directory
    task = asyncio.create_task(directory.follow(), name="directory")
    try:
        async with asyncio.timeout(WAIT):
            await directory.ready()
        yield directory, log
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
def keys() -> Keys:
    return fresh_keys()


@pytest.fixture
async def node_a(etcd: EtcdAddress, keys: Keys) -> AsyncIterator[Node]:
    async with node(etcd.endpoint, keys, "node-a") as running:
        yield running


@pytest.fixture
async def node_b(etcd: EtcdAddress, keys: Keys) -> AsyncIterator[Node]:
    async with node(etcd.endpoint, keys, "node-b") as running:
        yield running


# -- the SessionStore contract on etcd --------------------------------------------------------


async def test_headers_are_create_only_and_round_trip(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    header = child_header("s-child", "s-root")
    await node_a.store.create_header(root_header())
    await node_a.store.create_header(header)
    with pytest.raises(SessionExists):
        await node_a.store.create_header(header)
    # Another node has nothing cached: etcd itself refuses the second create.
    with pytest.raises(SessionExists):
        await node_b.store.create_header(
            dataclasses.replace(header, spec=SessionSpec(preset="other", model="other"))
        )

    assert await node_b.store.get_header(header.session_id) == header  # read from etcd
    assert await node_a.store.get_header(header.session_id) == header
    assert await node_b.store.get_header(SessionId("s-nobody")) is None
    assert await node_b.store.read(header.session_id) == []
    with pytest.raises(SessionUnknown):
        await node_b.store.read(SessionId("s-nobody"))


async def test_a_header_and_each_record_keep_when_they_were_written(
    node_a: Node, node_b: Node
) -> None:
    session = SessionId("s-times")
    await node_a.store.create_header(root_header(session), [prompt("task")])
    header = await node_b.store.get_header(session)  # read from etcd
    assert header is not None and header.created_at is not None
    assert header.created_at.utcoffset() == timedelta(0)
    cached = await node_a.store.get_header(session)
    assert cached is not None and cached.created_at == header.created_at
    current = await node_a.store.try_activate(node_a.activation(session))
    appended, _ = await node_a.store.append(session, prompt("p"), writer=current.activation_id)
    created, stored = await node_b.store.read(session)
    assert created.recorded_at is not None and stored.recorded_at is not None
    # What the writer was told is what every reader reads, to the microsecond.
    assert stored.recorded_at == appended.recorded_at
    assert created.recorded_at == header.created_at  # written in the header's transaction


async def test_activating_an_unknown_session_is_session_unknown_and_writes_nothing(
    node_a: Node, keys: Keys
) -> None:
    session = SessionId("s-ghost")
    with pytest.raises(SessionUnknown):
        await node_a.store.try_activate(node_a.activation(session))
    assert await node_a.etcd.get(keys.activation(session)) is None
    assert await node_a.store.current_activation(session) is None


async def test_racing_activations_have_exactly_one_winner_and_the_loser_learns_it(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    assert node_a.lease != node_b.lease
    for round_ in range(RACE_ROUNDS):
        session = SessionId(f"s-race-{round_}")
        await node_a.store.create_header(root_header(session))
        mine, theirs = node_a.activation(session), node_b.activation(session)
        got_a, got_b = await asyncio.gather(
            node_a.store.try_activate(mine), node_b.store.try_activate(theirs)
        )
        assert got_a == got_b, "both callers must end up naming the same current activation"
        assert got_a in (mine, theirs)
        winner, loser = (node_a, node_b) if got_a == mine else (node_b, node_a)
        lost = theirs if winner is node_a else mine

        held, lease = await stored_activation(node_a.etcd, keys, session)
        assert (held, lease) == (got_a, winner.lease)
        # Only the winner writes; the loser's own activation never became current.
        record, _ = await winner.store.append(session, prompt("w"), writer=got_a.activation_id)
        assert record.seq == 1
        with pytest.raises(ActivationFenced):
            await loser.store.append(session, prompt("l"), writer=lost.activation_id)
        assert contents(await loser.store.read(session)) == [(1, "w")]


async def test_appends_take_consecutive_seqs_in_order(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-seq")
    await node_a.store.create_header(root_header(session))
    current = await node_a.store.try_activate(node_a.activation(session))
    writer = current.activation_id
    seqs = [
        (await node_a.store.append(session, prompt(f"m{i}"), writer=writer))[0].seq
        for i in (1, 2, 3)
    ]
    assert seqs == [1, 2, 3]

    # Concurrent appends of one writer (its cached head goes stale under it) still take
    # distinct consecutive seqs, and each record says what was stored under its seq.
    records = await asyncio.gather(
        *(node_a.store.append(session, prompt(f"c{i}"), writer=writer) for i in range(8))
    )
    assert sorted(r.seq for r, _ in records) == list(range(4, 12))
    stored = {r.seq: r for r in await node_b.store.read(session)}
    assert [stored[r.seq] for r, _ in records] == [r for r, _ in records]
    assert await head(node_a.etcd, keys, session) == 11

    # Writers without an activation (notices to an absent session) on two nodes at once.
    absent = SessionId("s-absent")
    await node_a.store.create_header(root_header(absent))
    written = await asyncio.gather(
        *(
            (node_a if i % 2 else node_b).store.append(absent, prompt(f"n{i}"), writer=None)
            for i in range(10)
        )
    )
    assert sorted(r.seq for r, _ in written) == list(range(1, 11))
    assert [s for s, _ in contents(await node_a.store.read(absent))] == list(range(1, 11))


async def test_an_append_by_a_writer_that_is_not_current_is_fenced_and_writes_nothing(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-fence")
    await node_a.store.create_header(root_header(session))
    current = await node_a.store.try_activate(node_a.activation(session))
    await node_a.store.append(session, prompt("kept"), writer=current.activation_id)
    before = await node_a.store.read(session)

    with pytest.raises(ActivationFenced):
        await node_b.store.append(session, prompt("forged"), writer=ActivationId("a-forged"))
    with pytest.raises(ActivationFenced):
        await node_a.store.append(session, prompt("forged"), writer=ActivationId("a-forged"))
    with pytest.raises(ActivationFenced):  # writer None: only while the session has none
        await node_b.store.append(session, prompt("offline"), writer=None)
    with pytest.raises(ActivationFenced):
        await node_a.store.append(session, prompt("offline"), writer=None)

    assert await node_b.store.read(session) == before
    assert await head(node_a.etcd, keys, session) == 1


async def test_a_known_idempotency_key_returns_the_first_acceptance_and_writes_nothing(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-idem")
    await node_a.store.create_header(root_header(session))
    writer = (await node_a.store.try_activate(node_a.activation(session))).activation_id
    key = IdempotencyKey(principal="s-parent", key="k-1")
    asked = acceptance(session, writer, "fp-1")

    first, known = await node_a.store.append(
        session, message("s-parent", "once"), writer=writer, idempotency=(key, asked)
    )
    assert (first.seq, known) == (1, None)
    recorded = await node_b.store.lookup(key)
    assert recorded == Acceptance(
        target=session,
        seq=1,
        target_activation=writer,
        kind=DeliveryKind.STEERED,
        fingerprint="fp-1",
    )

    await node_a.store.append(session, prompt("something else"), writer=writer)
    txns = node_a.etcd.txns
    again, known = await node_a.store.append(
        session, message("s-parent", "once"), writer=writer, idempotency=(key, asked)
    )
    assert (again, known) == (first, recorded)
    assert node_a.etcd.txns == txns + 1  # one refused transaction, nothing written
    # The same from another node, which has nothing cached.
    assert await node_b.store.append(
        session, message("s-parent", "once"), writer=writer, idempotency=(key, asked)
    ) == (first, recorded)

    with pytest.raises(IdempotencyConflict):
        await node_a.store.append(
            session,
            message("s-parent", "another text"),
            writer=writer,
            idempotency=(key, acceptance(session, writer, "fp-2")),
        )
    assert contents(await node_b.store.read(session)) == [(1, "once"), (2, "something else")]
    assert await head(node_a.etcd, keys, session) == 2
    assert await node_b.store.lookup(IdempotencyKey(principal="s-other", key="k-1")) is None


async def test_a_released_session_is_won_by_another_node_which_continues_the_transcript(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-move")
    await node_a.store.create_header(root_header(session))
    first = await node_a.store.try_activate(node_a.activation(session))
    await node_a.store.append(session, prompt("on a"), writer=first.activation_id)

    await node_a.store.release(first)
    assert await node_a.etcd.get(keys.activation(session)) is None
    await node_a.store.release(first)  # idempotent
    await node_b.store.release(first)  # a no-op for a node that never held it

    second = await node_b.store.try_activate(node_b.activation(session))
    assert second.node_id == "node-b"
    assert await stored_activation(node_b.etcd, keys, session) == (second, node_b.lease)
    record, _ = await node_b.store.append(session, prompt("on b"), writer=second.activation_id)
    assert record.seq == 2
    with pytest.raises(ActivationFenced):
        await node_a.store.append(session, prompt("late a"), writer=first.activation_id)
    await node_a.store.release(first)  # releasing a stale activation leaves the new one alone
    assert (await stored_activation(node_a.etcd, keys, session))[0] == second
    assert contents(await node_a.store.read(session)) == [(1, "on a"), (2, "on b")]

    # And back again: node a's cached head (1) is stale and must not cost a seq.
    await node_b.store.release(second)
    third = await node_a.store.try_activate(node_a.activation(session))
    record, _ = await node_a.store.append(session, prompt("a again"), writer=third.activation_id)
    assert record.seq == 3


async def test_try_resume_wins_reads_the_transcript_and_refreshes_a_stale_head_in_one_txn(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-resume")
    await node_a.store.create_header(root_header(session))
    first = await node_a.store.try_activate(node_a.activation(session))
    await node_a.store.append(session, prompt("on a"), writer=first.activation_id)
    await node_a.store.release(first)
    second = await node_b.store.try_activate(node_b.activation(session))
    await node_b.store.append(session, prompt("on b"), writer=second.activation_id)
    await node_b.store.release(second)

    mine = node_a.activation(session)
    txns, reads = node_a.etcd.txns, node_a.etcd.reads
    resumed = await node_a.store.try_resume(mine)
    assert resumed.current == mine and resumed.known is None
    assert contents(list(resumed.records)) == [(1, "on a"), (2, "on b")]
    # Node a's cached head (1) was refreshed by the same transaction: the append goes through
    # at the first attempt, with no read.
    record, _ = await node_a.store.append(session, prompt("a again"), writer=mine.activation_id)
    assert record.seq == 3
    assert (node_a.etcd.txns, node_a.etcd.reads) == (txns + 2, reads)
    assert await stored_activation(node_a.etcd, keys, session) == (mine, node_a.lease)

    # A held session: the holder comes back, and nothing is read or written.
    lost = await node_b.store.try_resume(node_b.activation(session))
    assert lost.current == mine and lost.records == () and lost.known is None
    with pytest.raises(SessionUnknown):
        await node_b.store.try_resume(node_b.activation(SessionId("s-nobody")))


async def test_try_resume_activates_nothing_for_a_key_already_accepted(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-resume-known")
    await node_a.store.create_header(root_header(session))
    held = await node_a.store.try_activate(node_a.activation(session))
    writer = held.activation_id
    key = IdempotencyKey(principal="s-parent", key="k-1")
    await node_a.store.append(
        session,
        message("s-parent", "once"),
        writer=writer,
        idempotency=(key, acceptance(session, writer, "fp-1")),
    )
    await node_a.store.release(held)

    retried = await node_b.store.try_resume(node_b.activation(session), unless_known=key)
    assert retried.current is None and retried.records == ()
    assert retried.known is not None and retried.known.seq == 1
    assert retried.known.target_activation == writer
    assert await node_b.etcd.get(keys.activation(session)) is None

    fresh = IdempotencyKey(principal="s-parent", key="k-2")
    mine = node_b.activation(session)
    won = await node_b.store.try_resume(mine, unless_known=fresh)
    assert won.current == mine and won.known is None
    assert contents(list(won.records)) == [(1, "once")]


async def test_rebind_changes_the_parent_activation_and_keeps_the_fence(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    await node_a.store.create_header(root_header("s-p"))
    session = SessionId("s-c")
    await node_a.store.create_header(child_header(session, "s-p"))
    current = await node_a.store.try_activate(
        node_a.activation(session, parent=ActivationId("a-parent-1"))
    )
    kv_before = await node_a.etcd.get(keys.activation(session))
    assert kv_before is not None
    await node_a.store.append(session, prompt("before"), writer=current.activation_id)

    rebound = await node_a.store.rebind(current, ActivationId("a-parent-2"))
    assert rebound == Activation(
        session_id=session,
        activation_id=current.activation_id,
        node_id=current.node_id,
        parent_activation=ActivationId("a-parent-2"),
    )
    kv_after = await node_a.etcd.get(keys.activation(session))
    assert kv_after is not None
    assert decode_activation(kv_after.value) == rebound
    assert kv_after.create_revision == kv_before.create_revision  # the same fence
    assert kv_after.lease == node_a.lease
    assert await node_b.store.current_activation(session, fresh=True) == rebound

    record, _ = await node_a.store.append(session, prompt("after"), writer=current.activation_id)
    assert record.seq == 2
    # Another node can name the same writer too: the fence is the key's create revision.
    record, _ = await node_b.store.append(session, prompt("via b"), writer=current.activation_id)
    assert record.seq == 3

    await node_a.store.release(rebound)
    with pytest.raises(ActivationFenced):
        await node_a.store.rebind(rebound, ActivationId("a-parent-3"))
    assert await node_a.etcd.get(keys.activation(session)) is None


async def test_read_after_seq_pages_through_the_transcript(node_a: Node, node_b: Node) -> None:
    session = SessionId("s-pages")
    await node_a.store.create_header(root_header(session))
    writer = (await node_a.store.try_activate(node_a.activation(session))).activation_id
    for i in range(1, 8):
        await node_a.store.append(session, prompt(f"m{i}"), writer=writer)

    everything = await node_b.store.read(session)
    assert contents(everything) == [(i, f"m{i}") for i in range(1, 8)]
    assert await node_b.store.read(session, after_seq=0) == everything
    assert await node_b.store.read(session, after_seq=3) == everything[3:]
    assert await node_b.store.read(session, after_seq=7) == []
    assert await node_b.store.read(session, after_seq=100) == []

    paged: list[Record] = []
    while page := (await node_b.store.read(session, after_seq=paged[-1].seq if paged else 0))[:3]:
        paged.extend(page)
    assert paged == everything


async def test_an_entry_too_large_for_etcd_is_refused_as_invalid_and_writes_nothing(
    etcd: EtcdAddress, node_a: Node, keys: Keys
) -> None:
    session = SessionId("s-big")
    await node_a.store.create_header(root_header(session))
    writer = (await node_a.store.try_activate(node_a.activation(session))).activation_id
    await node_a.store.append(session, prompt("small"), writer=writer)

    # The largest entry the default limit admits fits in one etcd request, with an
    # idempotency record beside it (the entry's other fields and the time it was written take
    # under 256 bytes).
    fits = prompt("x" * (MAX_ENTRY_BYTES - 256))
    key = IdempotencyKey(principal="human", key="big")
    record, _ = await node_a.store.append(
        session, fits, writer=writer, idempotency=(key, acceptance(session, writer, "f"))
    )
    assert record.seq == 2

    txns = node_a.etcd.txns
    for too_big in (
        prompt("y" * ETCD_MAX_REQUEST_BYTES),
        # 256 Ki characters, each escaped to 6 bytes: within a message's character limit,
        # beyond etcd's request limit once encoded.
        message("s-parent", "\x01" * (256 * 1024)),
    ):
        with pytest.raises(InvalidArgument, match="limit"):
            await node_a.store.append(session, too_big, writer=writer)
    assert node_a.etcd.txns == txns, "an oversized entry must be refused before any request"
    assert [r.seq for r in await node_a.store.read(session)] == [1, 2]
    assert await head(node_a.etcd, keys, session) == 2

    # The limit is configurable; above etcd's own limit etcd refuses too, as invalid (never as
    # unavailable: a retry would fail again), after a round trip the store's check saves.
    async with node(etcd.endpoint, keys, "node-lax", max_entry_bytes=4 * MAX_ENTRY_BYTES) as lax:
        with pytest.raises(InvalidArgument, match="too large"):
            await lax.store.append(session, prompt("z" * ETCD_MAX_REQUEST_BYTES), writer=writer)
    async with node(etcd.endpoint, keys, "node-strict", max_entry_bytes=1024) as strict:
        with pytest.raises(InvalidArgument):
            await strict.store.append(session, prompt("w" * 1024), writer=writer)
        record, _ = await strict.store.append(session, prompt("w" * 900), writer=writer)
        assert record.seq == 3
    with pytest.raises(ValueError, match="positive"):
        EtcdSessionStore(node_a.etcd, keys, lease=lambda: 0, max_entry_bytes=0)


# -- the zombie: a node whose activation is gone can never append again -----------------------


@pytest.mark.contract(3)
async def test_a_node_whose_lease_was_revoked_can_never_append_again(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-zombie")
    await node_a.store.create_header(root_header(session))
    old = await node_a.store.try_activate(node_a.activation(session))
    await node_a.store.append(session, prompt("a1"), writer=old.activation_id)

    await node_b.etcd.revoke(node_a.lease)  # node a's lease ends (it is not told)
    assert await node_b.etcd.get(keys.activation(session)) is None
    with pytest.raises(ActivationFenced):  # fenced even before anyone else takes over
        await node_a.store.append(session, prompt("a2"), writer=old.activation_id)

    new = await node_b.store.try_activate(node_b.activation(session))
    assert new.node_id == "node-b"
    await assert_zombie_fenced(node_a, node_b, session, old, new)


@pytest.mark.contract(3)
async def test_a_node_whose_lease_expired_can_never_append_again(
    etcd: EtcdAddress, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-expired")
    async with node(etcd.endpoint, keys, "node-a", ttl=SHORTEST_TTL) as node_a:
        await node_a.store.create_header(root_header(session))
        old = await node_a.store.try_activate(node_a.activation(session))
        await node_a.store.append(session, prompt("a1"), writer=old.activation_id)

        # Node a stops refreshing (it never started): etcd expires the lease and with it the
        # activation key. Node a itself still believes it holds the lease.
        async def expired() -> bool:
            return await node_b.etcd.get(keys.activation(session)) is None

        await until_async(expired)
        assert node_a.keeper.held

        new = await node_b.store.try_activate(node_b.activation(session))
        await assert_zombie_fenced(node_a, node_b, session, old, new)


async def assert_zombie_fenced(
    zombie: Node, successor: Node, session: SessionId, old: Activation, new: Activation
) -> None:
    for attempt in ("a2", "a3"):
        with pytest.raises(ActivationFenced):
            await zombie.store.append(session, prompt(attempt), writer=old.activation_id)
    with pytest.raises(ActivationFenced):
        await zombie.store.append(session, prompt("a-none"), writer=None)
    with pytest.raises(ActivationFenced):
        await zombie.store.rebind(old, ActivationId("a-parent"))
    await zombie.store.release(old)  # must not end the successor's activation
    assert await successor.store.current_activation(session, fresh=True) == new

    for expected in (2, 3):
        record, _ = await successor.store.append(
            session, prompt(f"b{expected}"), writer=new.activation_id
        )
        assert record.seq == expected
    with pytest.raises(ActivationFenced):
        await zombie.store.append(session, prompt("a4"), writer=old.activation_id)
    assert contents(await zombie.store.read(session)) == [(1, "a1"), (2, "b2"), (3, "b3")]


# -- the lease keeper --------------------------------------------------------------------------


async def test_keep_raises_lease_lost_when_the_lease_is_revoked_elsewhere(
    etcd: EtcdAddress, node_b: Node, keys: Keys
) -> None:
    async with node(etcd.endpoint, keys, "node-a", ttl=SHORTEST_TTL) as node_a:
        session = SessionId("s-kept")
        await node_a.store.create_header(root_header(session))
        await node_a.store.try_activate(node_a.activation(session))
        lease = node_a.lease

        keeping = asyncio.create_task(node_a.keeper.keep())
        await node_b.etcd.revoke(lease)
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(keeping, WAIT)

        assert not node_a.keeper.held
        with pytest.raises(NodeFenced):
            _ = node_a.keeper.lease_id
        # Nothing new can bind to the lost lease: the store asks the keeper for every win.
        other = SessionId("s-after")
        await node_a.store.create_header(root_header(other))
        with pytest.raises(NodeFenced):
            await node_a.store.try_activate(node_a.activation(other))
        assert await node_b.etcd.get(keys.activation(other)) is None
        assert await node_b.etcd.get(keys.activation(session)) is None

        await node_a.keeper.revoke()
        await node_a.keeper.revoke()  # idempotent

        fresh = await node_a.keeper.grant()  # a fenced node may register again
        assert fresh != lease
        assert node_a.keeper.lease_id == fresh


async def test_revoke_is_idempotent_and_ends_everything_bound_to_the_lease(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-revoked")
    await node_a.store.create_header(root_header(session))
    await node_a.store.try_activate(node_a.activation(session))

    # Revoked by someone else first (the keeper has not noticed): revoking it again is fine.
    await node_b.etcd.revoke(node_a.lease)
    await node_a.keeper.revoke()
    assert not node_a.keeper.held
    await node_a.keeper.revoke()

    await node_b.keeper.revoke()
    await node_b.keeper.revoke()
    assert await node_a.etcd.get(keys.activation(session)) is None
    with pytest.raises(NodeFenced):
        _ = node_b.keeper.lease_id


# -- the directory ----------------------------------------------------------------------------


async def test_directory_loads_a_snapshot_then_follows_activations_and_nodes(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    for name in ("s-1", "s-2"):
        await node_a.store.create_header(root_header(name))
    before = await node_a.store.try_activate(node_a.activation("s-1"))

    async with following(node_b.etcd, keys) as (directory, log):
        assert directory.synced
        assert directory.activation(before.session_id) == before  # from the snapshot
        assert log.events == []

        started = await node_a.store.try_activate(node_a.activation("s-2"))
        await until(lambda: directory.activation(started.session_id) == started)
        assert log.started() == [started]

        await node_a.store.release(before)
        await until(lambda: log.ended() == [before])
        assert directory.activation(before.session_id) is None

        rebound = await node_a.store.rebind(started, ActivationId("a-parent-2"))
        await until(lambda: directory.activation(started.session_id) == rebound)
        assert log.started() == [started, rebound]
        assert directory.activations() == [rebound]

        info = NodeInfo(node_id=NodeId("node-a"), address="127.0.0.1:1", load=3)
        await node_a.etcd.txn([], [put(keys.node(info.node_id), info.encode(), lease=node_a.lease)])
        await until(lambda: directory.nodes() == {info.node_id: info})
        await node_a.keeper.revoke()  # the node goes: its registration and activations too
        await until(lambda: directory.nodes() == {} and directory.activations() == [])
        assert log.ended() == [before, rebound]


async def test_directory_reports_a_lease_expiry_as_the_activation_that_ended(
    etcd: EtcdAddress, node_b: Node, keys: Keys
) -> None:
    async with node(etcd.endpoint, keys, "node-a", ttl=SHORTEST_TTL) as node_a:
        await node_a.store.create_header(root_header("s-lapse"))
        async with following(node_b.etcd, keys) as (directory, log):
            lapsing = await node_a.store.try_activate(node_a.activation("s-lapse"))
            await until(lambda: log.started() == [lapsing])
            # Nobody keeps node a's lease alive: etcd expires it.
            await until(lambda: bool(log.ended()))
            assert log.ended() == [lapsing]
            assert directory.activation(lapsing.session_id) is None
            assert directory.synced


async def test_directory_resumes_after_an_etcd_crash_without_missing_a_deletion(
    etcd_server: EtcdServer,
) -> None:
    keys = fresh_keys()
    endpoint = etcd_server.endpoint
    async with (
        node(endpoint, keys, "node-a") as node_a,
        connected(endpoint) as watching,
        following(watching, keys) as (directory, log),
    ):
        for name in ("s-gone", "s-kept"):
            await node_a.store.create_header(root_header(name))
        gone = await node_a.store.try_activate(node_a.activation("s-gone"))
        kept = await node_a.store.try_activate(node_a.activation("s-kept"))
        await until(lambda: len(directory.activations()) == 2)

        etcd_server.kill()
        await until(lambda: not directory.synced)  # the watch broke; readers fall back

        # Restart, and at once (this loop, so the directory, blocked meanwhile) another
        # client ends one activation and starts one more: all of it happens before the
        # directory can reconnect.
        etcd_server.restart()
        late = activation_of("s-late", "node-c")

        async def meanwhile() -> None:
            async with connected(endpoint) as etcd_c:
                keeper = LeaseKeeper(etcd_c, LeaseConfig(ttl=LONG_TTL))
                await keeper.grant()  # outlives this client; the server goes with the test
                store_c = EtcdSessionStore(etcd_c, keys, lease=lambda: keeper.lease_id)
                assert await store_c.try_activate(activation_of("s-gone", "node-c")) == gone
                await store_c.release(gone)  # the loser learned the fence; now it ends it
                await store_c.create_header(root_header("s-late"))
                assert await store_c.try_activate(late) == late

        run_elsewhere(meanwhile)
        assert directory.activation(gone.session_id) == gone  # it has not looked yet

        await until(lambda: directory.synced and directory.activation(late.session_id) == late)
        await until(lambda: gone.session_id not in {a.session_id for a in directory.activations()})
        assert log.ended() == [gone]
        assert {a.activation_id for a in directory.activations()} == {
            kept.activation_id,
            late.activation_id,
        }
        # And it keeps following after the outage.
        await node_a.store.release(kept)
        await until(lambda: log.ended() == [gone, kept])


async def test_directory_keeps_a_noted_activation_when_the_previous_ones_end_arrives_late(
    node_a: Node, keys: Keys, etcd: EtcdAddress
) -> None:
    """Node c wins a session right after its old holder's lease ended; the old key's deletion
    reaches node c's directory only after its own win was noted: the win must not vanish."""
    session = SessionId("s-handover")
    await node_a.store.create_header(root_header(session))
    old = await node_a.store.try_activate(node_a.activation(session))
    async with connected(etcd.endpoint) as watching, following(watching, keys) as (directory, log):
        await until(lambda: directory.activation(session) == old)
        won = activation_of(session, "node-c")
        old_lease = node_a.lease

        async def meanwhile() -> int:
            # Node c's store notes into the directory under test, whose loop is blocked: the
            # deletion below reaches the directory only after node c's win was noted.
            async with connected(etcd.endpoint) as etcd_c:
                keeper = LeaseKeeper(etcd_c, LeaseConfig(ttl=LONG_TTL))
                lease_c = await keeper.grant()
                store_c = EtcdSessionStore(
                    etcd_c, keys, lease=lambda: keeper.lease_id, directory=directory
                )
                await etcd_c.revoke(old_lease)
                assert await store_c.try_activate(won) == won
                return lease_c

        lease_c = run_elsewhere(meanwhile)
        assert directory.activation(session) == won  # noted
        await until(lambda: log.ended() == [old])
        ended_at = log.snapshots[log.events.index(ActivationEnded(activation=old))]
        assert ended_at == won, "the late end of the old activation hid the new one"
        await until(lambda: log.started() == [won])
        assert directory.activation(session) == won
        await watching.revoke(lease_c)
