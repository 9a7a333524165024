"""The continuation manager: settlement, ordering, cold resume, cancellation, idempotency, forks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import cast

import pytest

from dsh_mesh.agent import Agent
from dsh_mesh.core import (
    Aborted,
    AbortSignal,
    Activation,
    ActivationId,
    AgentMessageEntry,
    AgentRef,
    AssistantStepEntry,
    ConsumedEntry,
    DeliveryKind,
    ForkPrefixEntry,
    HumanPromptEntry,
    IdempotencyConflict,
    InvalidArgument,
    NodeId,
    ParentNotLive,
    RegistryUnavailable,
    RejectionReason,
    SequentialIds,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
    SettlementOutcome,
    StaleSender,
    TargetElsewhere,
    TargetUnknown,
    TaskEntry,
    ToolResultEntry,
    TurnId,
    TurnStartedEntry,
    canonical_json,
)
from dsh_mesh.models import (
    PARENT,
    ExhaustTokens,
    Fail,
    ModelEvent,
    ModelRequest,
    Reply,
    ScriptedProvider,
    Stall,
    ToolCallEvent,
    send,
    tool,
)
from dsh_mesh.runtime import ContinuationManager, InMemorySessionStore, ManagerConfig
from dsh_mesh.testing import (
    FaultySessionStore,
    InProcessMesh,
    Proceed,
    StoreCall,
    in_process_mesh,
    writing,
)
from dsh_mesh.tools import RETURN_INSTRUCTION
from dsh_mesh.tools import tool as tool_decorator
from tests.unit.conftest import CHILD, ROOT, drain_loop, of_type, presets


async def root_with_child(mesh: InProcessMesh, *, kind: str = "spawn_agent") -> AgentRef:
    mesh.scripted.program("lead", tool(kind, task="Do the work.", preset="helper"))
    ref = await mesh.manager.create_root("Lead.", preset="lead")
    await mesh.manager.wait_until(lambda: mesh.manager.agent(CHILD) is not None)
    return ref


async def notices(mesh: InProcessMesh, session: SessionId = ROOT) -> list[SettlementNoticeEntry]:
    return [
        r.entry
        for r in of_type(await mesh.transcript(session), SettlementNoticeEntry)
        if isinstance(r.entry, SettlementNoticeEntry)
    ]


@pytest.mark.contract(8)
@pytest.mark.parametrize(
    ("action", "outcome", "output"),
    [
        (Reply(text="final words"), SettlementOutcome.COMPLETED, "final words"),
        (Fail(message="provider down"), SettlementOutcome.ERROR, ""),
        (ExhaustTokens(text="half a thou"), SettlementOutcome.TOKEN_EXHAUSTION, "half a thou"),
    ],
)
async def test_settlement_notice_is_unconditional_and_records_how_the_run_ended(
    mesh: InProcessMesh,
    action: Reply | Fail | ExhaustTokens,
    outcome: SettlementOutcome,
    output: str,
) -> None:
    mesh.scripted.program("helper", action)  # the child never calls send_message: silence is fine
    await root_with_child(mesh)
    await mesh.manager.quiescent()
    [notice] = await notices(mesh)
    assert notice.child_session == CHILD
    assert notice.outcome is outcome
    assert notice.terminal_output == output
    if outcome is SettlementOutcome.ERROR:
        assert "provider down" in notice.detail
    assert mesh.manager.agent(CHILD) is None  # the activation ended
    assert await mesh.store.current_activation(CHILD) is None


@pytest.mark.contract(8)
async def test_cancelled_child_settles_cancelled(mesh: InProcessMesh) -> None:
    mesh.scripted.program("helper", Reply(gate=asyncio.Event()))
    await root_with_child(mesh)
    await mesh.scripted.wait_for_call(CHILD, 1)
    mesh.manager.interrupt(CHILD)
    await mesh.manager.quiescent()
    [notice] = await notices(mesh)
    assert notice.outcome is SettlementOutcome.CANCELLED


@pytest.mark.contract(8)
@pytest.mark.contract(9)
async def test_many_sends_do_not_end_the_turn_and_precede_the_settlement_notice(
    mesh: InProcessMesh,
) -> None:
    mesh.scripted.program(
        "helper",
        send(PARENT, "progress 1"),
        send(PARENT, "progress 2"),
        send(PARENT, "result"),
        Reply(text="wrapped up"),
    )
    await root_with_child(mesh)
    await mesh.manager.quiescent()
    root_records = await mesh.transcript(ROOT)
    from_child = [
        r
        for r in root_records
        if isinstance(r.entry, AgentMessageEntry | SettlementNoticeEntry)
        and (
            isinstance(r.entry, SettlementNoticeEntry) or r.entry.source.sender_session_id == CHILD
        )
    ]
    labels = [
        r.entry.content if isinstance(r.entry, AgentMessageEntry) else "settled" for r in from_child
    ]
    assert labels == ["progress 1", "progress 2", "result", "settled"]
    consumed = [s for r in of_type(root_records, ConsumedEntry) for s in r.entry.seqs]  # type: ignore[union-attr]
    seqs = [r.seq for r in from_child]
    assert [s for s in consumed if s in seqs] == seqs  # the parent read them in that order
    # All three sends and the final reply happened in the child's one turn.
    assert len(of_type(await mesh.transcript(CHILD), TurnStartedEntry)) == 1


@pytest.mark.contract(5)
async def test_accepted_message_has_one_durable_source_derived_from_the_sender(
    mesh: InProcessMesh,
) -> None:
    mesh.scripted.program("helper", send(PARENT, "hello parent"))
    await root_with_child(mesh)
    await mesh.manager.quiescent()
    [record] = of_type(await mesh.transcript(ROOT), AgentMessageEntry)
    assert isinstance(record.entry, AgentMessageEntry)
    source = record.entry.source
    assert (source.kind, source.form, source.sender_session_id) == ("agent-message", "relay", CHILD)
    shown = [m.content for r in mesh.recorder.requests_of(ROOT) for m in r.messages]
    assert f"Agent {CHILD} sent a message:\nhello parent" in shown


@pytest.mark.contract(3)
async def test_absent_child_is_cold_resumed_with_a_new_activation_then_steered(
    mesh: InProcessMesh,
) -> None:
    mesh.scripted.program("helper", Reply(text="first run"), Reply(text="second run"))
    ref = await root_with_child(mesh)
    child = mesh.manager.agent(CHILD)
    assert child is not None
    first_activation = child.activation.activation_id
    await mesh.manager.quiescent()
    assert mesh.manager.agent(CHILD) is None

    delivery = await mesh.manager.send_message(ref, CHILD, "come back")
    assert delivery.kind is DeliveryKind.COLD_RESUMED
    assert delivery.target_activation != first_activation
    await mesh.manager.quiescent()
    requests = mesh.recorder.requests_of(CHILD)
    assert requests[1].messages[-1].content == f"Agent {ROOT} sent a message:\ncome back"
    assert requests[1].messages[: len(requests[0].messages)] == requests[0].messages
    outcomes = [(n.child_activation, n.terminal_output) for n in await notices(mesh)]
    assert outcomes == [(first_activation, "first run"), (delivery.target_activation, "second run")]


@pytest.mark.contract(3)
async def test_concurrent_sends_to_an_absent_child_share_one_activation(
    mesh: InProcessMesh,
) -> None:
    mesh.scripted.program("helper", Reply(), Reply(), Reply())
    ref = await root_with_child(mesh)
    await mesh.manager.quiescent()
    deliveries = await asyncio.gather(
        *(mesh.manager.send_message(ref, CHILD, f"m{i}") for i in range(3))
    )
    assert {d.target_activation for d in deliveries} == {deliveries[0].target_activation}
    assert sorted(d.accepted_seq for d in deliveries) == [d.accepted_seq for d in deliveries]
    await mesh.manager.quiescent()
    assert len(await notices(mesh)) == 2


@pytest.mark.contract(2)
async def test_stale_agent_object_cannot_send(mesh: InProcessMesh) -> None:
    mesh.scripted.program("helper", Reply(), Reply())
    ref = await root_with_child(mesh)
    child = mesh.manager.agent(CHILD)
    assert child is not None
    stale = child.ref
    await mesh.manager.quiescent()
    await mesh.manager.send_message(ref, CHILD, "wake up")  # a new activation replaces it
    with pytest.raises(StaleSender) as raised:
        await mesh.manager.send_message(stale, ROOT, "from the past")
    assert raised.value.reason is RejectionReason.STALE_SENDER


NEWER = Activation(session_id=ROOT, activation_id=ActivationId("a-new"), node_id=NodeId("n2"))
"""The root's activation on another node once its first host is gone."""


async def child_whose_parent_left(mesh: InProcessMesh) -> Agent:
    """A running child (its model held) whose parent's host is gone: the root is absent."""
    mesh.scripted.program("helper", Reply(gate=asyncio.Event()))
    await root_with_child(mesh)
    child = mesh.manager.agent(CHILD)
    root = mesh.manager.agent(ROOT)
    assert child is not None and root is not None
    await mesh.store.release(root.activation)
    return child


@pytest.mark.contract(2)
async def test_child_to_absent_or_rebound_parent_is_rejected_until_the_parent_messages_it(
    mesh: InProcessMesh,
) -> None:
    child = await child_whose_parent_left(mesh)
    with pytest.raises(ParentNotLive) as absent:
        await mesh.manager.send_message(child.ref, ROOT, "anyone?")
    assert absent.value.reason is RejectionReason.PARENT_NOT_LIVE

    assert await mesh.store.try_activate(NEWER) == NEWER
    with pytest.raises(ParentNotLive) as rebound:
        await mesh.manager.send_message(child.ref, ROOT, "anyone?")
    assert rebound.value.reason is RejectionReason.PARENT_REBOUND

    await mesh.manager.send_message(
        AgentRef(session_id=ROOT, activation_id=NEWER.activation_id), CHILD, "I am back"
    )
    current = await mesh.store.current_activation(CHILD)
    assert current is not None and current.parent_activation == NEWER.activation_id
    nothing = [r for r in of_type(await mesh.transcript(ROOT), AgentMessageEntry)]
    assert nothing == []  # no offline mailbox: the rejected sends left no trace


@pytest.mark.contract(2)
async def test_a_reply_sent_as_the_parent_resumes_waits_for_its_adoption_and_lands(
    mesh: InProcessMesh,
) -> None:
    # Found by the 30-minute soak: a child's reply met its parent's new activation in the
    # moment between its win and its adoption of the child (ADR 0043), was refused
    # PARENT_REBOUND, and its host died before the model could send it again.
    child = await child_whose_parent_left(mesh)
    assert await mesh.store.try_activate(NEWER) == NEWER  # it resumed elsewhere: not adopted yet

    async def adopt() -> None:
        await asyncio.sleep(0.05)
        bound = await mesh.store.current_activation(CHILD)
        assert bound is not None
        await mesh.store.rebind(bound, NEWER.activation_id)

    adoption = asyncio.create_task(adopt())
    # The edge is authorized once adopted: the send goes on to n2, the node now hosting the
    # parent, which this one-node mesh cannot reach (without the wait: PARENT_REBOUND).
    with pytest.raises(TargetElsewhere) as elsewhere:
        await mesh.manager.send_message(child.ref, ROOT, "my result")
    await adoption
    assert (elsewhere.value.node_id, elsewhere.value.activation_id) == ("n2", "a-new")


@pytest.mark.contract(10)
async def test_aborted_before_acceptance_delivers_nothing(mesh: InProcessMesh) -> None:
    mesh.scripted.program("helper", Reply())
    ref = await root_with_child(mesh)
    await mesh.manager.quiescent()
    before = await mesh.transcript(CHILD)
    signal = AbortSignal()
    signal.abort("deadline")
    with pytest.raises(Aborted):
        await mesh.manager.send_message(ref, CHILD, "never", signal)
    await mesh.manager.quiescent()
    assert await mesh.transcript(CHILD) == before
    assert await mesh.store.current_activation(CHILD) is None
    assert len(await notices(mesh)) == 1  # no run, so no second notice


@pytest.mark.contract(10)
async def test_caller_cancelled_after_acceptance_began_keeps_the_message_and_the_target() -> None:
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(AgentMessageEntry))
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        mesh.scripted.program("helper", Reply(gate=asyncio.Event()), Reply())
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.scripted.wait_for_call(CHILD, 1)
        sending = asyncio.create_task(mesh.manager.send_message(ref, CHILD, "stays"))
        await held.reached.wait()
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        held.release.set()
        await mesh.manager.wait_until(
            lambda: any(
                isinstance(r.entry, AgentMessageEntry)
                for r in mesh.manager.agent(CHILD).records  # type: ignore[union-attr]
            )
        )
        child = mesh.manager.agent(CHILD)
        assert child is not None and child.inbox_depth == 1  # accepted, waiting for its boundary
        mesh.manager.interrupt(CHILD)
        await mesh.manager.quiescent()
        records = await mesh.transcript(CHILD)
        [message] = of_type(records, AgentMessageEntry)
        consumed = [s for r in of_type(records, ConsumedEntry) for s in r.entry.seqs]  # type: ignore[union-attr]
        assert message.seq in consumed


@pytest.mark.contract(10)
async def test_retry_with_the_same_idempotency_key_returns_the_first_acceptance(
    mesh: InProcessMesh,
) -> None:
    mesh.scripted.program("helper", Reply(gate=asyncio.Event()))
    ref = await root_with_child(mesh)
    first = await mesh.manager.send_message(ref, CHILD, "once", idempotency_key="k1")
    again = await mesh.manager.send_message(ref, CHILD, "once", idempotency_key="k1")
    assert (again.accepted_seq, again.kind, again.duplicate) == (
        first.accepted_seq,
        first.kind,
        True,
    )
    assert not first.duplicate
    assert len(of_type(await mesh.transcript(CHILD), AgentMessageEntry)) == 1
    with pytest.raises(IdempotencyConflict) as conflict:
        await mesh.manager.send_message(ref, CHILD, "different", idempotency_key="k1")
    assert conflict.value.reason is RejectionReason.IDEMPOTENCY_CONFLICT


@pytest.mark.contract(10)
async def test_a_retry_to_a_child_that_settled_since_resumes_nothing(mesh: InProcessMesh) -> None:
    mesh.scripted.program("helper", Reply(), Reply(), Reply())
    ref = await root_with_child(mesh)
    await mesh.manager.quiescent()
    first = await mesh.manager.send_message(ref, CHILD, "once", idempotency_key="k1")
    assert first.kind is DeliveryKind.COLD_RESUMED
    await mesh.manager.quiescent()
    assert mesh.manager.agent(CHILD) is None
    transcript, settled = await mesh.transcript(CHILD), len(await notices(mesh))

    again = await mesh.manager.send_message(ref, CHILD, "once", idempotency_key="k1")
    assert again == dataclasses.replace(first, duplicate=True)
    assert mesh.manager.agent(CHILD) is None  # not woken: nothing new to read
    assert await mesh.store.current_activation(CHILD) is None
    with pytest.raises(IdempotencyConflict):
        await mesh.manager.send_message(ref, CHILD, "different", idempotency_key="k1")
    # Two sends race a cold resume: one a retry, one new. The new one still gets in, once.
    both = await asyncio.gather(
        mesh.manager.send_message(ref, CHILD, "once", idempotency_key="k1"),
        mesh.manager.send_message(ref, CHILD, "twice", idempotency_key="k2"),
    )
    assert both[0] == again and not both[1].duplicate
    await mesh.manager.quiescent()
    after = await mesh.transcript(CHILD)
    texts = [r.entry.content for r in after if isinstance(r.entry, AgentMessageEntry)]
    assert texts == ["once", "twice"]
    assert after[: len(transcript)] == transcript
    assert len(await notices(mesh)) == settled + 1


@pytest.mark.contract(8)
async def test_a_notice_whose_caller_went_away_mid_append_is_still_read_once() -> None:
    """The child's host dies while its notice is being appended at the parent's node (the
    DeliverNotice call is cancelled): the notice is durable, so the parent must read it, and
    the activation's end must not add a "lost" notice after it; a retry adds nothing."""
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(SettlementNoticeEntry))
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"), Reply())
        mesh.scripted.program("helper", Reply(gate=asyncio.Event()))
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.scripted.wait_for_call(CHILD, 1)
        await mesh.manager.wait_until(lambda: mesh.manager.running(ROOT) is False)
        child = mesh.manager.agent(CHILD)
        assert child is not None
        notice = SettlementNoticeEntry(
            child_session=CHILD,
            child_activation=child.activation.activation_id,
            child_kind=SessionKind.CONTINUABLE_CHILD,
            outcome=SettlementOutcome.COMPLETED,
            terminal_output="done elsewhere",
        )
        delivering = asyncio.create_task(mesh.manager.deliver_notice(ROOT, notice))
        await held.reached.wait()
        delivering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await delivering
        held.release.set()

        def read_by_the_parent() -> bool:
            root = mesh.manager.agent(ROOT)
            records = [] if root is None else list(root.records)
            read = {s for r in of_type(records, ConsumedEntry) for s in r.entry.seqs}  # type: ignore[union-attr]
            return any(r.seq in read for r in of_type(records, SettlementNoticeEntry))

        async with asyncio.timeout(10):
            await mesh.manager.wait_until(read_by_the_parent)
        await mesh.manager.deliver_notice(ROOT, notice)  # the child's host retrying
        await mesh.manager.activation_ended(child.activation)
        assert await notices(mesh) == [notice]
        mesh.manager.interrupt(CHILD)


@pytest.mark.contract(2)
@pytest.mark.parametrize(
    ("target", "content", "error"),
    [
        ("s-2", "", InvalidArgument),
        ("s-2", "   ", InvalidArgument),
        ("s-2", "x" * 300_000, InvalidArgument),
        ("", "hi", InvalidArgument),
        ("s 2", "hi", InvalidArgument),
        ("s-99", "hi", TargetUnknown),
    ],
)
async def test_bad_input_is_rejected_with_a_typed_error_and_writes_nothing(
    mesh: InProcessMesh, target: str, content: str, error: type[Exception]
) -> None:
    mesh.scripted.program("helper", Reply(gate=asyncio.Event()))
    ref = await root_with_child(mesh)
    writes = mesh.store.writes
    with pytest.raises(error):
        await mesh.manager.send_message(ref, target, content)
    assert mesh.store.writes == writes


@pytest.mark.contract(7)
async def test_fork_child_request_head_is_byte_identical_and_starts_with_the_parent_prefix(
    mesh: InProcessMesh,
) -> None:
    mesh.scripted.program(
        "lead",
        Reply(text="first turn done"),
        tool("fork_agent", task="Explore option B."),
        Reply(text="forked"),
    )
    ref = await mesh.manager.create_root("Plan the work.", preset="lead")
    await mesh.manager.quiescent()
    await mesh.manager.submit_prompt(ref.session_id, "Now fork.")
    await mesh.manager.wait_until(lambda: bool(mesh.recorder.requests_of(CHILD)))
    await mesh.manager.quiescent()

    parent_requests = mesh.recorder.requests_of(ROOT)
    fork_request = mesh.recorder.requests_of(CHILD)[0]
    assert fork_request.model == parent_requests[0].model == "lead"  # same program, own cursor
    head = [
        (r.system_prompt, canonical_json([d.__dict__ for d in r.tools])) for r in parent_requests
    ]
    fork_head = (
        fork_request.system_prompt,
        canonical_json([d.__dict__ for d in fork_request.tools]),
    )
    assert all(h == fork_head for h in head)
    # The completed-turn prefix: the first turn's task and the model's final reply.
    completed_turn = parent_requests[1].messages[:2]
    assert [m.content for m in completed_turn] == ["Plan the work.", "first turn done"]
    assert fork_request.messages[:2] == completed_turn
    task = fork_request.messages[2].content
    assert task.startswith("Explore option B.")
    assert task.endswith(RETURN_INSTRUCTION.format(parent=json.dumps(ROOT)))
    child_records = await mesh.transcript(CHILD)
    assert isinstance(child_records[0].entry, ForkPrefixEntry)
    header = await mesh.manager.header(CHILD)
    assert header.fork_origin is not None and header.spec == (await mesh.manager.header(ROOT)).spec


@tool_decorator(replay="safe")
def look_up(term: str) -> str:
    """Look a term up in the team's glossary."""
    return f"{term}: a term"


@pytest.mark.contract(7)
async def test_a_fork_child_sends_its_parents_user_tools_byte_identical() -> None:
    """Rule 7 extends to user tools: the fork child's tools array is its parent's, byte for
    byte, user tools included, at the same places."""
    async with in_process_mesh(presets(), tools=(look_up,)) as team:
        team.scripted.program(
            "lead",
            tool("look_up", term="lease"),
            Reply(text="first turn done"),
            tool("fork_agent", task="Explore option B."),
            Reply(text="forked"),
        )
        ref = await team.manager.create_root("Plan the work.", preset="lead")
        await team.manager.quiescent()
        await team.manager.submit_prompt(ref.session_id, "Now fork.")
        await team.manager.wait_until(lambda: bool(team.recorder.requests_of(CHILD)))
        await team.manager.quiescent()
        parent_requests = team.recorder.requests_of(ROOT)
        fork_request = team.recorder.requests_of(CHILD)[0]
        results = of_type(await team.transcript(ROOT), ToolResultEntry)
    assert results[0].entry == ToolResultEntry(
        call_id=results[0].entry.call_id,  # type: ignore[union-attr]
        name="look_up",
        content="lease: a term",
    )
    names = [d.name for d in fork_request.tools]
    assert names[-1] == "look_up" and "send_message" in names
    fork_tools = canonical_json([d.__dict__ for d in fork_request.tools])
    for request in parent_requests:
        assert canonical_json([d.__dict__ for d in request.tools]) == fork_tools
        assert request.system_prompt == fork_request.system_prompt


@pytest.mark.contract(1)
async def test_the_only_model_authored_path_is_send_message(mesh: InProcessMesh) -> None:
    import inspect

    from dsh_mesh.runtime import ContinuationManager

    parameters = list(inspect.signature(ContinuationManager.send_message).parameters)
    assert parameters == ["self", "sender", "target_id", "content", "signal", "idempotency_key"]
    tool_names = [d.name for d in mesh.manager.registry.resolve(presets()[0]).descriptors]
    assert [n for n in tool_names if "message" in n or "report" in n] == ["send_message"]


@pytest.mark.contract(3)
async def test_parent_with_live_children_stays_resident_to_receive_their_results(
    mesh: InProcessMesh,
) -> None:
    release = asyncio.Event()
    mesh.scripted.program(
        "helper", tool("spawn_agent", task="grandchild work", preset="solo"), Reply(text="waiting")
    )
    mesh.scripted.program("solo", send(PARENT, "found it", gate=release), Reply())
    await root_with_child(mesh)
    grandchild = SessionId("s-3")
    await mesh.scripted.wait_for_call(grandchild, 1)
    await drain_loop()
    child = mesh.manager.agent(CHILD)
    assert child is not None  # idle but resident: its child is still live
    release.set()
    await mesh.manager.quiescent()
    child_messages = [
        r.entry.content
        for r in of_type(await mesh.transcript(CHILD), AgentMessageEntry)
        if isinstance(r.entry, AgentMessageEntry)
    ]
    assert child_messages == ["found it"]
    assert [n.child_session for n in await notices(mesh, CHILD)] == [grandchild]
    assert [n.child_session for n in await notices(mesh)] == [CHILD]


class ReusedCallIds(ScriptedProvider):
    """A model that numbers its tool calls per response (``call_0``, ``call_1``, ...), as some
    local servers do: the same call id comes back in every step."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        index = 0
        async for event in super().stream(request):
            if isinstance(event, ToolCallEvent):
                event = ToolCallEvent(call=dataclasses.replace(event.call, call_id=f"call_{index}"))
                index += 1
            yield event


async def test_a_model_that_reuses_call_ids_still_gets_every_message_through() -> None:
    # Found by the history checker: send_message keyed its idempotency on the tool call id
    # alone, so a new message under a reused id was refused as IDEMPOTENCY_CONFLICT.
    scripted = ReusedCallIds()
    async with in_process_mesh(presets(), scripted=scripted) as mesh:
        mesh.scripted.program(
            "helper", send(PARENT, "progress 1"), send(PARENT, "progress 2"), Reply(text="done")
        )
        await root_with_child(mesh)
        await mesh.manager.quiescent()
        results = [
            r.entry.content
            for r in of_type(await mesh.transcript(CHILD), ToolResultEntry)
            if isinstance(r.entry, ToolResultEntry)
        ]
        assert all("delivered" in result for result in results), results
        messages = [
            r.entry.content
            for r in of_type(await mesh.transcript(ROOT), AgentMessageEntry)
            if isinstance(r.entry, AgentMessageEntry)
        ]
        assert messages == ["progress 1", "progress 2"]


@pytest.mark.contract(8)
async def test_a_parent_that_moved_nodes_gets_no_lost_notice_for_a_child_it_heard_from() -> None:
    # Found by the history checker: the child's notice reached the parent's activation on one
    # node; the parent then moved to another node, whose manager saw the child's activation end
    # and, never having seen the notice itself, added a second one saying "lost".
    store = InMemorySessionStore()
    async with in_process_mesh(presets(), store=store) as first_node:
        first_node.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        first_node.scripted.program("helper", Reply(text="done"))
        await first_node.manager.create_root("Lead.", preset="lead")
        await first_node.manager.quiescent()
        child = await store.current_activation(CHILD)
        [delivered] = await notices(first_node)
    ended = delivered.child_activation
    assert child is None and delivered.outcome is SettlementOutcome.COMPLETED
    parent = await store.current_activation(ROOT)
    assert parent is not None  # a root stays resident
    await store.release(parent)  # the first node's lease expired
    second_node = ContinuationManager(
        store=store,
        provider=ScriptedProvider(programs={"lead": (Reply(),) * 3}),
        presets=presets(),
        config=ManagerConfig(node_id=NodeId("node-2")),
        ids=SequentialIds(prefix="n2-"),
    )
    async with second_node:
        await second_node.submit_prompt(ROOT, "Carry on.")  # the parent resumes here
        await second_node.activation_ended(
            Activation(
                session_id=CHILD,
                activation_id=ended,
                node_id=NodeId("node-1"),
                parent_activation=parent.activation_id,
            )
        )
        await second_node.quiescent()
    assert [n.outcome for n in await notices_in(store)] == [SettlementOutcome.COMPLETED]


async def notices_in(store: InMemorySessionStore) -> list[SettlementNoticeEntry]:
    return [r.entry for r in await store.read(ROOT) if isinstance(r.entry, SettlementNoticeEntry)]


async def test_a_root_whose_creator_went_away_mid_creation_is_made_whole() -> None:
    # Found by the wire fuzzer: CreateRootSession cut by its deadline after the header was
    # written left a root without its task, which no turn would ever read.
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(TaskEntry))
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", Reply(text="read it"))
        creating = asyncio.create_task(mesh.manager.create_root("Lead.", preset="lead"))
        await held.reached.wait()
        creating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await creating
        held.release.set()
        async with asyncio.timeout(10):
            await mesh.manager.wait_until(lambda: mesh.manager.agent(ROOT) is not None)
            await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)
        tasks = [r for r in records if isinstance(r.entry, TaskEntry)]
        read = {s for r in of_type(records, ConsumedEntry) for s in r.entry.seqs}  # type: ignore[union-attr]
        assert len(tasks) == 1 and tasks[0].seq in read


@pytest.mark.contract(8)
async def test_one_activation_gets_one_notice_whichever_nodes_write_it() -> None:
    # Found by the soak: two notices for one child activation, written by two nodes that each
    # could not know of the other's (a "lost" one by the parent's side when the child's host
    # missed its lease, the "completed" one by that host a moment later, to an absent parent).
    store = InMemorySessionStore()
    async with in_process_mesh(presets(), store=store) as first_node:
        first_node.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        first_node.scripted.program("helper", Stall())
        await first_node.manager.create_root("Lead.", preset="lead")
        await first_node.scripted.wait_for_call(CHILD, 1)
        child = await store.current_activation(CHILD)
        assert child is not None
    for session in (ROOT, CHILD):
        held = await store.current_activation(session)
        if held is not None:
            await store.release(held)  # the first node's lease expired
    notices_written = [
        SettlementNoticeEntry(
            child_session=CHILD,
            child_activation=child.activation_id,
            child_kind=SessionKind.CONTINUABLE_CHILD,
            outcome=outcome,
            terminal_output="",
        )
        for outcome in (SettlementOutcome.LOST, SettlementOutcome.COMPLETED)
    ]
    for node, notice in zip(("node-2", "node-3"), notices_written, strict=True):
        other = ContinuationManager(
            store=store,
            provider=ScriptedProvider(),
            presets=presets(),
            config=ManagerConfig(node_id=NodeId(node)),
            ids=SequentialIds(prefix=f"{node}-"),
        )
        async with other:
            await other.deliver_notice(ROOT, notice)  # the parent is absent: written for later
    assert [n.outcome for n in await notices_in(store)] == [SettlementOutcome.LOST]


@pytest.mark.contract(10)
async def test_a_retry_of_an_accepted_send_gets_its_acceptance_even_after_the_parent_moved_on(
    mesh: InProcessMesh,
) -> None:
    # Found by the 30-minute soak: a child's message landed at its parent, but the answer was
    # lost with the parent's host; the retry, under the same key, was refused PARENT_REBOUND
    # (the parent now ran elsewhere), so the child was told "not sent" about a message its
    # parent had.
    mesh.scripted.program("helper", Reply(gate=asyncio.Event()))
    await root_with_child(mesh)
    child = mesh.manager.agent(CHILD)
    root = mesh.manager.agent(ROOT)
    assert child is not None and root is not None
    first = await mesh.manager.send_message(child.ref, ROOT, "result", idempotency_key="k-1")
    await mesh.store.release(root.activation)  # the parent's host is gone
    retry = await mesh.manager.send_message(child.ref, ROOT, "result", idempotency_key="k-1")
    assert retry.duplicate and retry.accepted_seq == first.accepted_seq
    assert await mesh.store.try_activate(NEWER) == NEWER
    retry = await mesh.manager.send_message(child.ref, ROOT, "result", idempotency_key="k-1")
    assert retry.duplicate and retry.accepted_seq == first.accepted_seq
    # A new message is still refused, and so is another message under the same key.
    with pytest.raises(ParentNotLive):
        await mesh.manager.send_message(child.ref, ROOT, "more", idempotency_key="k-2")
    with pytest.raises(IdempotencyConflict):
        await mesh.manager.send_message(child.ref, ROOT, "other", idempotency_key="k-1")
    messages = [r for r in of_type(await mesh.transcript(ROOT), AgentMessageEntry)]
    assert [r.seq for r in messages] == [first.accepted_seq]


async def test_the_transcript_records_times_keys_and_where_each_turn_ran(
    mesh: InProcessMesh,
) -> None:
    # What a reader of the transcript is promised (dsh.mesh.v1): when the header and each record
    # were written, the key each message and prompt came with, and the node and activation of
    # every turn, durably with the turn.
    mesh.scripted.program("helper", send(PARENT, "result"), Reply(text="done"))
    await root_with_child(mesh)
    await mesh.manager.quiescent()
    await mesh.manager.submit_prompt(ROOT, "Again.", idempotency_key="human-1")
    await mesh.manager.quiescent()
    for session in (ROOT, CHILD):
        header = await mesh.manager.header(session)
        assert header.created_at is not None
        records = await mesh.transcript(session)
        assert all(r.recorded_at is not None for r in records)
        starts = [r.entry for r in records if isinstance(r.entry, TurnStartedEntry)]
        assert starts
        for start in starts:
            assert start.node_id == mesh.manager.node_id
            assert start.activation_id  # the activation that ran it (settled since)
    records = await mesh.transcript(ROOT)
    [prompt] = [r.entry for r in records if isinstance(r.entry, HumanPromptEntry)]
    assert prompt.idempotency_key == "human-1"
    [message] = [r.entry for r in records if isinstance(r.entry, AgentMessageEntry)]
    assert message.idempotency_key  # the child's tool call made it
    child_calls = [
        call.call_id
        for r in await mesh.transcript(CHILD)
        if isinstance(r.entry, AssistantStepEntry)
        for call in r.entry.tool_calls
    ]
    assert any(message.idempotency_key.endswith(f".{call}") for call in child_calls), message


def reads_noted(store: FaultySessionStore) -> list[int | None]:
    """The ``limit`` of every read of ``store`` from now on: None is a read of a whole
    transcript."""
    limits: list[int | None] = []

    async def note(call: StoreCall, proceed: Proceed) -> object:
        limits.append(cast(int | None, call.arguments["limit"]))
        return await proceed()

    store.faults.around("read", note, times=None)
    return limits


def gone_turn() -> TurnStartedEntry:
    """The start of a turn of activation ``a-gone`` on ``n1``, a host that then died."""
    return TurnStartedEntry(
        turn_id=TurnId("t-gone"), node_id=NodeId("n1"), activation_id=ActivationId("a-gone")
    )


async def test_a_lost_childs_last_output_is_found_from_the_end_back_in_pages() -> None:
    """The lost notice carries the child's last output; finding it reads the transcript from
    its end, a page at a time, never the whole of a long one (issue 18)."""
    store = FaultySessionStore()
    limits = reads_noted(store)
    async with in_process_mesh(presets(), store=store) as first_node:
        first_node.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        first_node.scripted.program("helper", Reply(text="the last finding"))
        await first_node.manager.create_root("Lead.", preset="lead")
        await first_node.manager.quiescent()
    await store.append(CHILD, gone_turn(), writer=None)  # then a host that died mid-turn
    for n in range(250):  # a long tail after it with no text of its own
        await store.append(
            CHILD, ToolResultEntry(call_id=f"c{n}", name="search", content="x"), writer=None
        )
    parent = await store.current_activation(ROOT)
    assert parent is not None  # a root stays resident
    await store.release(parent)
    second_node = ContinuationManager(
        store=store,
        provider=ScriptedProvider(programs={"lead": (Reply(),) * 3}),
        presets=presets(),
        config=ManagerConfig(node_id=NodeId("node-2")),
        ids=SequentialIds(prefix="n2-"),
    )
    async with second_node:
        await second_node.submit_prompt(ROOT, "Carry on.")
        limits.clear()
        await second_node.activation_ended(
            Activation(
                session_id=CHILD,
                activation_id=ActivationId("a-gone"),
                node_id=NodeId("n1"),
                parent_activation=parent.activation_id,
            )
        )
        await second_node.quiescent()
        tail_reads = [limit for limit in limits if limit is not None]
    lost = [n for n in await notices_in(store) if n.outcome is SettlementOutcome.LOST]
    assert [n.terminal_output for n in lost] == ["the last finding"]
    assert len(tail_reads) == 3 and max(tail_reads) <= 100  # 250 results: three pages back


async def test_a_child_lost_while_the_log_store_is_away_still_gets_its_lost_notice() -> None:
    # Found by the fault run's database kill (issue 18): the read of the lost child's last
    # output met the outage and the notice was dropped; it now waits, as the notice's write does.
    store = FaultySessionStore()
    async with in_process_mesh(presets(), store=store) as first_node:
        first_node.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        first_node.scripted.program("helper", Reply(text="the last finding"))
        await first_node.manager.create_root("Lead.", preset="lead")
        await first_node.manager.quiescent()
    await store.append(CHILD, gone_turn(), writer=None)  # a host that died mid-turn
    parent = await store.current_activation(ROOT)
    assert parent is not None  # a root stays resident
    await store.release(parent)
    second_node = ContinuationManager(
        store=store,
        provider=ScriptedProvider(programs={"lead": (Reply(),) * 3}),
        presets=presets(),
        config=ManagerConfig(node_id=NodeId("node-2"), outage_backoff=timedelta(milliseconds=1)),
        ids=SequentialIds(prefix="n2-"),
    )
    async with second_node:
        await second_node.submit_prompt(ROOT, "Carry on.")
        away = RegistryUnavailable("the log store is away")
        down = store.faults.fail("last", away, times=2)  # the first two reads of the end
        await second_node.activation_ended(
            Activation(
                session_id=CHILD,
                activation_id=ActivationId("a-gone"),
                node_id=NodeId("n1"),
                parent_activation=parent.activation_id,
            )
        )
        await second_node.quiescent()
    assert down.spent
    lost = [n for n in await notices_in(store) if n.outcome is SettlementOutcome.LOST]
    assert [n.terminal_output for n in lost] == ["the last finding"]
