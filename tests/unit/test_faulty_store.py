"""dsh_mesh.testing's faulty stores: every call passes through unchanged unless a planned
fault meets it, and each fault meets the calls it was planned for, in the order planned."""

from __future__ import annotations

import asyncio

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationId,
    HumanPromptEntry,
    NodeId,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    TaskEntry,
)
from dsh_mesh.logstore import MemoryLogStore
from dsh_mesh.runtime import LogStore
from dsh_mesh.testing import FaultyLogStore, FaultySessionStore, StoreCall, writing
from tests.logstore_conformance import LogStoreConformance, S, contents, task

SESSION = SessionId("s-1")


@pytest.fixture
def store() -> LogStore:
    return FaultyLogStore(MemoryLogStore())


class TestConformanceThroughFaultyLogStore(LogStoreConformance):
    """With no fault planned, the wrapper is the store it wraps."""


async def created(store: FaultySessionStore, *entries: TaskEntry) -> None:
    header = SessionHeader(
        session_id=SESSION,
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset="lead", model="m"),
    )
    await store.create_header(header, entries)


def prompt(content: str) -> HumanPromptEntry:
    return HumanPromptEntry(content=content)


async def test_a_failure_before_writes_nothing_and_one_landed_writes_and_loses_its_answer() -> None:
    store = FaultySessionStore()
    await created(store)
    store.faults.fail("append", RegistryUnavailable("away"))
    store.faults.fail("append", RegistryUnavailable("answer lost"), landed=True)
    with pytest.raises(RegistryUnavailable, match="away"):
        await store.append(SESSION, prompt("a"), writer=None)
    with pytest.raises(RegistryUnavailable, match="answer lost"):
        await store.append(SESSION, prompt("b"), writer=None)
    await store.append(SESSION, prompt("c"), writer=None)  # both faults are spent
    assert [r.entry for r in await store.read(SESSION)] == [prompt("b"), prompt("c")]
    assert store.faults.calls["append"] == 3


async def test_a_fault_meets_only_the_calls_it_matches_and_as_many_as_planned() -> None:
    store = FaultySessionStore()
    await created(store)
    fault = store.faults.fail(
        "append", RegistryUnavailable("away"), when=writing(TaskEntry), times=2
    )
    await store.append(SESSION, prompt("not a task"), writer=None)
    message = TaskEntry(content="t")
    for _ in range(2):
        with pytest.raises(RegistryUnavailable):
            await store.append(SESSION, message, writer=None)
    await store.append(SESSION, message, writer=None)
    assert fault.met == 2 and fault.spent
    assert len(await store.read(SESSION)) == 2


async def test_a_withdrawn_fault_meets_no_more_calls_and_lets_a_later_one_meet_them() -> None:
    store = FaultySessionStore()
    await created(store)
    every = store.faults.fail("append", RegistryUnavailable("away"), times=None)
    held = store.faults.hold("append", landed=True)
    with pytest.raises(RegistryUnavailable):
        await store.append(SESSION, prompt("a"), writer=None)
    store.faults.withdraw(every)
    held.release.set()
    await store.append(SESSION, prompt("b"), writer=None)
    assert every.met == 1 and held.left == 1


async def test_a_creations_entries_meet_the_faults_planned_for_appends() -> None:
    # As a subclass's would: the in-memory store writes a creation's entries by appending.
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(TaskEntry))
    creating = asyncio.create_task(created(store, TaskEntry(content="t")))
    await held.reached.wait()
    assert await store.get_header(SESSION) is not None and await store.read(SESSION) == []
    held.release.set()
    await creating
    assert [r.entry for r in await store.read(SESSION)] == [TaskEntry(content="t")]
    assert held.left == 1


async def test_a_hold_after_landing_keeps_the_answer_not_the_write() -> None:
    store = FaultySessionStore()
    await created(store)
    held = store.faults.hold("append", landed=True)
    appending = asyncio.create_task(store.append(SESSION, prompt("a"), writer=None))
    await held.reached.wait()
    assert len(await store.read(SESSION)) == 1 and not appending.done()
    held.release.set()
    record, _ = await appending
    assert record.seq == 1


async def test_a_step_around_a_call_may_act_on_the_store_itself() -> None:
    store = FaultySessionStore()
    await created(store)
    theirs = Activation(session_id=SESSION, activation_id=ActivationId("a-9"), node_id=NodeId("n"))

    async def someone_else_first(call: StoreCall, proceed: object) -> Activation:
        await store.try_activate(theirs)  # the fault is spent: this call meets none
        return await store.try_activate(Activation(**vars(call.arguments["activation"])))

    store.faults.around("try_activate", someone_else_first)
    mine = Activation(session_id=SESSION, activation_id=ActivationId("a-1"), node_id=NodeId("n"))
    assert await store.try_activate(mine) == theirs
    assert store.faults.calls["try_activate"] == 3


async def test_the_log_store_wrapper_counts_and_fails_calls_of_the_store_it_wraps() -> None:
    log = FaultyLogStore(MemoryLogStore())
    log.faults.fail("append", RegistryUnavailable("away"), landed=True)
    with pytest.raises(RegistryUnavailable):
        await log.append(S, [task("a")], fence=0, unfenced=True)
    assert contents(await log.inner.read(S)) == ["a"]
    assert log.faults.calls == {"append": 1}
