"""Waking admission (contract rule 4) has one owner: every path of a send releases its hold on
the target exactly once."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from dsh_mesh.core import (
    Aborted,
    Activation,
    ActivationId,
    DetachedWork,
    HumanPromptEntry,
    InboxFull,
    NodeId,
    NodeOverloaded,
    Record,
    SessionId,
    TargetElsewhere,
    TaskEntry,
)
from dsh_mesh.models import Reply
from dsh_mesh.runtime._admission import AdmissionLedger, Reservation
from dsh_mesh.testing import FaultySessionStore, InProcessMesh, in_process_mesh, writing
from tests.unit.conftest import presets

T = SessionId("s-9")


def ledger(releases: Counter[SessionId], *, inbox: int = 10, inflight: int = 10) -> AdmissionLedger:
    def released(target: SessionId) -> None:
        releases[target] += 1

    return AdmissionLedger(
        node_id=NodeId("n-1"),
        max_inflight=inflight,
        max_inbox_depth=inbox,
        on_release=released,
    )


def record(seq: int) -> Record:
    return Record(seq=seq, entry=TaskEntry(content="t"))


def test_an_accepted_send_holds_its_target_until_the_driver_admits_the_record() -> None:
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)
    with book.reserve(T) as reservation:
        accepting = reservation.hand_over()
    assert not book.may_settle(T)  # the caller's block ended; the acceptance holds it now
    with accepting:
        accepting.admit_on(7)
    assert releases[T] == 0 and not book.may_settle(T)
    assert book.only_awaiting_admission(T)
    book.admitted(T, [record(6), record(7)])
    book.admitted(T, [record(7)])  # admitted again (a re-read): no second release
    assert releases[T] == 1 and book.may_settle(T) and book.idle()


@pytest.mark.parametrize(
    "refusal",
    [
        InboxFull("full"),
        TargetElsewhere.held_by(T, "n-2", "a-1"),  # its cold resume was lost to another node
        Aborted("the caller's signal"),
    ],
)
def test_a_refused_send_releases_once(refusal: Exception) -> None:
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)
    with pytest.raises(type(refusal)), book.reserve(T):
        raise refusal
    assert releases[T] == 1 and book.may_settle(T)


def test_a_forwarded_send_releases_once_when_its_hand_off_returns() -> None:
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)
    with book.reserve(T):
        pass  # handed to the node that hosts the target, which answered
    assert releases[T] == 1 and book.may_settle(T)


async def test_a_send_cancelled_before_acceptance_releases_once() -> None:
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)
    waiting = asyncio.Event()

    async def send() -> None:
        with book.reserve(T):
            waiting.set()
            await asyncio.Event().wait()  # a cold resume that takes long

    task = asyncio.create_task(send())
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert releases[T] == 1 and book.may_settle(T)


async def test_a_send_cancelled_after_its_hand_over_is_released_by_the_admission_alone() -> None:
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)
    appended = asyncio.Event()
    handed: list[Reservation] = []

    async def accept(reservation: Reservation) -> None:
        with reservation:
            await appended.wait()
            reservation.admit_on(3)

    async def send() -> None:
        with book.reserve(T) as reservation:
            accepting = asyncio.ensure_future(accept(reservation.hand_over()))
            handed.append(reservation)
            await asyncio.shield(accepting)

    caller = asyncio.create_task(send())
    await asyncio.sleep(0)
    caller.cancel()  # the sender goes away after the point of no return
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert releases[T] == 0 and not book.may_settle(T)
    appended.set()
    await asyncio.sleep(0)
    book.admitted(T, [record(3)])
    assert releases[T] == 1 and book.may_settle(T)
    assert handed[0].released is False  # the caller's hold was handed over, not released


@pytest.mark.parametrize("cancelled_before_it_ran", [True, False])
async def test_a_hold_handed_to_work_is_released_once_however_the_work_ends(
    cancelled_before_it_ran: bool,
) -> None:
    """Work cancelled before its first step never enters its block: its task's end releases
    the hold instead (at shutdown); work that ran released it itself, and nothing twice."""
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)

    async def accept(reservation: Reservation) -> None:
        with reservation:
            await asyncio.sleep(0)

    with book.reserve(T) as reservation:
        handed = reservation.hand_over()
        task = asyncio.get_running_loop().create_task(accept(handed))
        handed.ends_with(task)
    if cancelled_before_it_ran:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        await task
    await asyncio.sleep(0)  # the task's done callbacks
    assert releases[T] == 1 and book.may_settle(T)


@pytest.mark.parametrize("cancelled_before_it_ran", [True, False])
async def test_a_hold_handed_to_detached_work_is_released_once(
    cancelled_before_it_ran: bool,
) -> None:
    """``hand_to`` as the send and notice paths use it: the owner's shutdown cancels the work
    before its first step, or the work runs and releases the hold itself; one release."""
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)
    work = DetachedWork()

    async def accept(reservation: Reservation) -> str:
        with reservation:
            await asyncio.sleep(0)
        return "accepted"

    async def send() -> str:
        with book.reserve(T) as reservation:
            return await reservation.hand_to(work, accept)

    caller = asyncio.create_task(send())
    await asyncio.sleep(0)  # the caller handed its hold over; the work has not run yet
    assert releases[T] == 0 and len(work) == 1
    if cancelled_before_it_ran:
        work.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
    else:
        assert await caller == "accepted"
    await work.wait()
    await asyncio.sleep(0)  # the task's done callbacks
    assert releases[T] == 1 and book.may_settle(T)


def test_an_acceptance_that_delivered_nothing_releases_when_its_block_ends() -> None:
    releases: Counter[SessionId] = Counter()
    book = ledger(releases)
    with book.reserve(T) as reservation, reservation.hand_over():
        pass  # a retry's answer: the record was delivered by the try it repeats
    assert releases[T] == 1 and book.may_settle(T)


def test_a_hold_is_handed_over_or_bound_once() -> None:
    book = ledger(Counter())
    with book.reserve(T) as reservation:
        reservation.hand_over()
        with pytest.raises(RuntimeError):
            reservation.hand_over()
        with pytest.raises(RuntimeError):
            reservation.admit_on(1)


def test_the_inbox_limit_counts_the_send_being_reserved() -> None:
    book = ledger(Counter(), inbox=2)
    with book.reserve(T), book.reserve(T):
        assert book.check_inbox(T) is None
        with book.reserve(T):
            full = book.check_inbox(T)
            assert isinstance(full, InboxFull)
            assert full.metadata["target_session_id"] == T
    assert book.idle()


def test_the_in_flight_limit_refuses_one_more_and_frees_on_exit() -> None:
    book = ledger(Counter(), inflight=1)
    with book.in_flight():
        with pytest.raises(NodeOverloaded) as refused, book.in_flight():
            pass
        assert refused.value.metadata["limit"] == "inflight_sends"
    with book.in_flight():
        pass


# -- the same paths through a real manager ----------------------------------------------------


async def test_every_send_path_leaves_no_hold_behind(mesh: InProcessMesh) -> None:
    manager = mesh.manager
    mesh.scripted.program("lead", Reply(text="ok"))
    root = await manager.create_root("Lead.", preset="lead")
    await manager.quiescent()
    # accepted: a prompt starts a turn; its hold ends when the driver admits it
    await manager.submit_prompt(root.session_id, "again", idempotency_key="k-1")
    await manager.quiescent()
    assert manager.waking(root.session_id) == 0
    # resume lost to another node: another node holds the target's activation
    other = SessionId("s-77")
    header = await manager.header(root.session_id)
    await mesh.store.create_header(dataclasses.replace(header, session_id=other))
    far = Activation(session_id=other, activation_id=ActivationId("a-far"), node_id=NodeId("far"))
    await mesh.store.try_activate(far)
    with pytest.raises(TargetElsewhere):
        await manager.submit_prompt(other, "hello", idempotency_key="k-2")
    assert manager.waking(other) == 0
    await manager.quiescent()


# -- shutdown leaves nothing running ----------------------------------------------------------


async def test_nothing_the_manager_started_runs_after_its_shutdown() -> None:
    """A running turn, a send held mid-acceptance (detached work) and an idle agent: after
    ``shutdown()`` and the end of the block, no task the manager started is left."""
    before = asyncio.all_tasks()
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(HumanPromptEntry))
    async with in_process_mesh(presets(), store=store) as mesh:
        manager = mesh.manager
        mesh.scripted.program("lead", Reply(text="working", gate=asyncio.Event()))
        root = await manager.create_root("Lead.", preset="lead")
        await mesh.scripted.wait_for_call(root.session_id, 1)
        sending = asyncio.create_task(
            manager.submit_prompt(root.session_id, "more", idempotency_key="k")
        )
        await held.reached.wait()  # the acceptance is under way, detached
        assert manager.detached_work >= 1
        manager.shutdown()
        manager.shutdown()  # idempotent
    assert manager.detached_work == 0
    assert manager.waking(root.session_id) == 0
    assert sending.done()
    if not sending.cancelled():
        sending.exception()  # it ended (cancelled or refused): nothing left to retrieve
    left = {t for t in asyncio.all_tasks() - before if not t.done()}
    assert left == set()
