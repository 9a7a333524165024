"""The registry against a real etcd and a log store: the store keeps the SessionStore contract
the in-memory store keeps, a node whose activation is gone can never append after its successor
has read (the log store's fence, ADR 0026), the lease keeper fences its node, and the directory
follows etcd through lease expiry and an etcd crash.

Every test works under a key prefix of its own; its nodes share one SQLite log store file, each
node on a connection of its own (as node processes on one host do). Every etcd call has a
deadline (the facade's ``call_timeout``) and every wait is for a condition, bounded by
``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

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
    RegistryUnavailable,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SessionUnknown,
    TaskEntry,
)
from dsh_mesh.logstore import SqliteLogStore
from dsh_mesh.registry import (
    ActivationEnded,
    ActivationStarted,
    Directory,
    DirectoryEvent,
    Etcd,
    EtcdConfig,
    EtcdSessionStore,
    HeldIndex,
    Keys,
    LeaseConfig,
    LeaseKeeper,
    LeaseLost,
    NodeInfo,
    TreeStopped,
)
from dsh_mesh.registry._codec import decode_activation, encode_activation
from dsh_mesh.registry._etcd import delete, put
from dsh_mesh.registry._lease import WEDGED_TTLS
from dsh_mesh.registry._store import MAX_ENTRY_BYTES
from dsh_mesh.runtime import (
    DEFAULT_PAGE,
    Acceptance,
    AtWin,
    IdempotencyKey,
    LogStore,
    LruCache,
    Write,
)
from dsh_mesh.testing import EtcdAddress, EtcdServer, FaultyLogStore
from tests.integration.conftest import until_async

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


def contents(records: Sequence[Record]) -> list[tuple[int, str]]:
    return [(r.seq, getattr(r.entry, "content", "")) for r in records]


def failure(what: str) -> Callable[[], Awaitable[None]]:
    """A step before a log store call: the log store is unreachable."""

    async def fail() -> None:
        raise RegistryUnavailable(f"the log store is unreachable ({what})")

    return fail


async def fence_of(log: LogStore, session: SessionId) -> int:
    """The session's fence in the log store (raising it to 0 changes nothing)."""
    return await log.raise_fence(session, 0)


async def etcd_keys(etcd: Etcd, keys: Keys) -> int:
    """How many keys the mesh has in etcd (everything under its prefix)."""
    return int((await etcd.get_prefix(keys.prefix, count_only=True)).count)


@dataclass
class Node:
    """One node's view of the registry: its own etcd connection, lease, log store connection
    and store."""

    name: str
    etcd: Etcd
    keeper: LeaseKeeper
    log: FaultyLogStore
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
    log_path: Path,
    *,
    ttl: timedelta = LONG_TTL,
    directory: Directory | None = None,
    max_entry_bytes: int = MAX_ENTRY_BYTES,
) -> AsyncIterator[Node]:
    """A node with a granted (not kept alive) lease and a connection of its own to the SQLite
    log store at ``log_path``; the lease is revoked on exit."""
    async with connected(endpoint) as etcd, SqliteLogStore(log_path) as sqlite:
        keeper = LeaseKeeper(etcd, LeaseConfig(ttl=ttl))
        await keeper.grant()
        log = FaultyLogStore(sqlite)
        store = EtcdSessionStore(
            etcd,
            keys,
            log=log,
            lease=lambda: keeper.lease_id,
            directory=directory,
            max_entry_bytes=max_entry_bytes,
        )
        try:
            yield Node(name=name, etcd=etcd, keeper=keeper, log=log, store=store)
        finally:
            await store.aclose()
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


async def stored_activation(etcd: Etcd, keys: Keys, session: SessionId) -> tuple[Activation, int]:
    """The activation etcd holds for ``session`` and the lease it is bound to."""
    kv = await etcd.get(keys.activation(session))
    assert kv is not None, f"{session} has no activation in etcd"
    return decode_activation(kv.value), int(kv.lease)


async def create_revision(etcd: Etcd, keys: Keys, session: SessionId) -> int:
    """The create revision of ``session``'s activation key: its activation's fence."""
    kv = await etcd.get(keys.activation(session))
    assert kv is not None, f"{session} has no activation in etcd"
    return int(kv.create_revision)


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
        if isinstance(event, TreeStopped):
            return
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
def log_path(tmp_path: Path) -> Path:
    """The test's log store: one SQLite file every node of the test opens."""
    return tmp_path / "log.sqlite"


@pytest.fixture
async def node_a(etcd: EtcdAddress, keys: Keys, log_path: Path) -> AsyncIterator[Node]:
    async with node(etcd.endpoint, keys, "node-a", log_path) as running:
        yield running


@pytest.fixture
async def node_b(etcd: EtcdAddress, keys: Keys, log_path: Path) -> AsyncIterator[Node]:
    async with node(etcd.endpoint, keys, "node-b", log_path) as running:
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
    # The task is written first (to the log store), after the header's time was taken and
    # before the header itself: between the header's creation time and the next append.
    assert header.created_at <= created.recorded_at <= stored.recorded_at


async def test_activating_an_unknown_session_is_session_unknown_and_writes_nothing(
    node_a: Node, keys: Keys
) -> None:
    session = SessionId("s-ghost")
    with pytest.raises(SessionUnknown):
        await node_a.store.try_activate(node_a.activation(session))
    assert await node_a.etcd.get(keys.activation(session)) is None
    assert await node_a.store.current_activation(session) is None


async def test_a_try_whose_answer_was_lost_finds_its_own_key_and_is_won_with_the_fence_up(
    node_a: Node, node_b: Node
) -> None:
    """A try that won the key but never heard so (its answer lost, or its fence passed and its
    release failed) tries again: it finds its own key and takes it, fence raised, transcript
    read, so its writes land and a stale writer's do not."""
    session = SessionId("s-own-key")
    await node_a.store.create_header(root_header(session), [TaskEntry(content="Do it.")])
    mine = node_a.activation(session)
    key = node_a.store._keys.activation(session)
    # The won transaction, as if its answer never came back: the key is there, the fence not.
    await node_a.etcd.txn([], [put(key, encode_activation(mine), lease=node_a.lease)])
    resumed = await node_a.store.try_resume(mine)
    assert resumed.current == mine and contents(list(resumed.records)) == [(1, "Do it.")]
    record, _ = await node_a.store.append(session, prompt("mine"), writer=mine.activation_id)
    assert record.seq == 2
    with pytest.raises(ActivationFenced):
        await node_b.store.append(session, prompt("no one's"), writer=None)


async def test_a_session_created_active_has_header_and_activation_from_one_transaction(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    """ADR 0047 §14: the header, its indexes and the activation with its held marker appear
    at one revision, with no ``unstarted/`` key; the fence is up at that revision, so only
    the activation writes."""
    session = SessionId("s-created-active")
    mine = node_a.activation(session)
    assert await node_a.store.create_active(root_header(session), [prompt("task")], mine) == mine
    header_kv = await node_a.etcd.get(keys.header(session))
    activation_kv = await node_a.etcd.get(keys.activation(session))
    assert header_kv is not None and activation_kv is not None
    assert header_kv.create_revision == activation_kv.create_revision
    assert int(activation_kv.lease) == node_a.lease
    assert await node_a.etcd.get(keys.held_marker(node_a.lease, session, mine.activation_id))
    assert await node_a.etcd.get(keys.unstarted_session(session)) is None
    assert await fence_of(node_a.log, session) == activation_kv.create_revision
    assert await node_b.store.current_activation(session, fresh=True) == mine
    record, _ = await node_a.store.append(session, prompt("mine"), writer=mine.activation_id)
    assert record.seq == 2
    with pytest.raises(ActivationFenced):
        await node_b.store.append(session, prompt("no one's"), writer=None)
    assert contents(await node_b.store.read(session)) == [(1, "task"), (2, "mine")]
    # A child: under its parent's tree, live among its members with its parent's id.
    child = SessionId("s-created-active-child")
    theirs = node_b.activation(child, parent=mine.activation_id)
    assert await node_b.store.create_active(child_header(child, session), (), theirs) == theirs
    assert (await node_a.store.get_header(child)) == await node_b.store.get_header(child)
    member = await node_a.etcd.get(keys.live_member(session, child))
    assert member is not None and member.value == session.encode()
    assert await node_a.store.subtree(session) == [session, child]


async def test_creating_a_taken_id_active_is_session_exists_and_writes_nothing(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-taken-active")
    first = node_a.activation(session)
    await node_a.store.create_active(root_header(session), (), first)
    before = await etcd_keys(node_a.etcd, keys)
    for entries in ((), (prompt("another task"),)):
        with pytest.raises(SessionExists):
            await node_b.store.create_active(
                root_header(session), entries, node_b.activation(session)
            )
    assert await etcd_keys(node_a.etcd, keys) == before
    assert await node_b.store.current_activation(session, fresh=True) == first
    # A task-less root never adopts a transcript a cut creation of its id began.
    cut = SessionId("s-cut-creation")
    revision = (await node_a.etcd.range(keys.header(cut))).header.revision
    await node_a.log.append(cut, [Write(entry=prompt("orphan"))], fence=revision, unfenced=True)
    with pytest.raises(SessionExists):
        await node_a.store.create_active(root_header(cut), (), node_a.activation(cut))
    assert await node_a.etcd.get(keys.header(cut)) is None
    # A child under a parent deleted meanwhile (its header still cached here).
    parent = SessionId("s-gone-parent")
    await node_a.store.create_active(root_header(parent), (), node_a.activation(parent))
    await node_a.etcd.txn([], [delete(keys.header(parent))])
    orphan = SessionId("s-orphan")
    with pytest.raises(SessionUnknown):
        await node_a.store.create_active(
            child_header(orphan, parent), (), node_a.activation(orphan)
        )
    assert await node_a.etcd.get(keys.header(orphan)) is None


async def test_a_creation_whose_answer_was_lost_finds_its_own_key_and_is_won_with_the_fence_up(
    node_a: Node, node_b: Node, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folded transaction committed, its answer lost: sent again, its compares fail and
    read the key back. It is this activation's: won, fence raised at its revision."""
    session = SessionId("s-lost-answer")
    etcd = node_a.store._etcd
    real_txn = etcd.txn
    lost = 0

    async def answer_lost_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal lost
        response = await real_txn(*args, **kwargs)
        if lost == 0:
            lost += 1
            raise RegistryUnavailable("the answer was lost")
        return response

    mine = node_a.activation(session)
    monkeypatch.setattr(etcd, "txn", answer_lost_once)
    assert await node_a.store.create_active(root_header(session), (), mine) == mine
    monkeypatch.undo()
    assert lost == 1
    activation_kv = await node_a.etcd.get(keys.activation(session))
    assert activation_kv is not None
    assert await fence_of(node_a.log, session) == activation_kv.create_revision
    record, _ = await node_a.store.append(session, prompt("mine"), writer=mine.activation_id)
    assert record.seq == 1
    with pytest.raises(ActivationFenced):
        await node_b.store.append(session, prompt("no one's"), writer=None)
    # Every answer lost: the creation fails, yet its key is there. The node that made it
    # ends it all the same (its sweep does), and its marker stays for the session's reader.
    cut = SessionId("s-every-answer-lost")
    theirs = node_a.activation(cut)

    async def every_answer_lost(*args: Any, **kwargs: Any) -> Any:
        await real_txn(*args, **kwargs)
        raise RegistryUnavailable("the answer was lost")

    monkeypatch.setattr(etcd, "txn", every_answer_lost)
    with pytest.raises(RegistryUnavailable):
        await node_a.store.create_active(root_header(cut), (), theirs)
    monkeypatch.undo()
    assert await node_b.store.current_activation(cut, fresh=True) == theirs
    await node_a.store.release(theirs, clean=False)
    assert await node_b.store.current_activation(cut, fresh=True) is None
    assert await node_a.etcd.get(keys.held_marker(node_a.lease, cut, theirs.activation_id))
    await node_a.store.release(theirs, clean=False)  # again: nothing left to end


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


async def test_a_node_that_keeps_losing_races_keeps_a_bounded_memory_of_their_fences(
    node_a: Node, node_b: Node
) -> None:
    node_b.store._seen_fences = LruCache(3)  # SEEN_FENCES, made small to be reached
    winners = []
    for round_ in range(8):
        session = SessionId(f"s-lost-{round_}")
        await node_a.store.create_header(root_header(session))
        won = await node_a.store.try_activate(node_a.activation(session))
        assert await node_b.store.try_activate(node_b.activation(session)) == won
        winners.append(won)
    assert not node_b.store._fences  # its own: it won none
    assert len(node_b.store._seen_fences) == 3
    assert [w.activation_id in node_b.store._seen_fences for w in winners] == [False] * 5 + [
        True
    ] * 3


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

    # Concurrent appends of one writer still take distinct consecutive seqs, and each record
    # says what was stored under its seq. etcd holds nothing that grows with the transcript:
    # not one key more after eight more entries.
    in_etcd = await etcd_keys(node_a.etcd, keys)
    records = await asyncio.gather(
        *(node_a.store.append(session, prompt(f"c{i}"), writer=writer) for i in range(8))
    )
    assert sorted(r.seq for r, _ in records) == list(range(4, 12))
    stored = {r.seq: r for r in await node_b.store.read(session)}
    assert [stored[r.seq] for r, _ in records] == [r for r, _ in records]
    assert await etcd_keys(node_a.etcd, keys) == in_etcd

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
    # The second header and its index keys: created/, trees/, ns/ and ns-roots/, and its
    # unstarted/ key (it was never activated, ADR 0043).
    assert await etcd_keys(node_a.etcd, keys) == in_etcd + 6


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
    # The current writer is untouched: its next append is the next seq.
    record, _ = await node_a.store.append(session, prompt("next"), writer=current.activation_id)
    assert record.seq == 2


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
    requests, appends = (node_a.etcd.txns, node_a.etcd.reads), node_a.log.faults.calls["append"]
    again, known = await node_a.store.append(
        session, message("s-parent", "once"), writer=writer, idempotency=(key, asked)
    )
    assert (again, known) == (first, recorded)
    # The log store answers the known key in the append itself (it writes nothing): no etcd
    # request, no lookup first.
    assert (node_a.etcd.txns, node_a.etcd.reads) == requests
    assert (
        node_a.log.faults.calls["append"] == appends + 1 and node_a.log.faults.calls["lookup"] == 0
    )
    # The same from another node, which has nothing cached: one etcd read, for the writer's
    # fence.
    requests = (node_b.etcd.txns, node_b.etcd.reads)
    assert await node_b.store.append(
        session, message("s-parent", "once"), writer=writer, idempotency=(key, asked)
    ) == (first, recorded)
    assert (node_b.etcd.txns, node_b.etcd.reads) == (requests[0], requests[1] + 1)

    with pytest.raises(IdempotencyConflict):
        await node_a.store.append(
            session,
            message("s-parent", "another text"),
            writer=writer,
            idempotency=(key, acceptance(session, writer, "fp-2")),
        )
    assert contents(await node_b.store.read(session)) == [(1, "once"), (2, "something else")]
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

    # And back again: node a's new activation continues the transcript where node b left it.
    await node_b.store.release(second)
    third = await node_a.store.try_activate(node_a.activation(session))
    record, _ = await node_a.store.append(session, prompt("a again"), writer=third.activation_id)
    assert record.seq == 3


async def test_try_resume_wins_raises_the_fence_reads_and_then_appends_with_no_etcd_request(
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
    assert contents(resumed.records) == [(1, "on a"), (2, "on b")]
    # The win raised the log store's fence to the key's create revision before the read.
    assert await fence_of(node_b.log, session) == await create_revision(node_b.etcd, keys, session)
    # One etcd transaction (the win); the fence is cached, so the append costs no etcd request.
    record, _ = await node_a.store.append(session, prompt("a again"), writer=mine.activation_id)
    assert record.seq == 3
    assert (node_a.etcd.txns, node_a.etcd.reads) == (txns + 1, reads)
    assert await stored_activation(node_a.etcd, keys, session) == (mine, node_a.lease)

    # A held session: the holder comes back, and nothing is read, raised or written.
    calls = dict(node_b.log.faults.calls)
    lost = await node_b.store.try_resume(node_b.activation(session))
    assert lost.current == mine and lost.records == () and lost.known is None
    assert node_b.log.faults.calls == calls
    with pytest.raises(SessionUnknown):
        await node_b.store.try_resume(node_b.activation(SessionId("s-nobody")))


@pytest.mark.parametrize("failing", ["raise_fence", "read"])
async def test_a_resume_whose_log_store_fails_after_the_win_releases_the_activation_key(
    node_a: Node, node_b: Node, keys: Keys, failing: str
) -> None:
    session = SessionId("s-resume-fails")
    await node_a.store.create_header(root_header(session), [TaskEntry(content="task")])
    held_at_failure: list[Activation] = []

    async def fail_once_won() -> None:
        held_at_failure.append((await stored_activation(node_b.etcd, keys, session))[0])
        await failure(failing)()

    node_a.log.faults.before(failing, lambda call: fail_once_won())
    mine = node_a.activation(session)
    with pytest.raises(RegistryUnavailable):
        await node_a.store.try_resume(mine)
    assert held_at_failure == [mine]  # the key was won when the log store failed
    assert await node_b.etcd.get(keys.activation(session)) is None  # and it was let go
    with pytest.raises(ActivationFenced):  # node a does not believe it holds it either
        await node_a.store.append(session, prompt("a1"), writer=mine.activation_id)

    # No session is left held by nothing: another node wins it at once and runs it.
    theirs = node_b.activation(session)
    resumed = await node_b.store.try_resume(theirs)
    assert resumed.current == theirs
    assert contents(resumed.records) == [(1, "task")]
    record, _ = await node_b.store.append(session, prompt("b1"), writer=theirs.activation_id)
    assert record.seq == 2


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
    assert await node_b.store.read(session, after_seq=2, limit=3) == everything[2:5]

    # A transcript longer than a page is read whole, in pages of the log store's size: no
    # request or answer grows with the transcript.
    await asyncio.gather(
        *(node_a.store.append(session, prompt(f"n{i}"), writer=writer) for i in range(DEFAULT_PAGE))
    )
    reads = node_b.log.faults.calls["read"]
    whole = await node_b.store.read(session)
    assert [r.seq for r in whole] == list(range(1, DEFAULT_PAGE + 8))
    assert whole[:7] == everything
    assert node_b.log.faults.calls["read"] == reads + 2


async def test_an_entry_larger_than_the_stores_limit_is_refused_before_anything_is_written(
    etcd: EtcdAddress, node_a: Node, keys: Keys, log_path: Path
) -> None:
    session = SessionId("s-big")
    await node_a.store.create_header(root_header(session))
    writer = (await node_a.store.try_activate(node_a.activation(session))).activation_id
    await node_a.store.append(session, prompt("small"), writer=writer)

    # The largest entry the default limit admits goes in, with an idempotency record beside
    # it (the entry's other fields and the time it was written take under 256 bytes).
    fits = prompt("x" * (MAX_ENTRY_BYTES - 256))
    key = IdempotencyKey(principal="human", key="big")
    record, _ = await node_a.store.append(
        session, fits, writer=writer, idempotency=(key, acceptance(session, writer, "f"))
    )
    assert record.seq == 2

    requests, log_calls = (node_a.etcd.txns, node_a.etcd.reads), dict(node_a.log.faults.calls)
    for too_big in (
        prompt("y" * MAX_ENTRY_BYTES),
        # 256 Ki characters, each escaped to 6 bytes: within a message's character limit,
        # beyond the limit once encoded.
        message("s-parent", "\x01" * (256 * 1024)),
    ):
        with pytest.raises(InvalidArgument, match="limit"):
            await node_a.store.append(session, too_big, writer=writer)
    assert (node_a.etcd.txns, node_a.etcd.reads) == requests, "refused before any etcd request"
    assert node_a.log.faults.calls == log_calls, "an oversized entry must never reach the log store"
    assert [r.seq for r in await node_a.store.read(session)] == [1, 2]

    # The limit is the store's: etcd's request limit no longer bounds an entry (none goes
    # through etcd). A store that admits more writes an entry etcd could not have taken, and
    # etcd holds nothing of it.
    in_etcd = await etcd_keys(node_a.etcd, keys)
    lax_limit = 4 * MAX_ENTRY_BYTES
    async with node(etcd.endpoint, keys, "node-lax", log_path, max_entry_bytes=lax_limit) as lax:
        huge = prompt("z" * ETCD_MAX_REQUEST_BYTES)
        record, _ = await lax.store.append(session, huge, writer=writer)
        assert record.seq == 3
    assert await etcd_keys(node_a.etcd, keys) == in_etcd
    assert (await node_a.store.read(session, after_seq=2))[0].entry == huge
    async with node(etcd.endpoint, keys, "node-strict", log_path, max_entry_bytes=1024) as strict:
        with pytest.raises(InvalidArgument):
            await strict.store.append(session, prompt("w" * 1024), writer=writer)
        assert strict.log.faults.calls["append"] == 0
        record, _ = await strict.store.append(session, prompt("w" * 900), writer=writer)
        assert record.seq == 4
    with pytest.raises(ValueError, match="positive"):
        EtcdSessionStore(node_a.etcd, keys, log=node_a.log, lease=lambda: 0, max_entry_bytes=0)


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
    # Until a successor raises the fence, the zombie's appends (under its cached fence) still
    # land: they are in the transcript the successor reads (ADR 0026).
    record, _ = await node_a.store.append(session, prompt("a2"), writer=old.activation_id)
    assert record.seq == 2

    resumed = await node_b.store.try_resume(node_b.activation(session))
    assert resumed.current is not None and resumed.current.node_id == "node-b"
    assert contents(resumed.records) == [(1, "a1"), (2, "a2")]
    await assert_zombie_fenced(node_a, node_b, session, old, resumed.current)


async def test_sealing_an_absent_session_makes_a_refusal_exact(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    """Found by the 30-minute soak (issue 18): a parent's host lost its lease with a child's
    message still being appended there; the child's retry was refused PARENT_NOT_LIVE, and
    then the zombie's append landed. A node that is about to say "not live" seals the session
    first: the zombie's write landed before (and the key says so) or is refused after."""
    session = SessionId("s-sealed")
    await node_a.store.create_header(root_header(session))
    old = await node_a.store.try_activate(node_a.activation(session))
    await node_b.etcd.revoke(node_a.lease)  # the parent's host is lost; nobody resumes it
    assert await node_b.store.seal(session)
    with pytest.raises(ActivationFenced):  # the zombie's write in flight, after the seal
        await node_a.store.append(session, prompt("late"), writer=old.activation_id)
    assert await node_b.store.read(session) == []
    # A live session is not sealed: its activation writes on.
    current = await node_b.store.try_activate(node_b.activation(session))
    assert not await node_a.store.seal(session)
    record, _ = await node_b.store.append(session, prompt("live"), writer=current.activation_id)
    assert record.seq == 1


@pytest.mark.contract(3)
async def test_a_node_whose_lease_expired_can_never_append_again(
    etcd: EtcdAddress, node_b: Node, keys: Keys, log_path: Path
) -> None:
    session = SessionId("s-expired")
    async with node(etcd.endpoint, keys, "node-a", log_path, ttl=SHORTEST_TTL) as node_a:
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
    """After ``new`` was won (and so raised the fence), nothing ``old``'s node does lands or
    disturbs ``new``; ``new`` continues the transcript."""
    before = await successor.store.read(session)
    for attempt in ("z1", "z2"):
        with pytest.raises(ActivationFenced):
            await zombie.store.append(session, prompt(attempt), writer=old.activation_id)
    with pytest.raises(ActivationFenced):
        await zombie.store.append(session, prompt("z-none"), writer=None)
    with pytest.raises(ActivationFenced):
        await zombie.store.rebind(old, ActivationId("a-parent"))
    await zombie.store.release(old)  # must not end the successor's activation
    assert await successor.store.current_activation(session, fresh=True) == new

    for n in (1, 2):
        record, _ = await successor.store.append(session, prompt(f"b{n}"), writer=new.activation_id)
        assert record.seq == len(before) + n
    with pytest.raises(ActivationFenced):
        await zombie.store.append(session, prompt("z3"), writer=old.activation_id)
    assert contents(await zombie.store.read(session)) == [
        *contents(before),
        (len(before) + 1, "b1"),
        (len(before) + 2, "b2"),
    ]


async def test_a_zombie_with_a_cached_fence_is_refused_by_the_log_store_after_its_successor_resumed(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    """Node a believes it is current and never asks etcd again; the log store's fence alone
    refuses it, once node b's resume raised it."""
    session = SessionId("s-zombie-cached")
    await node_a.store.create_header(root_header(session), [TaskEntry(content="task")])
    old = (await node_a.store.try_resume(node_a.activation(session))).current
    assert old is not None
    await node_a.store.append(session, prompt("a1"), writer=old.activation_id)
    old_fence = await create_revision(node_a.etcd, keys, session)

    await node_b.etcd.revoke(node_a.lease)  # node a's activation ends in etcd; it is not told
    new = node_b.activation(session)
    resumed = await node_b.store.try_resume(new)
    assert resumed.current == new
    assert contents(resumed.records) == [(1, "task"), (2, "a1")]
    new_fence = await create_revision(node_b.etcd, keys, session)
    assert new_fence > old_fence
    assert await fence_of(node_b.log, session) == new_fence

    requests, appends = (node_a.etcd.txns, node_a.etcd.reads), node_a.log.faults.calls["append"]
    outcomes = await asyncio.gather(  # one group commit: one refused log-store transaction
        *(node_a.store.append(session, prompt(f"a{n}"), writer=old.activation_id) for n in (2, 3)),
        return_exceptions=True,
    )
    assert all(isinstance(o, ActivationFenced) for o in outcomes), outcomes
    assert (node_a.etcd.txns, node_a.etcd.reads) == requests  # node a never asked etcd
    assert node_a.log.faults.calls["append"] == appends + 1  # the log store refused the batch

    record, _ = await node_b.store.append(session, prompt("b1"), writer=new.activation_id)
    assert record.seq == 3
    assert contents(await node_b.store.read(session)) == [(1, "task"), (2, "a1"), (3, "b1")]


async def test_an_unfenced_write_is_refused_once_an_activation_raised_the_fence_past_its_read(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    """A writer with no activation carries the revision R of the etcd read that found the
    session without one; an activation won after R raises the fence above R before it reads,
    so the write either landed before (and is read) or is refused."""
    session = SessionId("s-unfenced")
    await node_a.store.create_header(root_header(session), [TaskEntry(content="task")])
    # Landed before any activation: the activation that follows reads it.
    await node_a.store.append(session, message("s-parent", "early"), writer=None)

    won = node_b.activation(session)

    async def activated_meanwhile() -> None:
        assert await node_b.store.try_activate(won) == won

    # Between node a's etcd read (no activation at R) and its log-store write, node b wins.
    node_a.log.faults.before("append", lambda call: activated_meanwhile())
    txns, appends = node_a.etcd.txns, node_a.log.faults.calls["append"]
    with pytest.raises(ActivationFenced):
        await node_a.store.append(session, message("s-parent", "late"), writer=None)
    # The one read (header and activation together) that found no activation.
    assert node_a.etcd.txns == txns + 1
    assert node_a.log.faults.calls["append"] == appends + 1  # refused by the log store's fence
    assert await fence_of(node_a.log, session) == await create_revision(node_a.etcd, keys, session)

    # Looking again, the writer finds the new activation (and would deliver to it).
    with pytest.raises(ActivationFenced, match="held by"):
        await node_a.store.append(session, message("s-parent", "late"), writer=None)
    assert contents(await node_b.store.read(session)) == [(1, "task"), (2, "early")]
    record, _ = await node_b.store.append(session, prompt("b1"), writer=won.activation_id)
    assert record.seq == 3


# -- creation: the task first, then the header and its indexes ------------------------------


async def cut_after_its_task(
    creator: Node, header: SessionHeader, entries: Sequence[TaskEntry]
) -> None:
    """Run ``creator``'s creation of ``header`` with ``entries`` until it dies: its etcd
    transaction (the header) fails, after the entries went to the log store."""
    with pytest.MonkeyPatch.context() as patch:

        async def cut(*_: object, **__: object) -> None:
            raise RegistryUnavailable("the node died before it wrote the header")

        patch.setattr(creator.etcd, "txn", cut)
        with pytest.raises(RegistryUnavailable):
            await creator.store.create_header(header, entries)


async def test_a_creation_cut_after_its_task_is_invisible_and_a_replay_completes_it_once(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    session = SessionId("s-cut")
    header, task = root_header(session), TaskEntry(content="Do it.")
    await cut_after_its_task(node_a, header, [task])
    # The task was written first, durably, under its creation keys ...
    assert node_a.log.faults.calls["append"] == 1
    assert contents(await node_b.log.read(session)) == [(1, "Do it.")]
    # ... and is invisible: no header, no listing or tree-index key, nothing to activate or
    # deliver to.
    assert await node_b.store.get_header(session) is None
    assert await etcd_keys(node_b.etcd, keys) == 0
    with pytest.raises(SessionUnknown):
        await node_b.store.try_activate(node_b.activation(session))
    with pytest.raises(SessionUnknown):
        await node_b.store.append(session, prompt("notice"), writer=None)

    # A replay of the same creation, on another node, finds its task by its keys and writes
    # only the header: seq 1 once.
    await node_b.store.create_header(header, [task])
    assert await node_a.store.get_header(session) == header
    assert contents(await node_a.store.read(session)) == [(1, "Do it.")]
    with pytest.raises(SessionExists):  # and once it is whole, a replay is a creation too many
        await node_a.store.create_header(header, [task])
    assert contents(await node_b.log.read(session)) == [(1, "Do it.")]
    activation = node_a.activation(session)
    resumed = await node_a.store.try_resume(activation)
    assert contents(resumed.records) == [(1, "Do it.")]


async def test_the_task_of_a_creation_cut_before_its_header_cannot_be_read(
    node_a: Node, node_b: Node
) -> None:
    session = SessionId("s-cut-read")
    await cut_after_its_task(node_a, root_header(session), [TaskEntry(content="Do it.")])
    assert await node_b.store.get_header(session) is None
    with pytest.raises(SessionUnknown):
        await node_b.store.read(session)


@pytest.mark.parametrize("same_task", [False, True], ids=["other-task", "same-task"])
async def test_a_creation_that_loses_the_session_to_another_request_leaves_nothing_of_its_own(
    node_a: Node, node_b: Node, same_task: bool
) -> None:
    """Two creations of one id: the creation keys of the task decide first (another task is
    refused there), the header's create-only write last (the same task with another header)."""
    session = SessionId("s-contested")
    mine = root_header(session)
    theirs = dataclasses.replace(mine, spec=SessionSpec(preset="other", model="other"))
    my_task = TaskEntry(content="Mine.")
    their_task = my_task if same_task else TaskEntry(content="Theirs.")

    async def theirs_first() -> None:
        await node_b.store.create_header(theirs, [their_task])

    # Node a has read that no header exists; node b's request then creates the session whole,
    # before node a's task (another task) or after it (the same task, so its keys match).
    plan = node_a.log.faults.after if same_task else node_a.log.faults.before
    other_request = plan("append", lambda call: theirs_first())
    with pytest.raises(SessionExists):
        await node_a.store.create_header(mine, [my_task])
    assert other_request.spent  # the other request did run
    header = await node_a.store.get_header(session)
    assert header is not None and header.spec == theirs.spec
    assert await node_a.store.read(session) == [Record(seq=1, entry=their_task)]


async def test_creating_a_session_indexes_it_in_the_listing_and_under_its_root(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    tree, kid, grandkid, other = (SessionId(s) for s in ("s-tree", "s-kid", "s-grandkid", "s-o"))
    await node_a.store.create_header(root_header(tree))
    await node_a.store.create_header(child_header(kid, tree), [TaskEntry(content="help")])
    # Node b has nothing cached: it learns the child's root from etcd.
    await node_b.store.create_header(child_header(grandkid, kid))
    await node_b.store.create_header(root_header(other))
    created = {}
    for session in (tree, kid, grandkid, other):
        stored = await node_a.store.get_header(session)
        assert stored is not None and stored.created_at is not None
        created[session] = stored.created_at

    listing = await node_b.etcd.get_prefix(keys.listing)
    assert [kv.key for kv in listing.kvs] == [
        keys.listed(created[s], s) for s in (tree, kid, grandkid, other)
    ]
    # The tree index of a root: every member in creation order, valued with its parent.
    members = await node_b.etcd.get_prefix(keys.tree(tree))
    assert [(kv.key, kv.value) for kv in members.kvs] == [
        (keys.member(tree, created[s], s), parent.encode())
        for s, parent in ((tree, ""), (kid, tree), (grandkid, kid))
    ]
    alone = await node_b.etcd.get_prefix(keys.tree(other))
    assert [kv.key for kv in alone.kvs] == [keys.member(other, created[other], other)]
    for session in (kid, grandkid):
        kv = await node_b.etcd.get(keys.root_of(session))
        assert kv is not None and kv.value == tree.encode()
    for root in (tree, other):  # a root records no root of its own
        assert await node_b.etcd.get(keys.root_of(root)) is None


# -- the lease keeper --------------------------------------------------------------------------


async def test_keep_raises_lease_lost_when_the_lease_is_revoked_elsewhere(
    etcd: EtcdAddress, node_b: Node, keys: Keys, log_path: Path
) -> None:
    async with node(etcd.endpoint, keys, "node-a", log_path, ttl=SHORTEST_TTL) as node_a:
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


def block_the_loop(seconds: float) -> None:
    """Run nothing else on the calling event loop for ``seconds``."""
    time.sleep(seconds)


async def test_a_node_whose_loop_is_busy_for_seconds_keeps_its_lease(
    etcd: EtcdAddress, keys: Keys, log_path: Path
) -> None:
    """A loop that answers nothing for more than the TTL (thousands of agents streaming at
    once) is slow, not gone: its keepalive thread refreshes the lease meanwhile."""
    async with node(etcd.endpoint, keys, "node-a", log_path, ttl=SHORTEST_TTL) as node_a:
        lease = node_a.lease
        keeping = asyncio.create_task(node_a.keeper.keep())
        await asyncio.sleep(0.1)  # the keeper has started
        block_the_loop(2.5 * SHORTEST_TTL.total_seconds())
        await asyncio.sleep(0.5)
        assert not keeping.done()
        assert await node_a.etcd.lease_alive(lease)
        assert node_a.keeper.lease_id == lease
        keeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await keeping


async def test_a_node_whose_loop_is_wedged_loses_its_lease(
    etcd: EtcdAddress, keys: Keys, log_path: Path
) -> None:
    """A loop that makes no progress for WEDGED_TTLS TTLs is gone: the lease is no longer
    refreshed, etcd expires it (its agents are resumed elsewhere) and, once the loop runs
    again, the node knows it is fenced."""
    ttl = SHORTEST_TTL.total_seconds()
    async with node(etcd.endpoint, keys, "node-a", log_path, ttl=SHORTEST_TTL) as node_a:
        lease = node_a.lease
        keeping = asyncio.create_task(node_a.keeper.keep())
        await asyncio.sleep(0.1)
        block_the_loop((WEDGED_TTLS + 2) * ttl)
        assert not await node_a.etcd.lease_alive(lease)
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(keeping, WAIT)
        assert not node_a.keeper.held


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
    etcd: EtcdAddress, node_b: Node, keys: Keys, log_path: Path
) -> None:
    async with node(etcd.endpoint, keys, "node-a", log_path, ttl=SHORTEST_TTL) as node_a:
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
    etcd_server: EtcdServer, log_path: Path
) -> None:
    keys = fresh_keys()
    endpoint = etcd_server.endpoint
    async with (
        node(endpoint, keys, "node-a", log_path) as node_a,
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
            async with connected(endpoint) as etcd_c, SqliteLogStore(log_path) as log_c:
                keeper = LeaseKeeper(etcd_c, LeaseConfig(ttl=LONG_TTL))
                await keeper.grant()  # outlives this client; the server goes with the test
                store_c = EtcdSessionStore(etcd_c, keys, log=log_c, lease=lambda: keeper.lease_id)
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
    node_a: Node, keys: Keys, etcd: EtcdAddress, log_path: Path
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
            async with connected(etcd.endpoint) as etcd_c, SqliteLogStore(log_path) as log_c:
                keeper = LeaseKeeper(etcd_c, LeaseConfig(ttl=LONG_TTL))
                lease_c = await keeper.grant()
                store_c = EtcdSessionStore(
                    etcd_c, keys, log=log_c, lease=lambda: keeper.lease_id, directory=directory
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


async def test_a_trees_census_counts_live_children_with_their_activations_and_recent_members(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    root, kid, grandkid = SessionId("s-census"), SessionId("s-kid"), SessionId("s-grandkid")
    await node_a.store.create_header(root_header(root))
    await node_a.store.create_header(child_header(kid, root))
    await node_a.store.create_header(child_header(grandkid, kid))
    long_ago = datetime.now(UTC) - timedelta(days=1)

    async def census(store: EtcdSessionStore) -> tuple[str, int, int]:
        counted = await store.tree_census(grandkid, since=long_ago)
        return counted.root, counted.live_descendants, counted.created_since

    assert await census(node_b.store) == (root, 0, 3)  # any node, any member: the same tree
    await node_a.store.try_activate(node_a.activation(root))  # a root is not its descendant
    first = await node_a.store.try_activate(node_a.activation(kid))
    await node_b.store.try_activate(node_b.activation(grandkid))
    assert await census(node_b.store) == (root, 2, 3)
    assert (await node_a.store.tree_census(root, since=datetime.now(UTC))).created_since == 0
    await node_a.store.release(first)  # the live key goes with the activation
    assert await census(node_a.store) == (root, 1, 3)
    await node_b.keeper.revoke()  # node b dies: its lease takes both of its keys
    assert await census(node_a.store) == (root, 0, 3)
    assert await node_a.etcd.get(keys.live_member(root, grandkid)) is None


# -- the held index (ADR 0043) ------------------------------------------------------------------


async def held_markers(node: Node, keys: Keys, lease: int) -> list[Activation | None]:
    return [m.activation for m in await HeldIndex(node.etcd, keys).markers(lease)]


async def test_an_activation_is_held_until_it_ends_cleanly_and_a_session_unstarted_until_won(
    node_a: Node, keys: Keys
) -> None:
    held = HeldIndex(node_a.etcd, keys)
    settles, drains = SessionId("s-settles"), SessionId("s-drains")
    for session in (settles, drains):
        await node_a.store.create_header(root_header(session))
    assert sorted(u.session for u in await held.unstarted()) == [drains, settles]
    first = await node_a.store.try_activate(node_a.activation(settles))
    second = await node_a.store.try_activate(node_a.activation(drains))
    assert [u.session for u in await held.unstarted()] == []
    assert sorted(
        (a.activation_id for a in await held_markers(node_a, keys, node_a.lease) if a),
    ) == sorted([first.activation_id, second.activation_id])
    await node_a.store.release(first)  # settled, its notice delivered
    await node_a.store.release(second, clean=False)  # drained: what it left is owed
    assert await held_markers(node_a, keys, node_a.lease) == [second]
    marker = await held.marker_of(node_a.lease, second)
    assert marker is not None
    await held.forget(marker)
    assert await held_markers(node_a, keys, node_a.lease) == []


async def test_a_dead_leases_markers_outlive_it_and_its_holder_retires_once_they_are_swept(
    etcd: EtcdAddress, keys: Keys, log_path: Path
) -> None:
    async with node(etcd.endpoint, keys, "n-dies", log_path) as dying:
        held = HeldIndex(dying.etcd, keys)
        await held.register(dying.lease, NodeId("n-dies"))
        session = SessionId("s-orphan")
        await dying.store.create_header(root_header(session))
        won = await dying.store.try_activate(dying.activation(session))
        assert await held.alive(dying.lease)
        lease = dying.lease
    # The node is gone (its lease revoked): the activation went with it, the marker did not.
    async with connected(etcd.endpoint) as client:
        held = HeldIndex(client, keys)
        assert await client.get(keys.activation(session)) is None
        assert not await held.alive(lease)
        (holder,) = await held.holders()
        assert (holder.lease, holder.node_id) == (lease, "n-dies")
        assert not await held.retire(holder)  # its marker is not swept yet
        (marker,) = await held.markers(lease)
        assert marker.activation == won
        await held.forget(marker)
        assert await held.retire(holder)
        assert await held.holders() == []


async def test_a_parent_adopts_its_live_children_by_its_own_activation_only_while_current(
    node_a: Node, node_b: Node, keys: Keys
) -> None:
    parent, child, other = SessionId("s-p"), SessionId("s-c"), SessionId("s-o")
    await node_a.store.create_header(root_header(parent))
    await node_a.store.create_header(child_header(child, parent))
    await node_a.store.create_header(child_header(other, parent))
    old = await node_a.store.try_activate(node_a.activation(parent))
    on_b = await node_b.store.try_activate(node_b.activation(child, parent=old.activation_id))
    await node_a.store.release(old, clean=False)  # the parent's host went away
    new = await node_a.store.try_activate(node_a.activation(parent))
    assert await node_a.store.live_children(parent) == [on_b]
    (adopted,) = await node_a.store.adopt_children(new)
    assert adopted == on_b.rebound(new.activation_id)
    stored, lease = await stored_activation(node_b.etcd, keys, child)
    assert stored == adopted and lease == node_b.lease  # it still ends with the child's node
    assert await node_a.store.adopt_children(new) == [adopted]  # bound already: unchanged
    assert (await stored_activation(node_b.etcd, keys, child))[0] == adopted
    # A parent activation that is no longer current re-binds nothing.
    await node_a.store.release(new)
    with pytest.raises(ActivationFenced):
        await node_a.store.adopt_children(new)
    newest = await node_b.store.try_activate(node_b.activation(parent))
    stale = dataclasses.replace(newest, activation_id=ActivationId("a-stale"))
    with pytest.raises(ActivationFenced):
        await node_b.store.adopt_children(stale)
    assert (await stored_activation(node_b.etcd, keys, child))[0] == adopted


async def test_a_resume_reads_its_parent_and_whether_it_has_live_children_with_its_win(
    node_a: Node, node_b: Node
) -> None:
    parent, child, leaf = SessionId("s-p"), SessionId("s-c"), SessionId("s-l")
    await node_a.store.create_header(root_header(parent))
    await node_a.store.create_header(child_header(child, parent))
    await node_a.store.create_header(child_header(leaf, child))
    first = await node_a.store.try_activate(node_a.activation(parent))
    await node_a.store.release(first)
    # A root with no child live: no parent, none to adopt, known from the win alone.
    resumed = await node_a.store.try_resume(node_a.activation(parent))
    assert resumed.at_win == AtWin(parent=None, live_children=False)
    # A child: its parent's activation at the win; its own child live on another node.
    on_b = await node_b.store.try_activate(node_b.activation(leaf))
    assert on_b.session_id == leaf
    resumed_child = await node_a.store.try_resume(node_a.activation(child))
    assert resumed_child.at_win == AtWin(parent=resumed.current, live_children=True)
