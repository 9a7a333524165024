"""What an ended activation owes (ADR 0043), in process: its notice as the child's durable
transcript tells it (whoever writes it), an absent parent woken to read a notice, an absent
session with unread entries resumed, a parent's live children adopted at its resume, and a
node's ledger of notices forgetting a parent that left."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import cast

from dsh_mesh.core import (
    Activation,
    ActivationId,
    AssistantStepEntry,
    ConsumedEntry,
    Entry,
    HumanPromptEntry,
    NodeId,
    Record,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolCall,
    ToolResultEntry,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    Usage,
)
from dsh_mesh.models import Reply, Stall, tool
from dsh_mesh.node._sweep import Sweep
from dsh_mesh.registry import HeldIndex
from dsh_mesh.runtime import InMemorySessionStore
from dsh_mesh.runtime._children import ChildLedger
from dsh_mesh.runtime._notices import derived_notice
from dsh_mesh.testing import FaultySessionStore, in_process_mesh
from tests.unit.conftest import CHILD, ROOT, presets

CHILD_HEADER = SessionHeader(
    session_id=SessionId("s-child"),
    kind=SessionKind.CONTINUABLE_CHILD,
    parent_session=SessionId("s-root"),
    spec=SessionSpec(preset="helper", model="m"),
)
GONE = Activation(
    session_id=SessionId("s-child"), activation_id=ActivationId("a-gone"), node_id=NodeId("n-1")
)
LATER = ActivationId("a-later")


def records(*entries: Entry) -> list[Record]:
    return [Record(seq=n, entry=e) for n, e in enumerate(entries, 1)]


def started(turn: str, activation: ActivationId = GONE.activation_id) -> TurnStartedEntry:
    return TurnStartedEntry(turn_id=TurnId(turn), node_id=NodeId("n-1"), activation_id=activation)


def step(text: str, *calls: tuple[str, str]) -> AssistantStepEntry:
    return AssistantStepEntry(
        text=text,
        tool_calls=tuple(
            ToolCall(call_id=call_id, name=name, arguments_json="{}") for call_id, name in calls
        ),
        usage=Usage(),
    )


def test_an_activation_whose_last_turn_ended_reports_that_turn_and_its_last_text() -> None:
    notice = derived_notice(
        CHILD_HEADER,
        GONE,
        records(
            TaskEntry(content="t"),
            started("t-1"),
            step("first finding"),
            TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.COMPLETED),
            started("t-2"),
            step("", ("c-1", "search")),
            ToolResultEntry(call_id="c-1", name="search", content="x"),
            TurnEndedEntry(turn_id=TurnId("t-2"), outcome=TurnOutcome.ERROR, detail="boom"),
        ),
    )
    assert notice is not None
    assert (notice.outcome, notice.terminal_output, notice.detail) == (
        SettlementOutcome.ERROR,
        "first finding",
        "boom",
    )
    assert (notice.child_session, notice.child_activation) == ("s-child", "a-gone")


def test_an_activation_lost_mid_turn_is_lost_and_names_the_calls_its_last_step_left_open() -> None:
    notice = derived_notice(
        CHILD_HEADER,
        GONE,
        records(
            started("t-1"),
            step("halfway", ("c-1", "send_message"), ("c-2", "search")),
            ToolResultEntry(call_id="c-2", name="search", content="x"),
            # the next activation ended the dead one's turn as lost after answering nothing
            started("t-3", LATER),
        ),
    )
    assert notice is not None and notice.outcome is SettlementOutcome.LOST
    assert notice.terminal_output == "halfway"
    assert notice.detail.startswith("host n-1 went away; its last step left 1 call(s) open")
    assert "(send_message)" in notice.detail and "after this notice" in notice.detail


def test_a_turn_ended_lost_or_awaiting_approval_is_reported_lost() -> None:
    for outcome, says in (
        (TurnOutcome.LOST, "host n-1 went away"),
        (TurnOutcome.AWAITING_APPROVAL, "while a call waited for a person's decision"),
    ):
        notice = derived_notice(
            CHILD_HEADER,
            GONE,
            records(started("t-1"), TurnEndedEntry(turn_id=TurnId("t-1"), outcome=outcome)),
        )
        assert notice is not None and notice.outcome is SettlementOutcome.LOST
        assert says in notice.detail


def test_an_activation_that_ran_no_turn_reports_nothing() -> None:
    assert derived_notice(CHILD_HEADER, GONE, records(TaskEntry(content="t"))) is None
    assert derived_notice(CHILD_HEADER, GONE, records(started("t-1", LATER))) is None


def test_the_ledger_forgets_a_parent_that_left_and_keeps_nothing_for_parents_elsewhere() -> None:
    here = {SessionId("s-here")}
    ledger = ChildLedger(is_resident=lambda session: session in here)
    ledger.track(SessionId("s-here"), SessionId("s-c"), ActivationId("a-c"))
    ledger.settled(SessionId("s-here"), SessionId("s-c"), ActivationId("a-c"))
    ledger.settled(SessionId("s-away"), SessionId("s-d"), ActivationId("a-d"))
    assert ledger.noticed(ActivationId("a-c")) and not ledger.noticed(ActivationId("a-d"))
    ledger.forget(SessionId("s-here"))
    assert not ledger.noticed(ActivationId("a-c"))


async def test_a_notice_to_an_absent_parent_wakes_it_to_read_the_notice() -> None:
    store = InMemorySessionStore()
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"), Reply())
        mesh.scripted.program("helper", Reply(text="found it"))
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.quiescent()
        root = await store.current_activation(ROOT)
        assert root is not None  # a root stays resident
    # The root's node went away with the root; a notice for its child arrives afterwards.
    await store.release(root, clean=False)
    async with in_process_mesh(presets(), store=store) as other:
        other.scripted.program("lead", Reply(text="read the notice"))
        notice = SettlementNoticeEntry(
            child_session=CHILD,
            child_activation=ActivationId("a-late"),
            child_kind=SessionKind.CONTINUABLE_CHILD,
            outcome=SettlementOutcome.COMPLETED,
            terminal_output="late finding",
        )
        await other.manager.deliver_notice(ROOT, notice)
        await other.manager.quiescent()
        transcript = await store.read(ROOT)
    [seq] = [r.seq for r in transcript if r.entry == notice]
    read = {s for r in transcript if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
    assert seq in read  # woken and read, not left for whoever speaks to it next


async def test_an_absent_session_left_with_an_unread_prompt_is_resumed_and_reads_it() -> None:
    store = InMemorySessionStore()
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", Reply(text="first"), Reply(text="second"))
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.quiescent()
        gone = await store.current_activation(ROOT)
        assert gone is not None
        # Accepted, then its host died before a step read it.
        await store.append(
            ROOT, HumanPromptEntry(content="are you there?"), writer=gone.activation_id
        )
    await store.release(gone, clean=False)
    async with in_process_mesh(presets(), store=store) as other:
        other.scripted.program("lead", Reply(text="here"))
        assert await other.manager.recover(gone)
        await other.manager.quiescent()
        transcript = await store.read(ROOT)
    prompt = next(r.seq for r in transcript if isinstance(r.entry, HumanPromptEntry))
    read = {s for r in transcript if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
    assert prompt in read


async def test_a_resumed_parent_whose_adoption_failed_adopts_its_children_at_the_next_sweep() -> (
    None
):
    store = FaultySessionStore()
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        mesh.scripted.program("helper", Stall())
        await mesh.manager.create_root("Delegate.", preset="lead")
        await mesh.manager.wait_until(lambda: mesh.manager.running(CHILD) is True)
        gone = await store.current_activation(ROOT)
        assert gone is not None
    # The root's host died; its child lives on (its own host); etcd fails the adoption once.
    await store.release(gone, clean=False)
    store.faults.fail("adopt_children", RegistryUnavailable("etcd went away"), times=1)
    async with in_process_mesh(presets(), store=store) as other:
        other.scripted.program("lead", Reply(text="waiting for my helper"))
        assert await other.manager.recover(gone)  # it needs a reader: its live child
        await other.manager.quiescent()
        moved = await store.current_activation(ROOT)
        child = await store.current_activation(CHILD)
        assert moved is not None and child is not None
        assert child.parent_activation == gone.activation_id  # not adopted: etcd failed it

        assert await other.manager.adopt_again() == 1  # what the next sweep does
        child = await store.current_activation(CHILD)
        assert child is not None and child.parent_activation == moved.activation_id
        assert await other.manager.adopt_again() == 0  # nothing left to adopt


def test_one_live_node_and_only_one_sweeps_each_dead_lease() -> None:
    nodes = [NodeId(f"node-{n}") for n in "abc"]
    sweeps = [
        Sweep(
            cast(HeldIndex, None),
            node_id=node,
            interval=timedelta(seconds=2),
            live_nodes=lambda: nodes,
        )
        for node in nodes
    ]
    chosen: Counter[NodeId] = Counter()
    for lease in range(0x1000, 0x1000 + 60):
        (sweeper,) = [
            node for node, s in zip(nodes, sweeps, strict=True) if s.chooses(f"{lease:x}")
        ]
        chosen[sweeper] += 1
    assert set(chosen) == set(nodes)  # spread over the nodes, each lease to one of them
    # A node that does not see the others yet sweeps what it ranks first for (harmless twice).
    alone = Sweep(
        cast(HeldIndex, None), node_id=nodes[0], interval=timedelta(1), live_nodes=lambda: ()
    )
    assert all(alone.chooses(f"{lease:x}") for lease in range(10))


async def test_a_session_woken_again_and_again_is_backed_off_not_resumed_in_a_loop() -> None:
    store = InMemorySessionStore()
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", Reply(text="first"))
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.quiescent()
        gone = await store.current_activation(ROOT)
        assert gone is not None
        await store.append(ROOT, HumanPromptEntry(content="unread"), writer=gone.activation_id)
    await store.release(gone, clean=False)
    async with in_process_mesh(presets(), store=store) as other:
        other.scripted.program("lead", Reply(text="read"))
        assert await other.manager.recover(gone)  # woken at once
        await other.manager.quiescent()
        again = await store.current_activation(ROOT)
        assert again is not None
        await store.append(ROOT, HumanPromptEntry(content="unread too"), writer=again.activation_id)
        await store.release(again, clean=False)
        # Its next end, moments later, waits out the back-off: the marker stays for later.
        assert not await other.manager.recover(again)


async def test_an_ended_roots_activation_costs_a_node_no_read() -> None:
    # A node with 100,000 resident roots dies: every other node sees that many activations
    # end at once, and none of them is a child whose parent waits here.
    store = FaultySessionStore()
    async with in_process_mesh(presets(), store=store) as mesh:
        store.faults.calls.clear()
        for n in range(100):
            await mesh.manager.activation_ended(
                Activation(
                    session_id=SessionId(f"s-root-{n}"),
                    activation_id=ActivationId(f"a-{n}"),
                    node_id=NodeId("node-gone"),
                )
            )
        assert sum(store.faults.calls.values()) == 0
