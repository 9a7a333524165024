"""A root is created whole: its header and its task are one durable write.

Found by the wire fuzzer and the fault runs: a node that died after writing a root's header and
before appending its task left a root without its task; the retry of its ``CreateRootSession``
compared that empty transcript with its task and was refused ``IDEMPOTENCY_CONFLICT``, so the
root never ran. Now ``create_header`` writes the header with the task, so a root exists with
its task or not at all, and a replay whose root has no activation and an unread task makes it
resident, so its first turn runs (exactly once).

``created_whole`` states the store contract; tests/integration/test_root_creation.py holds the
etcd store to it too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import pytest

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import (
    Activation,
    ActivationId,
    ConsumedEntry,
    NodeId,
    Record,
    RegistryUnavailable,
    RejectionReason,
    SequentialIds,
    SessionExists,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    TaskEntry,
    TurnStartedEntry,
)
from dsh_mesh.models import RecordingProvider, Reply, ScriptedProvider
from dsh_mesh.runtime import (
    ContinuationManager,
    HistoryLog,
    InMemorySessionStore,
    ManagerConfig,
    RecordingStore,
)
from dsh_mesh.testing import (
    FaultySessionStore,
    Proceed,
    StoreCall,
    agent_sends,
    check,
    load_node_history,
    writers_of,
)
from dsh_mesh.transport._control import MeshControlService, root_session_id
from dsh_mesh.transport._peers import PeerPool
from tests.conftest import created_whole, root_header
from tests.unit.conftest import StoreReads, answer, create, of_type, presets

TASK = "The first task."
ROOT = root_session_id("r")


def dies_after_creation(*, won: bool = False) -> FaultySessionStore:
    """The creating node dies once its root's creation is durable: its first ``try_activate``
    raises, before (``won=False``) or after (``won=True``) the activation was won, and so does
    its release of that activation. Later calls, from whichever node, behave."""
    store = FaultySessionStore()
    died = RegistryUnavailable("the creating node died")
    store.faults.fail("try_activate", died, landed=won)
    store.faults.fail("release", died)  # its last attempt to let go of what it may have won
    return store


@asynccontextmanager
async def node(
    store: InMemorySessionStore, name: str, *, stale_lookup: bool = False
) -> AsyncIterator[tuple[ContinuationManager, MeshControlService, ScriptedProvider]]:
    """One node on ``store``: a manager (ids of its own) and its control plane. With
    ``stale_lookup`` the control plane's activation lookup answers "none" (a view a moment
    behind another node's win)."""
    scripted = ScriptedProvider()
    async with ContinuationManager(
        store=store,
        provider=RecordingProvider(scripted),
        presets=presets(),
        config=ManagerConfig(node_id=NodeId(name)),
        ids=SequentialIds(prefix=f"{name}-"),
    ) as manager:

        async def current(session: SessionId, *, fresh: bool = False) -> Activation | None:
            return None if stale_lookup else await store.current_activation(session)

        service = MeshControlService(
            lambda: manager,
            node_id=manager.node_id,
            reads=StoreReads(store),
            current_activation=current,
            peers=PeerPool(node_id=manager.node_id, credential=None, address_of=lambda _: None),
        )
        yield manager, service, scripted


def ran_once(records: list[Record]) -> bool:
    """The transcript holds its task once, at seq 1, and one step read it."""
    tasks = of_type(records, TaskEntry)
    read = [s for r in of_type(records, ConsumedEntry) for s in r.entry.seqs]  # type: ignore[union-attr]
    return (
        [r.seq for r in tasks] == [1]
        and read.count(1) == 1
        and any(isinstance(r.entry, TurnStartedEntry) for r in records)
    )


# -- the store contract ---------------------------------------------------------------------------


async def test_the_in_memory_store_creates_a_session_with_its_first_entries() -> None:
    store = InMemorySessionStore()
    await created_whole(store, SessionId("s-whole"))
    assert store.writes == 3  # the two created entries and the append
    await store.create_header(root_header(SessionId("s-bare")))
    assert await store.read(SessionId("s-bare")) == []


# -- the manager ----------------------------------------------------------------------------------


async def test_a_roots_header_and_task_are_one_write() -> None:
    store = dies_after_creation()
    async with node(store, "node-1") as (manager, _, _):
        refused = await answer_of(manager.create_root(TASK, preset="lead", session_id=ROOT))
    assert isinstance(refused, RegistryUnavailable)
    assert await store.get_header(ROOT) is not None
    assert await store.read(ROOT) == [Record(seq=1, entry=TaskEntry(content=TASK))]
    assert await store.current_activation(ROOT) is None


async def test_a_root_created_with_an_empty_task_is_created_without_entries() -> None:
    store = dies_after_creation()
    async with node(store, "node-1") as (manager, _, _):
        await answer_of(manager.create_root("", preset="lead", session_id=ROOT))
    assert await store.get_header(ROOT) is not None
    assert await store.read(ROOT) == []


async def test_a_creation_that_won_but_lost_its_answer_is_run_by_its_own_node_unasked() -> None:
    # Its node lives on (so no lease lapses), etcd was away a moment (the answer and the
    # release after it both lost), and no client replays the creation: the node's sweep ends
    # the activation it won unknowingly and resumes the root, whose task then runs.
    store = dies_after_creation(won=True)
    async with node(store, "node-1") as (manager, _, scripted):
        scripted.program("lead", Reply(text="read it"))
        refused = await answer_of(manager.create_root(TASK, preset="lead", session_id=ROOT))
        assert isinstance(refused, RegistryUnavailable)
        [ended] = manager.unfinished()
        held = await store.current_activation(ROOT)
        assert held is not None and held.activation_id == ended.activation_id
        assert await manager.finish(ended)  # what the sweep does with it
        manager.finished(ended)
        await manager.quiescent()
        assert scripted.calls_started(ROOT) == 1
    assert ran_once(await store.read(ROOT))
    # Refused by the compares (an id taken), a creation leaves nothing unfinished.
    async with node(store, "node-2") as (manager, _, _):
        with pytest.raises(SessionExists):
            await manager.create_root(TASK, preset="lead", session_id=ROOT)
        assert manager.unfinished() == []


async def answer_of(creating: Awaitable[object]) -> object:
    """What the creation came to: its result, or the outage that cut it."""
    try:
        return await creating
    except RegistryUnavailable as refused:
        return refused


# -- CreateRootSession replayed ---------------------------------------------------------------


async def test_a_replay_after_the_creating_node_died_runs_the_root_once() -> None:
    store = dies_after_creation()
    async with node(store, "node-1") as (_, first_node, _):
        assert await answer(first_node, create(TASK)) is RejectionReason.REGISTRY_UNAVAILABLE
    async with node(store, "node-2") as (manager, service, scripted):
        scripted.program("lead", Reply(text="read it"))
        replay = await answer(service, create(TASK))
        assert isinstance(replay, mesh_pb2.CreateRootSessionResponse)
        await manager.quiescent()
        again = await answer(service, create(TASK))  # a replay of a running root: found
        await manager.quiescent()
        assert scripted.calls_started(ROOT) == 1
    current = await store.current_activation(ROOT)
    assert current is not None
    assert (replay.session_id, replay.node_id, replay.activation_id) == (
        ROOT,
        "node-2",
        current.activation_id,
    )
    assert again == replay
    assert ran_once(await store.read(ROOT))


async def test_a_replay_resumes_a_root_whose_creator_died_holding_it_once_that_lapsed() -> None:
    store = dies_after_creation(won=True)
    async with node(store, "node-1") as (_, first_node, _):
        assert await answer(first_node, create(TASK)) is RejectionReason.REGISTRY_UNAVAILABLE
    held = await store.current_activation(ROOT)
    assert held is not None and held.node_id == "node-1"
    async with node(store, "node-2") as (manager, service, scripted):
        scripted.program("lead", Reply(text="read it"))
        while_held = await answer(service, create(TASK))
        assert isinstance(while_held, mesh_pb2.CreateRootSessionResponse)
        assert (while_held.node_id, while_held.activation_id) == ("node-1", held.activation_id)
        await store.release(held)  # node-1's lease lapsed
        replay = await answer(service, create(TASK))
        await manager.quiescent()
        assert scripted.calls_started(ROOT) == 1
    assert isinstance(replay, mesh_pb2.CreateRootSessionResponse)
    assert replay.node_id == "node-2"
    assert ran_once(await store.read(ROOT))


async def test_a_replay_that_loses_the_resume_to_another_node_reports_that_node() -> None:
    store = dies_after_creation()
    async with node(store, "node-1") as (_, first_node, _):
        assert await answer(first_node, create(TASK)) is RejectionReason.REGISTRY_UNAVAILABLE
    winner = Activation(session_id=ROOT, activation_id=ActivationId("a-3"), node_id=NodeId("n-3"))
    assert await store.try_activate(winner) == winner  # node-3's retry got there first
    async with node(store, "node-2", stale_lookup=True) as (manager, service, scripted):
        replay = await answer(service, create(TASK))
        assert manager.agent(ROOT) is None
        assert scripted.calls_started(ROOT) == 0
    assert isinstance(replay, mesh_pb2.CreateRootSessionResponse)
    assert (replay.session_id, replay.node_id, replay.activation_id) == (ROOT, "n-3", "a-3")


def resumed_elsewhere_first() -> FaultySessionStore:
    """Between a creation's write and its activation, a replay on node n-3 resumes the root."""
    store = FaultySessionStore()

    async def n3_first(call: StoreCall, proceed: Proceed) -> object:
        activation = cast(Activation, call.arguments["activation"])
        winner = Activation(
            session_id=activation.session_id,
            activation_id=ActivationId("a-3"),
            node_id=NodeId("n-3"),
        )
        await store.try_activate(winner)  # the fault is spent: this call meets none
        return await proceed()

    store.faults.around("try_activate", n3_first)
    return store


async def test_a_creation_whose_root_another_node_resumed_first_reports_that_node() -> None:
    store = resumed_elsewhere_first()
    async with node(store, "node-1") as (manager, service, scripted):
        created = await answer(service, create(TASK))
        assert manager.agent(ROOT) is None
        assert scripted.calls_started(ROOT) == 0
    assert isinstance(created, mesh_pb2.CreateRootSessionResponse)
    assert (created.session_id, created.node_id, created.activation_id) == (ROOT, "n-3", "a-3")
    assert await store.read(ROOT) == [Record(seq=1, entry=TaskEntry(content=TASK))]


async def test_an_empty_task_root_replayed_with_a_task_is_still_an_idempotency_conflict() -> None:
    # The earlier fix (07b8e94, reverted) finished any root without entries with the replay's
    # task, so a root created with an empty task took the task of a replay with another one.
    store = dies_after_creation()
    async with node(store, "node-1") as (_, first_node, _):
        assert await answer(first_node, create("")) is RejectionReason.REGISTRY_UNAVAILABLE
    async with node(store, "node-2") as (manager, service, _):
        same = await answer(service, create(""))
        other = await answer(service, create(TASK))
        assert manager.agent(ROOT) is None  # nothing to read: it stays idle and absent
    assert isinstance(same, mesh_pb2.CreateRootSessionResponse)
    assert (same.session_id, same.node_id, same.activation_id) == (ROOT, "", "")
    assert other is RejectionReason.IDEMPOTENCY_CONFLICT
    assert await store.read(ROOT) == []


async def test_a_header_without_its_task_from_old_code_stays_an_idempotency_conflict() -> None:
    # What a node running the old code left when it died between its two writes: it cannot be
    # told apart from a root created with an empty task, so only an empty task finds it.
    store = InMemorySessionStore()
    async with node(store, "node-2") as (manager, service, _):
        header = SessionHeader(
            session_id=ROOT,
            kind=SessionKind.ROOT,
            parent_session=None,
            spec=SessionSpec(preset="lead", model=manager.default_model("lead")),
        )
        await store.create_header(header)
        assert await answer(service, create(TASK)) is RejectionReason.IDEMPOTENCY_CONFLICT
        found = await answer(service, create(""))
    assert isinstance(found, mesh_pb2.CreateRootSessionResponse) and found.session_id == ROOT


# -- the history --------------------------------------------------------------------------------


async def test_creation_writes_are_recorded_unfenced_and_a_run_checks_clean(tmp_path: Path) -> None:
    path = tmp_path / "node-1.jsonl"
    inner = InMemorySessionStore()
    scripted = ScriptedProvider(programs={"lead": (Reply(text="read it"),)})
    with HistoryLog(path, node="node-1") as log:
        async with ContinuationManager(
            store=RecordingStore(inner, log),
            provider=scripted,
            presets=presets(),
            ids=SequentialIds(),
        ) as manager:
            ref = await manager.create_root(TASK, preset="lead")
            await manager.quiescent()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    wrote = [(e["seq"], e["writer"], e["entry"]) for e in lines if e["op"] == "wrote"]
    assert wrote[0] == (1, None, "TaskEntry")  # written with the header: no activation yet
    assert all(writer == ref.activation_id for _, writer, _ in wrote[1:])
    history = load_node_history([path])
    transcripts = {ref.session_id: await inner.read(ref.session_id)}
    verdict = check(agent_sends(transcripts, writers_of(history)), transcripts, history)
    assert verdict.clean, verdict.summary()
    assert verdict.unattributed_writes == 0
