"""Every tool call gets exactly one answer, whatever happens to its host (docs/adr/0007).

Each test forces the interleaving that broke it: the first "node" (a manager on a shared
in-memory store) dies at a chosen write (the write fails, every driver stops, the activations
lapse as its lease would), then a second node on the same store activates the session. Before
its next model call every call of the last step has one result: a standard tool's is exact
(the acceptance or the child the first try made, or the send or spawn done now under the
call's own key), any other tool's says its outcome is unknown and it never runs twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationId,
    AgentMessageEntry,
    AssistantStepEntry,
    ConsumedEntry,
    DeliveryKind,
    Entry,
    InboxFull,
    Record,
    SessionId,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolDescriptor,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
)
from dsh_mesh.models import PARENT, Call, Reply, Stall, send, tool
from dsh_mesh.runtime import (
    InMemorySessionStore,
    ManagerConfig,
)
from dsh_mesh.testing import FaultySessionStore, calls_without_one_answer, in_process_mesh, writing
from dsh_mesh.tools import Preset, ToolContext, ToolIdentity, ToolInvocation, ToolOutput
from dsh_mesh.tools import tool as python_tool
from tests.unit.conftest import DyingHost, GateTool, Programs, drain_loop, manager_on
from tests.unit.conftest import presets as conftest_presets


@dataclass
class CountingTool:
    """A scoped tool with an effect the test can count; blocks on its first call."""

    runs: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    _identity: ToolIdentity = field(default_factory=lambda: ToolIdentity("test/charge"))

    @property
    def identity(self) -> ToolIdentity:
        return self._identity

    @property
    def descriptor(self) -> ToolDescriptor:
        return ToolDescriptor.of("charge", "Charges a card once per call.", {})

    async def invoke(
        self, invocation: ToolInvocation, arguments: Mapping[str, object]
    ) -> ToolOutput:
        self.runs += 1
        await self.gate.wait()
        return ToolOutput(content="charged")


ROOT = SessionId("s-root")


def _presets(charge: CountingTool | None = None) -> tuple[Preset, ...]:
    return (
        Preset(name="lead", system_prompt="You lead.", model="lead"),
        Preset(
            name="helper",
            system_prompt="You help.",
            model="helper",
            scoped_tools=() if charge is None else (charge,),
        ),
    )


async def _children(store: InMemorySessionStore, parent: SessionId) -> list[SessionId]:
    found = []
    for session in list(store._headers):
        header = await store.get_header(SessionId(session))
        if header is not None and header.parent_session == parent:
            found.append(header.session_id)
    return found


def _results(records: Sequence[Record], name: str) -> list[ToolResultEntry]:
    return [
        r.entry for r in records if isinstance(r.entry, ToolResultEntry) and r.entry.name == name
    ]


async def _die_then_resume(
    host: DyingHost,
    programs: Programs,
    presets: tuple[Preset, ...],
    resume: Callable[[], Awaitable[list[SessionId]]],
) -> None:
    """Node one creates the root and runs until the store reaches the chosen write; its host
    dies there. Then node two activates the sessions ``resume`` names, in that order. A root
    that died with them is woken on node two by its child's notice (ADR 0043): there it only
    reads it."""
    store = host.store
    async with manager_on(store, "node-1", programs, presets) as node_one:
        await node_one.create_root("Lead.", preset="lead", session_id=ROOT)
        await host.reached.wait()
        host.die()
    await host.lapse()
    programs = {**programs, "lead": (Reply(text="noted"),) * 4}
    async with manager_on(host.for_node_two(), "node-2", programs, presets) as node_two:
        for session in await resume():
            await node_two.resume(session)
        async with asyncio.timeout(10):
            await node_two.quiescent()


async def _root_only() -> list[SessionId]:
    return [ROOT]


async def _only_child(store: InMemorySessionStore) -> list[SessionId]:
    children = await _children(store, ROOT)
    assert len(children) == 1, children
    return children


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
async def test_a_send_left_unanswered_by_its_dead_host_is_answered_exactly_and_lands_once(
    landed: bool,
) -> None:
    # Landed: the host died after the parent accepted the message, before the child recorded
    # the result. Not landed: it died while the message was being appended at the parent.
    def die_at(session: SessionId, entry: Entry | None) -> bool:
        if landed:
            return isinstance(entry, ToolResultEntry) and entry.name == "send_message"
        return isinstance(entry, AgentMessageEntry)

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {
        "lead": (tool("spawn_agent", task="Work.", preset="helper"), Reply(text="waiting")),
        "helper": (send(PARENT, "the result"), Reply(text="sent")),
    }

    async def both() -> list[SessionId]:
        # The parent first (so it is live to accept the repeat), then the child.
        return [ROOT, *(await _only_child(store))]

    await _die_then_resume(host, programs, _presets(), both)
    [child] = await _children(store, ROOT)
    at_root = [
        r.entry.content for r in await store.read(ROOT) if isinstance(r.entry, AgentMessageEntry)
    ]
    assert at_root == ["the result"]  # once, whichever try carried it
    records = await store.read(child)
    [answer] = _results(records, "send_message")
    assert json.loads(answer.content)["delivered"] in {"steered", "started-turn", "cold-resumed"}
    assert not answer.is_error
    assert calls_without_one_answer(records) == []
    ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended[0] is TurnOutcome.LOST


@pytest.mark.parametrize(
    "dies_at",
    ["result", "header", "task"],
    ids=["child-made", "child-not-made", "child-half-made"],
)
async def test_a_spawn_left_unanswered_by_its_dead_host_makes_exactly_one_whole_child(
    dies_at: str,
) -> None:
    def die_at(session: SessionId, entry: Entry | None) -> bool:
        if dies_at == "result":
            return isinstance(entry, ToolResultEntry) and entry.name == "spawn_agent"
        if dies_at == "header":
            return entry is None
        return isinstance(entry, TaskEntry) and session != ROOT

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {
        "lead": (tool("spawn_agent", task="Work.", preset="helper"), Reply(text="waiting")),
        "helper": (Reply(text="worked"),),
    }
    await _die_then_resume(host, programs, _presets(), _root_only)
    [child] = await _children(store, ROOT)
    records = await store.read(ROOT)
    [answer] = _results(records, "spawn_agent")
    assert json.loads(answer.content)["agent_id"] == child
    assert calls_without_one_answer(records) == []
    child_records = await store.read(child)
    [task] = [r.seq for r in child_records if isinstance(r.entry, TaskEntry)]
    # The child's task was read exactly once: made whole and activated, never left waiting.
    read = [s for r in child_records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs]
    assert read.count(task) == 1


async def test_any_other_tool_left_unanswered_is_answered_unknown_and_never_run_twice() -> None:
    charge = CountingTool()

    def die_at(session: SessionId, entry: Entry | None) -> bool:
        return isinstance(entry, ToolResultEntry) and entry.name == "charge"

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {
        "lead": (tool("spawn_agent", task="Work.", preset="helper"), Stall()),
        "helper": (Call(calls=(("charge", {}), ("charge", {}))), Reply(text="done")),
    }
    charge.gate.set()  # the first call returns at once; its result's write kills the host

    async def child() -> list[SessionId]:
        return await _only_child(store)

    await _die_then_resume(host, programs, _presets(charge), child)
    [session] = await _children(store, ROOT)
    records = await store.read(session)
    answers = _results(records, "charge")
    assert len(answers) == 2 and all(a.is_error for a in answers)
    assert all(json.loads(a.content)["outcome"] == "unknown" for a in answers)
    assert charge.runs == 1  # the first ran once; neither ran again
    assert calls_without_one_answer(records) == []


@pytest.mark.parametrize(
    "kind",
    [AssistantStepEntry, ToolResultEntry],
    ids=["step-being-written", "result-being-written"],
)
async def test_an_interrupt_while_a_step_or_result_is_written_leaves_each_call_one_answer(
    kind: type[Entry],
) -> None:
    # Found in review: the interrupted turn closed its calls before the write in flight landed,
    # so a call got no answer (the step landed after the turn's end) or two (its real result
    # and a "not completed" one); every later turn then failed on the strict model.
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(kind))
    gate = GateTool()
    gate.gate.set()
    async with in_process_mesh(conftest_presets(gate), store=store) as mesh:
        mesh.scripted.program("worker", tool("wait"), Reply(text="x"))
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="worker"), Reply())
        await mesh.manager.create_root("Lead.", preset="lead")
        await held.reached.wait()
        assert mesh.manager.interrupt(SessionId("s-1")) is not None
        await drain_loop()
        held.release.set()
        await mesh.manager.quiescent()
        mesh.scripted.program("lead", Reply(text="again"))
        await mesh.manager.submit_prompt(SessionId("s-1"), "next")
        await mesh.manager.quiescent()
        records = await mesh.transcript(SessionId("s-1"))
        assert calls_without_one_answer(records) == []
        ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
        # The interrupted turn, then turns that work (the child's notice, the prompt): none
        # failed on the strict model for a call left open or answered twice.
        assert ended[0] is TurnOutcome.CANCELLED
        assert set(ended[1:]) == {TurnOutcome.COMPLETED}


async def test_an_interrupted_send_is_answered_with_what_happened_to_it() -> None:
    # The send passed its point of no return (its append at the parent is under way) when the
    # child's turn was interrupted: it lands, and the child's model is told it was delivered,
    # not "not completed" (which would invite a second copy).
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(AgentMessageEntry))
    async with in_process_mesh(conftest_presets(), store=store) as mesh:
        mesh.scripted.program("helper", send(PARENT, "the result"), Reply(text="after"))
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"), Reply())
        await mesh.manager.create_root("Lead.", preset="lead")
        await held.reached.wait()
        child = SessionId("s-2")
        assert mesh.manager.interrupt(child) is not None
        await drain_loop()
        held.release.set()
        await mesh.manager.quiescent()
        records = await mesh.transcript(child)
        [answer] = _results(records, "send_message")
        assert not answer.is_error and json.loads(answer.content)["delivered"]
        at_root = [
            r.entry.content
            for r in await mesh.transcript(SessionId("s-1"))
            if isinstance(r.entry, AgentMessageEntry)
        ]
        assert at_root == ["the result"]


async def test_a_child_lost_with_its_parents_host_is_reported_lost_when_it_next_runs() -> None:
    # Found in review: the lost notice came only from a node where the parent was resident when
    # the child's activation vanished; a parent that died on the same host never heard. Now the
    # child's next activation, finding its earlier activation's turn unended, reports it.
    charge = CountingTool()
    charge.gate.set()

    def die_at(session: SessionId, entry: Entry | None) -> bool:
        return isinstance(entry, ToolResultEntry) and entry.name == "charge"

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {
        "lead": (tool("spawn_agent", task="Work.", preset="helper"), Reply(text="waiting")),
        "helper": (tool("charge"), Reply(text="done")),
    }

    async def both() -> list[SessionId]:
        return [ROOT, *(await _only_child(store))]

    await _die_then_resume(host, programs, _presets(charge), both)
    [child] = await _children(store, ROOT)
    first = next(r.entry for r in await store.read(child) if isinstance(r.entry, TurnStartedEntry))
    notices = [
        r.entry for r in await store.read(ROOT) if isinstance(r.entry, SettlementNoticeEntry)
    ]
    lost = [n for n in notices if n.child_activation == first.activation_id]
    assert [n.outcome for n in lost] == [SettlementOutcome.LOST]
    assert first.node_id == "node-1"


async def test_a_repeat_of_a_send_that_landed_gets_its_acceptance_even_from_a_full_inbox() -> None:
    # Found in review: the inbox limit was checked before the key, so the repeat of a landed
    # send (what a resumed activation does for a call its dead host left open) was refused
    # INBOX_FULL: a wrong answer about a message the target holds.
    gate = GateTool()
    config = ManagerConfig(max_inbox_depth=1)
    async with in_process_mesh(conftest_presets(gate), config=config) as mesh:
        mesh.scripted.program("worker", tool("wait"), Reply())
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="worker"), Reply())
        await mesh.manager.create_root("Lead.", preset="lead")
        await gate.entered.wait()
        root = mesh.manager.agent(SessionId("s-1"))
        assert root is not None
        child = SessionId("s-2")
        first = await mesh.manager.send_message(root.ref, child, "once", idempotency_key="k-1")
        again = await mesh.manager.send_message(root.ref, child, "once", idempotency_key="k-1")
        assert again.duplicate and again.accepted_seq == first.accepted_seq
        with pytest.raises(InboxFull):
            await mesh.manager.send_message(root.ref, child, "another", idempotency_key="k-2")
        gate.gate.set()
        await mesh.manager.quiescent()


async def test_a_spawn_never_adopts_a_session_of_another_parent_under_its_derived_id() -> None:
    # Found in review: a repeated spawn trusted any header under the id its call derives. A
    # client that names a root with that id must not get the spawn's task written into it.
    lead, foreign = SessionId("s-lead"), SessionId("s-1")
    async with in_process_mesh(conftest_presets()) as mesh:
        # SequentialIds derives the first readable id, s-1, for the lead's spawn call.
        await mesh.manager.create_root("", preset="solo", session_id=foreign)
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"), Reply())
        await mesh.manager.create_root("Lead.", preset="lead", session_id=lead)
        await mesh.manager.quiescent()
        [answer] = _results(await mesh.transcript(lead), "spawn_agent")
        assert answer.is_error and json.loads(answer.content)["rejected"] == "IDEMPOTENCY_CONFLICT"
        assert not [r for r in await mesh.transcript(foreign) if isinstance(r.entry, TaskEntry)]


async def test_a_message_that_arrives_while_left_over_calls_are_answered_starts_a_turn() -> None:
    # Found in review: while an activation answers what its dead host left open (that is no
    # turn), a message to it was reported "steered", a promise that it extends a running turn.
    def die_at(session: SessionId, entry: Entry | None) -> bool:
        return isinstance(entry, AgentMessageEntry)  # the child's send dies unsent

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {
        "lead": (tool("spawn_agent", task="Work.", preset="helper"), Reply(text="waiting")),
        "helper": (send(PARENT, "the result"), Reply(text="read it")),
    }
    async with manager_on(store, "node-1", programs, _presets()) as node_one:
        await node_one.create_root("Lead.", preset="lead", session_id=ROOT)
        await host.reached.wait()
        host.die()
    await host.lapse()
    [child] = await _only_child(store)
    # On node two, the left-over send (repeated under its key) is held in its append.
    held = store.faults.hold("append", when=writing(AgentMessageEntry))
    async with manager_on(host.for_node_two(), "node-2", programs, _presets()) as node_two:
        await node_two.resume(ROOT)
        await node_two.resume(child)
        await held.reached.wait()
        root = node_two.agent(ROOT)
        assert root is not None
        delivery = await node_two.send_message(root.ref, child, "hello")
        assert delivery.kind is DeliveryKind.STARTED_TURN
        held.release.set()
        async with asyncio.timeout(10):
            await node_two.quiescent()
    records = await store.read(child)
    assert calls_without_one_answer(records) == []
    ended = [r.entry.outcome for r in records if isinstance(r.entry, TurnEndedEntry)]
    assert ended[0] is TurnOutcome.LOST
    consumed = [s for r in records if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs]
    assert delivery.accepted_seq in consumed


async def test_an_activation_of_this_node_that_no_agent_holds_is_released_not_routed_to() -> None:
    # Found by a fault run: a child's activation stayed in etcd, bound to its node's live lease,
    # with no agent on that node (its release had been cut by an etcd outage). Every send to
    # the child was routed to that node and back until "kept moving between nodes", for as
    # long as the node lived; its parent stalled behind each one.
    async with in_process_mesh(conftest_presets()) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"), Reply())
        mesh.scripted.program("helper", Reply(text="done"), Reply(text="again"))
        root_ref = await mesh.manager.create_root("Lead.", preset="lead")
        child = SessionId("s-2")
        await mesh.manager.quiescent()
        assert await mesh.store.current_activation(child) is None
        leaked = Activation(
            session_id=child, activation_id=ActivationId("a-leaked"), node_id=mesh.manager.node_id
        )
        assert await mesh.store.try_activate(leaked) == leaked
        root = mesh.manager.agent(root_ref.session_id)
        assert root is not None
        delivery = await mesh.manager.send_message(root.ref, child, "are you there?")
        assert delivery.kind is DeliveryKind.COLD_RESUMED
        assert delivery.target_activation != "a-leaked"
        await mesh.manager.quiescent()


@pytest.mark.parametrize("replay", ["safe", "unsafe"])
async def test_a_python_tool_left_unanswered_runs_again_only_if_declared_safe(
    replay: Literal["safe", "unsafe"],
) -> None:
    """A call whose host died before its result was written: a ``replay="safe"`` tool runs
    again under the same idempotency key; an unsafe one is answered "outcome unknown" and runs
    exactly once."""
    keys: list[str] = []

    @python_tool(name="charge", replay=replay)
    async def charge(amount: int, context: ToolContext) -> str:
        """Charge a card."""
        keys.append(context.idempotency_key)
        return f"charged {amount}"

    def die_at(session: SessionId, entry: Entry | None) -> bool:
        return isinstance(entry, ToolResultEntry) and entry.name == "charge"

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {
        "lead": (tool("spawn_agent", task="Work.", preset="helper"), Stall()),
        "helper": (Call(calls=(("charge", {"amount": "5"}),)), Reply(text="done")),
    }
    presets = (
        Preset(name="lead", system_prompt="You lead.", model="lead"),
        Preset(name="helper", system_prompt="You help.", model="helper", scoped_tools=(charge,)),
    )

    async def child() -> list[SessionId]:
        return await _only_child(store)

    await _die_then_resume(host, programs, presets, child)
    [session] = await _children(store, ROOT)
    records = await store.read(session)
    [answer] = _results(records, "charge")
    if replay == "safe":
        assert len(keys) == 2 and keys[0] == keys[1]  # the same key both times
        assert answer == ToolResultEntry(call_id=answer.call_id, name="charge", content="charged 5")
        assert answer.duration_ms >= 0
    else:
        assert len(keys) == 1
        assert answer.is_error and json.loads(answer.content)["outcome"] == "unknown"
    assert calls_without_one_answer(records) == []
