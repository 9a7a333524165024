"""An etcd outage at a step boundary: the running turn waits there and goes on when the
registry answers again, with every entry of the turn written exactly once, also when the write
that met the outage had landed before its answer was lost."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from dsh_mesh.core import (
    AgentMessageEntry,
    AgentRef,
    AssistantStepEntry,
    ConsumedEntry,
    Entry,
    Record,
    RegistryUnavailable,
    SettlementNoticeEntry,
    SettlementOutcome,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.models import Reply, tool
from dsh_mesh.testing import Fault, FaultySessionStore, InProcessMesh, in_process_mesh, writing
from tests.unit.conftest import CHILD, ROOT, presets

OWN_WRITES: tuple[type[Entry], ...] = (ConsumedEntry, AssistantStepEntry, TurnEndedEntry)


@dataclass(frozen=True)
class Outage:
    """A store and the outage planned in it."""

    store: FaultySessionStore
    faults: list[Fault]

    def over(self) -> bool:
        """Every write of the outage failed."""
        return all(fault.spent for fault in self.faults)


def outage(*landed: bool, under: tuple[type[Entry], ...] = OWN_WRITES) -> Outage:
    """etcd goes away under writes of the kinds ``under`` (the agent's own writes unless told
    otherwise): each append in the outage fails with ``RegistryUnavailable``, after landing
    (``True``: the answer was lost) or not (``False``)."""
    store = FaultySessionStore()
    away = RegistryUnavailable("etcd is away")
    faults = [
        store.faults.fail("append", away, landed=lands, when=writing(*under)) for lands in landed
    ]
    return Outage(store, faults)


async def test_a_turn_waits_out_an_outage_at_its_step_boundary_and_writes_each_entry_once() -> None:
    away = outage(True, False, True, False, False)
    store = away.store
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", tool("no_such_tool"), Reply(text="done"))
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.quiescent()
        agent = mesh.manager.agent(ref.session_id)
        assert agent is not None and agent.activation.activation_id == ref.activation_id
        kinds = [type(r.entry).__name__ for r in await mesh.transcript(ref.session_id)]
    assert away.over()
    assert kinds == [
        "TaskEntry",
        "TurnStartedEntry",
        "ConsumedEntry",
        "AssistantStepEntry",
        "ToolResultEntry",
        "AssistantStepEntry",
        "TurnEndedEntry",
    ]
    ended = [
        r.entry for r in await store.read(ref.session_id) if isinstance(r.entry, TurnEndedEntry)
    ]
    assert [e.outcome for e in ended] == [TurnOutcome.COMPLETED]


async def child_mid_step(mesh: InProcessMesh, gate: asyncio.Event) -> AgentRef:
    """A root whose continuable child is in its first step until ``gate`` opens (a message
    then extends its turn); returns the root."""
    mesh.scripted.program(
        "lead", tool("spawn_agent", task="t", preset="helper"), Reply(text="delegated")
    )
    mesh.scripted.program("helper", Reply(gate=gate), Reply(text="read it"))
    ref = await mesh.manager.create_root("Lead.", preset="lead")
    await mesh.scripted.wait_for_call(CHILD, 1)
    return ref


def consumed(records: list[Record]) -> set[int]:
    return {seq for r in records if isinstance(r.entry, ConsumedEntry) for seq in r.entry.seqs}


async def test_a_send_whose_answer_was_lost_reaches_the_resident_target_on_its_retry() -> None:
    """The first try landed, its answer did not: the retry (same key) gets that acceptance,
    and the running target reads the message, in this activation, once."""
    store = outage(True, under=(AgentMessageEntry,)).store
    async with in_process_mesh(presets(), store=store) as mesh:
        gate = asyncio.Event()
        ref = await child_mid_step(mesh, gate)
        with pytest.raises(RegistryUnavailable):
            await mesh.manager.send_message(ref, CHILD, "hello", idempotency_key="k1")
        retried = await mesh.manager.send_message(ref, CHILD, "hello", idempotency_key="k1")
        assert retried.duplicate
        gate.set()
        await mesh.manager.quiescent()
        records = await mesh.transcript(CHILD)
    [message] = [r for r in records if isinstance(r.entry, AgentMessageEntry)]
    assert message.seq in consumed(records)
    assert mesh.scripted.calls_started(CHILD) == 2  # the message extended the child's turn


async def test_a_settlement_notice_waits_out_an_outage_and_arrives_once() -> None:
    """The child completed; etcd is away when its notice is written (twice before landing,
    once landing with its answer lost). The parent gets one ``completed`` notice and reads
    it; no ``lost`` one follows."""
    away = outage(False, True, False, under=(SettlementNoticeEntry,))
    store = away.store
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program(
            "lead", tool("spawn_agent", task="t", preset="helper"), Reply(text="delegated"),
            Reply(text="merged"),
        )  # fmt: skip
        mesh.scripted.program("helper", Reply(text="the answer"))
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.wait_until(away.over)
        await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)
        assert mesh.manager.agent(CHILD) is None
    notices = [r for r in records if isinstance(r.entry, SettlementNoticeEntry)]
    assert [
        (n.entry.outcome, n.entry.terminal_output)
        for n in notices
        if isinstance(n.entry, SettlementNoticeEntry)
    ] == [(SettlementOutcome.COMPLETED, "the answer")]
    assert notices[0].seq in consumed(records)


async def test_a_retry_racing_the_answer_of_its_first_try_is_delivered_once() -> None:
    """The retry finds the first try's record before that try's answer is back: whichever
    comes first hands the record to the target, the other does not, and the target's waking
    accounting stays whole (it reads the message once, then settles)."""
    store = FaultySessionStore()
    answer = store.faults.hold("append", landed=True, when=writing(AgentMessageEntry))
    async with in_process_mesh(presets(), store=store) as mesh:
        gate = asyncio.Event()
        ref = await child_mid_step(mesh, gate)
        first = asyncio.create_task(
            mesh.manager.send_message(ref, CHILD, "hello", idempotency_key="k1")
        )
        await answer.reached.wait()
        retried = await mesh.manager.send_message(ref, CHILD, "hello", idempotency_key="k1")
        answer.release.set()
        original = await first
        assert retried.duplicate and not original.duplicate
        assert retried.accepted_seq == original.accepted_seq
        gate.set()
        await asyncio.wait_for(mesh.manager.quiescent(), 10)
        assert mesh.manager.agent(CHILD) is None  # settled: nothing left reserved
        records = await mesh.transcript(CHILD)
    reads = [s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs]
    assert reads.count(original.accepted_seq) == 1
