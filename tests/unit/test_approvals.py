"""Durable approvals (docs/approvals.md), against the scripted provider in one process: a call of
a marked tool waits for a person's decision, runs once when allowed, never when denied, and
every decision is in the transcript. Each test states one rule and fails when it is broken."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import pytest

from dsh_mesh.agent import completed_turn_prefix, render
from dsh_mesh.agent._approvals import check_arguments, check_decision, request_of
from dsh_mesh.core import (
    EXPIRED_APPROVAL_REASON,
    MESH_DECIDER,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ApprovalStale,
    AssistantStepEntry,
    ConsumedEntry,
    InvalidArgument,
    Record,
    RegistryUnavailable,
    Role,
    SessionId,
    SettlementNoticeEntry,
    ToolCall,
    ToolResultEntry,
    TreeClosed,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    Usage,
)
from dsh_mesh.models import PARENT, Call, Reply, send, tool
from dsh_mesh.testing import (
    FaultySessionStore,
    InProcessMesh,
    approval_violations,
    in_process_mesh,
    writing,
)
from dsh_mesh.tools import ApprovalPolicy, Preset
from dsh_mesh.tools import tool as tool_decorator
from tests.unit.conftest import DyingHost, Programs, manager_on

ROOT = SessionId("s-1")
CHILD = SessionId("s-2")
RAN: list[str] = []


@tool_decorator(replay="unsafe")
def deploy(env: str, version: int = 1) -> str:
    """Deploy a version to an environment."""
    RAN.append(f"{env}@{version}")
    return f"deployed {version} to {env}"


@tool_decorator(replay="safe")
def status(env: str) -> str:
    """Read an environment's status."""
    return f"{env} is up"


def approving(*patterns: str, timeout: timedelta | None = timedelta(hours=1)) -> tuple[Preset, ...]:
    approvals = ApprovalPolicy(tools=patterns, timeout=timeout)
    return (
        Preset(name="lead", system_prompt="You lead.", model="lead", approvals=approvals),
        Preset(name="helper", system_prompt="You help.", model="helper", approvals=approvals),
    )


@pytest.fixture
async def team() -> AsyncIterator[InProcessMesh]:
    RAN.clear()
    async with in_process_mesh(approving("deploy"), tools=(deploy, status)) as running:
        yield running


T = TypeVar("T")


def entries(records: list[Record], kind: type[T]) -> list[T]:
    return [r.entry for r in records if isinstance(r.entry, kind)]


async def waiting_request(team: InProcessMesh, session: SessionId) -> ApprovalRequestEntry:
    await team.manager.quiescent()
    records = await team.transcript(session)
    request = entries(records, ApprovalRequestEntry)[-1]
    answered = {e.call_id for e in entries(records, ToolResultEntry)}
    assert request.call_id not in answered
    return request


def decision(
    request: ApprovalRequestEntry,
    kind: ApprovalDecision = ApprovalDecision.ALLOW,
    **fields: str,
) -> ApprovalDecisionEntry:
    return ApprovalDecisionEntry(
        call_id=request.call_id,
        decision=kind,
        request_digest=request.digest,
        by=fields.pop("by", "client:alice"),
        **fields,
    )


async def test_a_marked_call_waits_with_no_model_call_open_and_runs_once_when_allowed(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="shipped"))
    await team.manager.create_root("Ship it.", preset="lead")
    request = await waiting_request(team, ROOT)
    assert (request.tool, request.arguments_json) == ("deploy", '{"env": "prod"}')
    assert RAN == []
    calls_while_waiting = len(team.recorder.requests_of(ROOT))
    records = await team.transcript(ROOT)
    [ended] = entries(records, TurnEndedEntry)
    assert ended.outcome is TurnOutcome.AWAITING_APPROVAL

    accepted = await team.manager.resolve_approval(ROOT, decision(request))
    await team.manager.quiescent()

    assert RAN == ["prod@1"]
    assert len(team.recorder.requests_of(ROOT)) == calls_while_waiting + 1
    records = await team.transcript(ROOT)
    [decided] = [r for r in records if isinstance(r.entry, ApprovalDecisionEntry)]
    assert decided.seq == accepted.accepted_seq and decided.recorded_at is not None
    assert isinstance(decided.entry, ApprovalDecisionEntry)
    assert decided.entry.by == "client:alice"
    [result] = entries(records, ToolResultEntry)
    assert result.content == "deployed 1 to prod" and not result.is_error
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED
    assert entries(records, AssistantStepEntry)[-1].text == "shipped"


async def test_a_denied_call_never_runs_and_the_model_reads_the_reason(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="ok, not today"))
    await team.manager.create_root("Ship it.", preset="lead")
    request = await waiting_request(team, ROOT)

    await team.manager.resolve_approval(
        ROOT, decision(request, ApprovalDecision.DENY, reason="freeze until Monday")
    )
    await team.manager.quiescent()

    assert RAN == []
    [result] = entries(await team.transcript(ROOT), ToolResultEntry)
    assert result.is_error
    assert result.content == "not run: this call was denied by client:alice: freeze until Monday"
    last = team.recorder.requests_of(ROOT)[-1].messages[-1]
    assert (last.role, last.content) == (Role.TOOL, result.content)


async def test_an_edited_call_runs_with_the_new_arguments_and_says_so(team: InProcessMesh) -> None:
    team.scripted.program("lead", tool("deploy", env="prod"), Reply())
    await team.manager.create_root("Ship it.", preset="lead")
    request = await waiting_request(team, ROOT)

    edit = decision(request, ApprovalDecision.EDIT, arguments_json='{"env": "staging"}')
    await team.manager.resolve_approval(ROOT, edit)
    await team.manager.quiescent()

    assert RAN == ["staging@1"]
    [result] = entries(await team.transcript(ROOT), ToolResultEntry)
    assert result.content.endswith("deployed 1 to staging")
    assert '{"env": "staging"}' in result.content.splitlines()[0]


@pytest.mark.parametrize(
    "arguments",
    ['{"env": 3}', '{"version": 2}', '["prod"]', "not json"],
    ids=["wrong-type", "missing-required", "not-an-object", "not-json"],
)
async def test_edited_arguments_the_tools_schema_refuses_are_refused_and_nothing_is_accepted(
    team: InProcessMesh, arguments: str
) -> None:
    team.scripted.program("lead", tool("deploy", env="prod"), Reply())
    await team.manager.create_root("Ship it.", preset="lead")
    request = await waiting_request(team, ROOT)
    before = await team.transcript(ROOT)

    with pytest.raises(InvalidArgument):
        await team.manager.resolve_approval(
            ROOT, decision(request, ApprovalDecision.EDIT, arguments_json=arguments)
        )
    assert await team.transcript(ROOT) == before
    # The request still waits, and a valid decision still goes through.
    await team.manager.resolve_approval(ROOT, decision(request))
    await team.manager.quiescent()
    assert RAN == ["prod@1"]


async def test_a_decision_on_another_request_than_the_one_waiting_is_stale(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", tool("deploy", env="prod"), Reply())
    await team.manager.create_root("Ship it.", preset="lead")
    request = await waiting_request(team, ROOT)
    shown_other = dataclasses.replace(request, arguments_json='{"env": "staging"}')
    before = await team.transcript(ROOT)

    with pytest.raises(ApprovalStale) as refused:
        await team.manager.resolve_approval(ROOT, decision(shown_other))
    assert refused.value.metadata["call_id"] == request.call_id
    with pytest.raises(ApprovalStale):
        await team.manager.resolve_approval(
            ROOT, dataclasses.replace(decision(request), call_id="no-such-call")
        )
    assert await team.transcript(ROOT) == before and RAN == []


async def test_a_second_decision_is_stale_and_the_same_one_again_is_a_duplicate(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", tool("deploy", env="prod"), Reply())
    await team.manager.create_root("Ship it.", preset="lead")
    request = await waiting_request(team, ROOT)
    allow = decision(request)

    first = await team.manager.resolve_approval(ROOT, allow)
    again = await team.manager.resolve_approval(ROOT, allow)
    assert again.duplicate and again.accepted_seq == first.accepted_seq
    with pytest.raises(ApprovalStale):
        await team.manager.resolve_approval(
            ROOT, decision(request, ApprovalDecision.DENY, by="client:bob")
        )
    await team.manager.quiescent()
    assert RAN == ["prod@1"]
    with pytest.raises(ApprovalStale):  # the call has its result: nothing waits any more
        await team.manager.resolve_approval(ROOT, decision(request, ApprovalDecision.DENY))


async def test_parallel_calls_of_one_step_are_approved_one_by_one(team: InProcessMesh) -> None:
    both = Call(
        calls=(("deploy", {"env": "a"}), ("status", {"env": "a"}), ("deploy", {"env": "b"}))
    )
    team.scripted.program("lead", both, Reply())
    await team.manager.create_root("Ship both.", preset="lead")
    first = await waiting_request(team, ROOT)
    assert first.arguments_json == '{"env": "a"}'

    await team.manager.resolve_approval(ROOT, decision(first))
    second = await waiting_request(team, ROOT)
    assert second.arguments_json == '{"env": "b"}' and RAN == ["a@1"]
    results = entries(await team.transcript(ROOT), ToolResultEntry)
    assert [r.name for r in results] == ["deploy", "status"]  # the unmarked one ran meanwhile

    await team.manager.resolve_approval(ROOT, decision(second, ApprovalDecision.DENY))
    await team.manager.quiescent()
    records = await team.transcript(ROOT)
    assert RAN == ["a@1"]
    assert [r.name for r in entries(records, ToolResultEntry)] == ["deploy", "status", "deploy"]
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED


@pytest.mark.contract(9)
async def test_a_message_to_an_agent_waiting_for_approval_is_read_after_the_calls_result(
    team: InProcessMesh,
) -> None:
    team.scripted.program(
        "lead", tool("spawn_agent", task="Deploy.", preset="helper"), Reply(), Reply()
    )
    team.scripted.program("helper", tool("deploy", env="prod"), Reply(), Reply())
    await team.manager.create_root("Lead.", preset="lead")
    request = await waiting_request(team, CHILD)

    # The parent's message reaches the waiting child: it is steered (read at the boundary
    # after the call it waits at), not a turn of its own.
    sent = await team.manager.send_message(
        team.manager.agent(ROOT).ref,  # type: ignore[union-attr]
        CHILD,
        "use version 2 next time",
    )
    assert sent.kind.value == "steered"
    await team.manager.resolve_approval(CHILD, decision(request))
    await team.manager.quiescent()

    conversation = render(await team.transcript(CHILD))
    result_at = next(i for i, m in enumerate(conversation) if m.role is Role.TOOL)
    message_at = next(i for i, m in enumerate(conversation) if "version 2" in m.content)
    assert result_at < message_at


async def test_a_waiting_child_does_not_settle_until_its_call_is_decided(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", tool("spawn_agent", task="Deploy.", preset="helper"), Reply())
    team.scripted.program("helper", tool("deploy", env="prod"), send(PARENT, "deployed"), Reply())
    await team.manager.create_root("Lead.", preset="lead")
    request = await waiting_request(team, CHILD)
    assert team.manager.agent(CHILD) is not None  # still resident, its run not over
    assert not entries(await team.transcript(ROOT), SettlementNoticeEntry)

    await team.manager.resolve_approval(CHILD, decision(request))
    await team.manager.quiescent()
    notices = entries(await team.transcript(ROOT), SettlementNoticeEntry)
    assert [n.outcome.value for n in notices] == ["completed"]


async def test_an_interrupt_of_a_waiting_turn_denies_the_request_and_cancels_the_turn(
    team: InProcessMesh,
) -> None:
    both = Call(calls=(("deploy", {"env": "a"}), ("status", {"env": "a"})))
    team.scripted.program("lead", both, Reply())
    await team.manager.create_root("Ship.", preset="lead")
    request = await waiting_request(team, ROOT)
    waiting_turn = entries(await team.transcript(ROOT), TurnEndedEntry)[-1].turn_id

    assert team.manager.interrupt(ROOT) == waiting_turn
    await team.manager.quiescent()

    records = await team.transcript(ROOT)
    [decided] = entries(records, ApprovalDecisionEntry)
    assert decided.decision is ApprovalDecision.DENY and decided.by == "dsh-mesh"
    assert "cancelled" in decided.reason
    results = entries(records, ToolResultEntry)
    assert results[0].call_id == request.call_id
    assert all(r.is_error and r.content.startswith("not run") for r in results)
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.CANCELLED
    assert RAN == []
    with pytest.raises(ApprovalStale):
        await team.manager.resolve_approval(ROOT, decision(request))


async def test_a_request_that_expires_is_answered_as_denied_and_the_turn_goes_on() -> None:
    RAN.clear()
    presets = approving("deploy", timeout=timedelta(milliseconds=50))
    async with in_process_mesh(presets, tools=(deploy,)) as team:
        team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="gave up"))
        await team.manager.create_root("Ship it.", preset="lead")
        await team.manager.wait_until(lambda: RAN == [] and _ended(team))
        records = await team.transcript(ROOT)

    [decided] = entries(records, ApprovalDecisionEntry)
    assert decided.decision is ApprovalDecision.DENY and decided.by == "dsh-mesh"
    assert "expired" in decided.reason
    [result] = entries(records, ToolResultEntry)
    assert result.is_error and "expired" in result.content
    assert entries(records, AssistantStepEntry)[-1].text == "gave up"
    assert RAN == []


def _ended(team: InProcessMesh) -> bool:
    agent = team.manager.agent(ROOT)
    return agent is not None and agent.turns_run >= 2


async def test_a_passivated_agent_waiting_for_approval_is_resumed_by_the_decision() -> None:
    RAN.clear()
    async with in_process_mesh(approving("deploy"), tools=(deploy,)) as team:
        team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="shipped"))
        await team.manager.create_root("Ship it.", preset="lead")
        request = await waiting_request(team, ROOT)
        assert team.manager.passivate_idle(10) == 1
        await team.manager.wait_until(lambda: team.manager.agent(ROOT) is None)

        delivered = await team.manager.resolve_approval(ROOT, decision(request))
        await team.manager.quiescent()
        records = await team.transcript(ROOT)

    assert delivered.kind.value == "cold-resumed"
    assert RAN == ["prod@1"]
    assert entries(records, AssistantStepEntry)[-1].text == "shipped"


async def test_a_standard_tool_never_waits_whatever_the_patterns_say() -> None:
    async with in_process_mesh(approving("*"), tools=(deploy,)) as team:
        team.scripted.program("lead", tool("spawn_agent", task="Help.", preset="helper"), Reply())
        team.scripted.program("helper", send(PARENT, "hi"), Reply())
        await team.manager.create_root("Lead.", preset="lead")
        await team.manager.quiescent()
        records = await team.transcript(ROOT)
    assert not entries(records, ApprovalRequestEntry)
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED


async def test_a_turn_waiting_for_approval_is_no_completed_prefix_for_a_fork(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", Reply(text="hello"), tool("deploy", env="prod"), Reply())
    await team.manager.create_root("Hi.", preset="lead")
    await team.manager.quiescent()
    await team.manager.submit_prompt(ROOT, "Ship it.", idempotency_key="k")
    await waiting_request(team, ROOT)

    records = await team.transcript(ROOT)
    seq, prefix = completed_turn_prefix(records)
    first_end = next(r for r in records if isinstance(r.entry, TurnEndedEntry))
    assert seq == first_end.seq
    assert not any(m.tool_calls for m in prefix)


def _gated_presets() -> tuple[Preset, ...]:
    approvals = ApprovalPolicy(tools=("deploy",))
    return (Preset(name="lead", system_prompt="You lead.", model="lead", approvals=approvals),)


async def test_a_request_written_just_before_its_host_died_still_waits_and_runs_once() -> None:
    RAN.clear()

    def die_at(session: SessionId, entry: object) -> bool:
        return isinstance(entry, TurnEndedEntry)  # after the request, before the turn's end

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {"lead": (tool("deploy", env="prod"), Reply(text="shipped"))}
    async with manager_on(store, "node-1", programs, _gated_presets(), tools=(deploy,)) as one:
        await one.create_root("Ship it.", preset="lead", session_id=ROOT)
        await host.reached.wait()
        host.die()
    await host.lapse()
    async with manager_on(
        host.for_node_two(), "node-2", programs, _gated_presets(), tools=(deploy,)
    ) as two:
        await two.resume(ROOT)
        await two.quiescent()
        records = await store.read(ROOT)
        [request] = entries(records, ApprovalRequestEntry)
        assert [e.outcome for e in entries(records, TurnEndedEntry)] == [TurnOutcome.LOST]
        assert not entries(records, ToolResultEntry)  # still waiting: never "outcome unknown"
        await two.resolve_approval(ROOT, decision(request))
        await two.quiescent()
        records = await store.read(ROOT)
    assert RAN == ["prod@1"]
    [result] = entries(records, ToolResultEntry)
    assert not result.is_error
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED


async def test_an_approved_call_its_host_died_running_is_never_run_twice() -> None:
    RAN.clear()

    def die_at(session: SessionId, entry: object) -> bool:
        return isinstance(entry, ToolResultEntry)  # the approved call ran; its result is lost

    host = DyingHost(die_at)
    store = host.store
    programs: Programs = {"lead": (tool("deploy", env="prod"), Reply(text="shipped"))}
    async with manager_on(store, "node-1", programs, _gated_presets(), tools=(deploy,)) as one:
        await one.create_root("Ship it.", preset="lead", session_id=ROOT)
        await one.wait_until(lambda: bool(one.agent(ROOT) and one.agent(ROOT).waiting_request()))  # type: ignore[union-attr]
        request = one.agent(ROOT).waiting_request()  # type: ignore[union-attr]
        assert request is not None
        await one.resolve_approval(ROOT, decision(request))
        await host.reached.wait()
        host.die()
    await host.lapse()
    async with manager_on(
        host.for_node_two(), "node-2", programs, _gated_presets(), tools=(deploy,)
    ) as two:
        await two.resume(ROOT)
        await two.quiescent()
        records = await store.read(ROOT)
    assert RAN == ["prod@1"]  # once, on the host that died
    [result] = entries(records, ToolResultEntry)
    assert result.is_error and json.loads(result.content)["outcome"] == "unknown"


async def test_stopping_the_subtree_of_a_waiting_child_denies_its_request(
    team: InProcessMesh,
) -> None:
    team.scripted.program("lead", tool("spawn_agent", task="Deploy.", preset="helper"), Reply())
    team.scripted.program("helper", tool("deploy", env="prod"), Reply())
    await team.manager.create_root("Lead.", preset="lead")
    request = await waiting_request(team, CHILD)

    await team.manager.stop_tree(ROOT, close=True, reason="freeze")
    await team.manager.wait_until(lambda: team.manager.agent(CHILD) is None)

    records = await team.transcript(CHILD)
    [decided] = entries(records, ApprovalDecisionEntry)
    assert decided.decision is ApprovalDecision.DENY and decided.by == "dsh-mesh"
    assert "freeze" in decided.reason
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.CANCELLED
    assert RAN == []
    notices = entries(await team.transcript(ROOT), SettlementNoticeEntry)
    assert [n.outcome.value for n in notices] == ["cancelled"]
    with pytest.raises(TreeClosed):  # nothing reaches a closed subtree, decisions included
        await team.manager.resolve_approval(CHILD, decision(request))
    await team.manager.reopen_tree(ROOT)
    with pytest.raises(ApprovalStale):  # and the stop decided it
        await team.manager.resolve_approval(CHILD, decision(request))


async def test_a_decision_whose_answer_was_lost_is_found_runs_once_and_stands() -> None:
    """The allow landed, its answer was lost: the agent finds it (it is in doubt), reads it
    before the call runs, and a later deny is stale, not a second decision."""
    RAN.clear()
    store = FaultySessionStore()  # the first decision lands, an etcd outage cuts its answer
    lost = RegistryUnavailable("etcd went away before it answered")
    store.faults.fail("append", lost, landed=True, when=writing(ApprovalDecisionEntry))
    async with in_process_mesh(approving("deploy"), store=store, tools=(deploy,)) as team:
        team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="shipped"))
        await team.manager.create_root("Ship it.", preset="lead")
        request = await waiting_request(team, ROOT)
        with pytest.raises(RegistryUnavailable):
            await team.manager.resolve_approval(ROOT, decision(request))
        await team.manager.quiescent()
        with pytest.raises(ApprovalStale):
            await team.manager.resolve_approval(
                ROOT, decision(request, ApprovalDecision.DENY, by="client:bob")
            )
        records = await team.transcript(ROOT)
    assert RAN == ["prod@1"]
    [decided] = [r for r in records if isinstance(r.entry, ApprovalDecisionEntry)]
    [result] = [r for r in records if isinstance(r.entry, ToolResultEntry)]
    read = [
        r for r in records if isinstance(r.entry, ConsumedEntry) and decided.seq in r.entry.seqs
    ]
    assert read and read[0].seq < result.seq  # read before the call ran


async def test_an_expiry_whose_denial_landed_with_its_answer_lost_is_decided_once() -> None:
    """The fault run's "decided again" (seed 5151): the agent's own denial of its expired
    request landed, its answer was lost; the write waited out the outage and, finding no
    record of its own (a decision is an inbound entry), wrote the denial again. The log store
    refuses a second decision; the agent reads the one that landed and goes on."""
    RAN.clear()
    store = FaultySessionStore()  # the log store restarts between the denial's commit and reply
    lost = RegistryUnavailable("the log store restarted before it answered")
    denial = store.faults.fail("append", lost, landed=True, when=writing(ApprovalDecisionEntry))
    presets = approving("deploy", timeout=timedelta(milliseconds=50))
    async with in_process_mesh(presets, store=store, tools=(deploy,)) as team:
        team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="gave up"))
        await team.manager.create_root("Ship it.", preset="lead")
        await team.manager.wait_until(lambda: _ended(team))
        records = await team.transcript(ROOT)
    assert denial.spent
    [decided] = entries(records, ApprovalDecisionEntry)
    assert decided.by == MESH_DECIDER and decided.reason == EXPIRED_APPROVAL_REASON
    [result] = entries(records, ToolResultEntry)
    assert result.is_error and "expired" in result.content
    assert entries(records, AssistantStepEntry)[-1].text == "gave up"
    assert approval_violations(ROOT, records, {}, {"deploy"})[1] == []
    assert RAN == []


async def test_a_decision_the_store_refuses_as_second_makes_the_agent_read_the_first(
    team: InProcessMesh,
) -> None:
    """A decision landed that the agent's copy does not hold (written here behind its back,
    as a write whose answer was lost would be): a person's decision passes the agent's check
    and the store refuses it. The caller hears APPROVAL_STALE, and the agent reads the
    decision that stands and goes on from it, instead of waiting for one."""
    team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="shipped"))
    await team.manager.create_root("Ship it.", preset="lead")
    request = await waiting_request(team, ROOT)
    agent = team.manager.agent(ROOT)
    assert agent is not None
    stands = decision(request, by="client:alice")
    await team.store.append(ROOT, stands, writer=agent.activation.activation_id)

    with pytest.raises(ApprovalStale):
        await team.manager.resolve_approval(
            ROOT, decision(request, ApprovalDecision.DENY, by="client:bob")
        )
    await team.manager.quiescent()

    records = await team.transcript(ROOT)
    assert entries(records, ApprovalDecisionEntry) == [stands]
    assert RAN == ["prod@1"]
    assert entries(records, AssistantStepEntry)[-1].text == "shipped"


async def test_interrupting_twice_cancels_once_and_the_next_call_still_waits(
    team: InProcessMesh,
) -> None:
    # The cancelled turn makes no model call: the next step is the program's second.
    team.scripted.program("lead", tool("deploy", env="a"), tool("deploy", env="b"), Reply())
    await team.manager.create_root("Ship.", preset="lead")
    await waiting_request(team, ROOT)
    team.manager.interrupt(ROOT)
    team.manager.interrupt(ROOT)  # while the first is carried out
    await team.manager.quiescent()
    await team.manager.submit_prompt(ROOT, "Ship b.", idempotency_key="b")
    second = await waiting_request(team, ROOT)
    assert second.arguments_json == '{"env": "b"}'  # waits: no stale cancel denied it
    records = await team.transcript(ROOT)
    assert len(entries(records, ApprovalDecisionEntry)) == 1
    assert RAN == []


def test_a_call_id_a_later_step_reuses_is_asked_anew() -> None:
    """A provider may number calls per step (``call_0``): the request and decision of an earlier
    step's call never answer a later step's call of the same id."""
    step = AssistantStepEntry(
        text="",
        tool_calls=(ToolCall(call_id="call_0", name="deploy", arguments_json="{}"),),
        usage=Usage(),
    )
    earlier = ApprovalRequestEntry(
        call_id="call_0", step_seq=1, tool="deploy", arguments_json="{}", descriptor_digest="d"
    )
    records = [
        Record(seq=1, entry=step),
        Record(seq=2, entry=earlier),
        Record(seq=3, entry=decision(earlier)),
        Record(seq=4, entry=ToolResultEntry(call_id="call_0", name="deploy", content="ok")),
        Record(seq=5, entry=step),
    ]
    assert request_of(records, "call_0", step=1) is not None
    assert request_of(records, "call_0", step=5) is None
    with pytest.raises(ApprovalStale):
        check_decision(records, decision(earlier), None, datetime.now(UTC), step=5)


def test_a_fork_never_inherits_a_call_without_its_result() -> None:
    """A turn lost between its request and its end leaves the call open: that end is no
    completed-turn prefix."""
    first = AssistantStepEntry(text="hi", tool_calls=(), usage=Usage())
    asking = AssistantStepEntry(
        text="",
        tool_calls=(ToolCall(call_id="c-1", name="deploy", arguments_json="{}"),),
        usage=Usage(),
    )
    records = [
        Record(seq=1, entry=first),
        Record(seq=2, entry=TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.COMPLETED)),
        Record(seq=3, entry=asking),
        Record(seq=4, entry=TurnEndedEntry(turn_id=TurnId("t-2"), outcome=TurnOutcome.LOST)),
    ]
    assert completed_turn_prefix(records)[0] == 2


async def test_stopping_the_subtree_of_an_absent_waiting_agent_denies_its_request() -> None:
    """No agent holds the request (its root was passivated): the stop itself writes the denial,
    which the agent reads once the subtree is reopened and something wakes it."""
    RAN.clear()
    async with in_process_mesh(approving("deploy"), tools=(deploy,)) as team:
        team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="understood"))
        await team.manager.create_root("Ship it.", preset="lead")
        request = await waiting_request(team, ROOT)
        team.manager.passivate_idle(10)
        await team.manager.wait_until(lambda: team.manager.agent(ROOT) is None)

        await team.manager.stop_tree(ROOT, close=True, reason="freeze")
        [decided] = entries(await team.transcript(ROOT), ApprovalDecisionEntry)
        assert decided.decision is ApprovalDecision.DENY and decided.by == "dsh-mesh"
        assert "freeze" in decided.reason
        with pytest.raises(TreeClosed):
            await team.manager.resolve_approval(ROOT, decision(request))

        await team.manager.reopen_tree(ROOT)
        await team.manager.submit_prompt(ROOT, "Status?", idempotency_key="k")
        await team.manager.quiescent()
        records = await team.transcript(ROOT)
    assert RAN == []
    [result] = entries(records, ToolResultEntry)
    assert result.is_error and "freeze" in result.content
    assert entries(records, AssistantStepEntry)[1].text == "understood"


@pytest.mark.parametrize(
    ("arguments", "limit"),
    [
        ("[" * 100_000 + "]" * 100_000, "json_depth"),
        ('"' + "x" * (2 * 1024 * 1024) + '"', "json_bytes"),
    ],
    ids=["100000-deep", "2-mib"],
)
def test_edited_arguments_too_deep_or_too_large_are_invalid_argument_wherever_they_come_from(
    arguments: str, limit: str
) -> None:
    """The agent's own check bounds an edit too (a decision from the in-process client never
    crossed the wire's): refused, typed, never a RecursionError."""
    with pytest.raises(InvalidArgument) as refused:
        check_arguments(arguments, None)
    assert (refused.value.metadata["field"], refused.value.metadata["limit"]) == (
        "arguments_json",
        limit,
    )
