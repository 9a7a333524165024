"""The agent loop: Steer at step boundaries, Queue for humans, interrupt, waking admission."""

from __future__ import annotations

import asyncio

import pytest

from dsh_mesh.agent import AgentState
from dsh_mesh.core import (
    AgentMessageEntry,
    ConsumedEntry,
    DeliveryKind,
    HumanPromptEntry,
    Record,
    Role,
    SessionId,
    SettlementNoticeEntry,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
)
from dsh_mesh.models import PARENT, Reply, send, tool
from dsh_mesh.testing import FaultySessionStore, InProcessMesh, in_process_mesh, writing
from tests.unit.conftest import GateTool, drain_loop, of_type, presets

ROOT = SessionId("s-1")
CHILD = SessionId("s-2")


async def start_root_with_worker(mesh: InProcessMesh) -> None:
    mesh.scripted.program("lead", tool("spawn_agent", task="Do the work.", preset="worker"))
    await mesh.manager.create_root("Lead.", preset="lead")
    await mesh.manager.wait_until(lambda: mesh.manager.agent(CHILD) is not None)


@pytest.mark.contract(3)
@pytest.mark.contract(9)
async def test_running_target_reads_steered_messages_at_next_step_boundary_in_fifo_order(
    mesh: InProcessMesh, gate_tool: GateTool
) -> None:
    mesh.scripted.program("worker", tool("wait"), Reply(text="read them"))
    await start_root_with_worker(mesh)
    root = mesh.manager.agent(ROOT)
    assert root is not None
    await gate_tool.entered.wait()

    first = await mesh.manager.send_message(root.ref, CHILD, "first")
    second = await mesh.manager.send_message(root.ref, CHILD, "second")
    assert (first.kind, second.kind) == (DeliveryKind.STEERED, DeliveryKind.STEERED)
    assert first.accepted_seq < second.accepted_seq

    gate_tool.gate.set()
    await mesh.manager.quiescent()
    step_two = mesh.recorder.requests_of(CHILD)[1].messages
    assert [m.role for m in step_two[-3:]] == [Role.TOOL, Role.USER, Role.USER]
    assert step_two[-3].content == "waited"
    assert step_two[-2].content == f"Agent {ROOT} sent a message:\nfirst"
    assert step_two[-1].content == f"Agent {ROOT} sent a message:\nsecond"
    # Both were read inside the running turn: the child ran exactly one turn.
    records = await mesh.transcript(CHILD)
    assert len(of_type(records, TurnStartedEntry)) == 1


@pytest.mark.contract(9)
async def test_step_boundary_comes_after_every_tool_result_of_the_step(
    mesh: InProcessMesh, gate_tool: GateTool
) -> None:
    mesh.scripted.program("worker", tool("wait"), Reply())
    mesh.scripted.program(
        "lead", tool("spawn_agent", task="t", preset="worker"), send("s-2", "mid-step")
    )
    await mesh.manager.create_root("Lead.", preset="lead")
    await gate_tool.entered.wait()
    root_records = await mesh.transcript(ROOT)
    await mesh.manager.wait_until(
        lambda: len(of_type(list(mesh.manager.agent(ROOT).records), ToolResultEntry)) >= 2  # type: ignore[union-attr]
    )
    gate_tool.gate.set()
    await mesh.manager.quiescent()
    records = await mesh.transcript(CHILD)
    kinds = [type(r.entry).__name__ for r in records]
    message_seq = of_type(records, AgentMessageEntry)[0].seq
    consumed = [r for r in of_type(records, ConsumedEntry) if message_seq in r.entry.seqs]  # type: ignore[union-attr]
    result = of_type(records, ToolResultEntry)[0]
    # Accepted while the tool ran, consumed only after its result was recorded.
    assert message_seq < result.seq < consumed[0].seq, kinds
    assert root_records  # the root ran its spawn step


@pytest.mark.contract(3)
async def test_idle_target_starts_a_turn(mesh: InProcessMesh) -> None:
    release = asyncio.Event()
    mesh.scripted.program("worker", send(PARENT, "done", gate=release), Reply())
    await start_root_with_worker(mesh)
    root = mesh.manager.agent(ROOT)
    assert root is not None
    await mesh.manager.wait_until(lambda: root.state is AgentState.IDLE and root.turns_run == 1)

    release.set()
    await mesh.manager.quiescent()
    child_results = of_type(await mesh.transcript(CHILD), ToolResultEntry)
    assert '"delivered": "started-turn"' in child_results[0].entry.content  # type: ignore[union-attr]
    root_records = await mesh.transcript(ROOT)
    message = of_type(root_records, AgentMessageEntry)[0]
    second_turn = of_type(root_records, TurnStartedEntry)[1]
    assert second_turn.seq > message.seq
    first_consumed_after = next(
        r for r in of_type(root_records, ConsumedEntry) if r.seq > second_turn.seq
    )
    assert message.seq in first_consumed_after.entry.seqs  # type: ignore[union-attr]


@pytest.mark.contract(11)
async def test_each_human_prompt_is_its_own_turn_never_merged_into_a_running_one(
    mesh: InProcessMesh,
) -> None:
    hold = asyncio.Event()
    mesh.scripted.program("lead", Reply(text="busy", gate=hold), Reply(text="a"), Reply(text="b"))
    ref = await mesh.manager.create_root("Start.", preset="lead")
    await mesh.scripted.wait_for_call(ref.session_id, 1)
    one = await mesh.manager.submit_prompt(ref.session_id, "prompt one")
    two = await mesh.manager.submit_prompt(ref.session_id, "prompt two")
    assert one.kind is DeliveryKind.STEERED  # accepted while running; read in a turn of its own
    hold.set()
    await mesh.manager.quiescent()

    records = await mesh.transcript(ref.session_id)
    turns = _turns(records)
    assert len(turns) == 3
    consumed_per_turn = [
        [s for r in turn if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs]
        for turn in turns
    ]
    assert consumed_per_turn[1] == [one.accepted_seq]
    assert consumed_per_turn[2] == [two.accepted_seq]
    assert all(
        one.accepted_seq not in c and two.accepted_seq not in c for c in consumed_per_turn[:1]
    )


@pytest.mark.contract(11)
async def test_interrupt_cancels_the_current_turn_and_records_it_cancelled(
    mesh: InProcessMesh,
) -> None:
    never = asyncio.Event()
    mesh.scripted.program("lead", Reply(gate=never), Reply(text="back"))
    ref = await mesh.manager.create_root("Start.", preset="lead")
    await mesh.scripted.wait_for_call(ref.session_id, 1)

    turn = mesh.manager.interrupt(ref.session_id)
    assert turn is not None
    await mesh.manager.quiescent()
    records = await mesh.transcript(ref.session_id)
    ended = of_type(records, TurnEndedEntry)
    assert [(e.entry.turn_id, e.entry.outcome) for e in ended] == [(turn, TurnOutcome.CANCELLED)]  # type: ignore[union-attr]
    assert mesh.manager.interrupt(ref.session_id) is None  # idle: nothing to cancel

    # The agent lives on and takes the next prompt in a new turn.
    await mesh.manager.submit_prompt(ref.session_id, "again")
    await mesh.manager.quiescent()
    last = of_type(await mesh.transcript(ref.session_id), TurnEndedEntry)[-1]
    assert last.entry.outcome is TurnOutcome.COMPLETED  # type: ignore[union-attr]


@pytest.mark.contract(10)
@pytest.mark.contract(11)
async def test_interrupt_mid_tool_call_keeps_accepted_messages_and_closes_the_call(
    mesh: InProcessMesh, gate_tool: GateTool
) -> None:
    mesh.scripted.program("worker", tool("wait"), Reply(text="after interrupt"))
    mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="worker"), Reply())
    await mesh.manager.create_root("Lead.", preset="lead")
    await gate_tool.entered.wait()
    root = mesh.manager.agent(ROOT)
    assert root is not None
    await mesh.manager.wait_until(lambda: root.state is AgentState.IDLE)
    accepted = await mesh.manager.send_message(root.ref, CHILD, "keep me")
    assert mesh.manager.interrupt(CHILD) is not None
    await mesh.manager.quiescent()

    records = await mesh.transcript(CHILD)
    results = of_type(records, ToolResultEntry)
    assert results[0].entry.is_error and "not completed" in results[0].entry.content  # type: ignore[union-attr]
    outcomes = [r.entry.outcome for r in of_type(records, TurnEndedEntry)]  # type: ignore[union-attr]
    assert outcomes == [TurnOutcome.CANCELLED, TurnOutcome.COMPLETED]
    consumed = [s for r in of_type(records, ConsumedEntry) for s in r.entry.seqs]  # type: ignore[union-attr]
    assert accepted.accepted_seq in consumed  # the accepted message was read, not retracted


@pytest.mark.contract(4)
async def test_target_cannot_settle_between_admission_and_inbox_insertion() -> None:
    """Force the interleaving: a send is admitted (waking counted), its durable append is held,
    and meanwhile the target finishes its only turn with an empty inbox. It must not settle."""
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(AgentMessageEntry))
    finish = asyncio.Event()
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        mesh.scripted.program("helper", Reply(text="first turn", gate=finish), Reply(text="read"))
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.scripted.wait_for_call(CHILD, 1)
        root = mesh.manager.agent(ROOT)
        child = mesh.manager.agent(CHILD)
        assert root is not None and child is not None
        activation = child.activation.activation_id

        send = asyncio.create_task(mesh.manager.send_message(root.ref, CHILD, "late"))
        await held.reached.wait()
        finish.set()  # the child's turn can now end while the send is in flight
        await drain_loop()
        assert child.state is not AgentState.SETTLED
        current = await store.current_activation(CHILD)
        assert current is not None and current.activation_id == activation

        held.release.set()
        delivery = await send
        await mesh.manager.quiescent()
        assert delivery.target_activation == activation
        # Admitted while the child was running: it extends that turn instead of starting one.
        assert delivery.kind is DeliveryKind.STEERED
        child_records = await mesh.transcript(CHILD)
        consumed = [s for r in of_type(child_records, ConsumedEntry) for s in r.entry.seqs]  # type: ignore[union-attr]
        assert delivery.accepted_seq in consumed
        assert len(of_type(child_records, TurnStartedEntry)) == 1
        notices = of_type(await mesh.transcript(ROOT), SettlementNoticeEntry)
        assert len(notices) == 1
        assert notices[0].entry.child_activation == activation  # type: ignore[union-attr]


def _turns(records: list[Record]) -> list[list[Record]]:
    turns: list[list[Record]] = []
    for record in records:
        if isinstance(record.entry, TurnStartedEntry):
            turns.append([])
        if turns:
            turns[-1].append(record)
    return turns


def test_human_prompt_entries_are_queue_delivery() -> None:
    from dsh_mesh.agent import Inbox

    inbox = Inbox()
    inbox.put(Record(seq=1, entry=HumanPromptEntry(content="a")))
    inbox.put(Record(seq=2, entry=HumanPromptEntry(content="b")))
    assert [r.seq for r in inbox.take_turn_input()] == [1]
    assert inbox.take_steered() == []
    assert [r.seq for r in inbox.take_turn_input()] == [2]
