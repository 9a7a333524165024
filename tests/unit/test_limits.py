"""Limits and backpressure in one manager: past a limit the caller gets a typed, retryable
refusal (RESOURCE_EXHAUSTED on the wire, with RetryInfo) and nothing already accepted is
touched; once the pressure is gone the same request goes through."""

from __future__ import annotations

import asyncio

import pytest

from dsh_mesh.core import (
    AgentMessageEntry,
    AssistantStepEntry,
    DeliveryKind,
    InboxFull,
    NodeOverloaded,
    Record,
    RejectionReason,
    SettlementNoticeEntry,
    SettlementOutcome,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.models import Reply, Stall, tool
from dsh_mesh.runtime import DEFAULT_TURN_LIMITS, ManagerConfig, NamespaceLimits
from dsh_mesh.testing import FaultySessionStore, InProcessMesh, in_process_mesh, writing
from dsh_mesh.tools import Preset, TurnLimits
from dsh_mesh.tools import tool as tool_decorator
from tests.unit.conftest import CHILD, ROOT, of_type, presets


async def test_a_send_past_the_inbox_depth_is_refused_until_the_target_reads() -> None:
    config = ManagerConfig(max_inbox_depth=2)
    async with in_process_mesh(presets(), config=config) as mesh:
        gate = asyncio.Event()
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        mesh.scripted.program("helper", Reply(gate=gate), Reply(), Reply())
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.scripted.wait_for_call(CHILD, 1)  # mid-step: nothing is read until it ends
        for n in (1, 2):
            delivery = await mesh.manager.send_message(ref, CHILD, f"m{n}", idempotency_key=f"k{n}")
            assert delivery.kind is DeliveryKind.STEERED
        before = await mesh.transcript(CHILD)

        with pytest.raises(InboxFull) as full:
            await mesh.manager.send_message(ref, CHILD, "m3", idempotency_key="k3")
        assert full.value.reason is RejectionReason.INBOX_FULL and full.value.retryable
        assert full.value.metadata == {"target_session_id": CHILD}
        assert await mesh.transcript(CHILD) == before  # nothing written, nothing touched
        with pytest.raises(InboxFull):
            await mesh.manager.submit_prompt(CHILD, "a human, too")

        gate.set()  # the child reads m1 and m2 at its step boundary
        await mesh.manager.wait_until(lambda: mesh.manager.agent(CHILD) is None)
        retried = await mesh.manager.send_message(ref, CHILD, "m3", idempotency_key="k3")
        assert not retried.duplicate
        await mesh.manager.quiescent()
        texts = [
            r.entry.content
            for r in of_type(await mesh.transcript(CHILD), AgentMessageEntry)
            if isinstance(r.entry, AgentMessageEntry)
        ]
        assert texts == ["m1", "m2", "m3"]


async def test_sends_past_the_in_flight_limit_are_refused_while_the_node_is_busy() -> None:
    store = FaultySessionStore()
    held = store.faults.hold("append", when=writing(AgentMessageEntry))
    config = ManagerConfig(max_inflight_sends=1)
    async with in_process_mesh(presets(), store=store, config=config) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        mesh.scripted.program("helper", Reply(gate=asyncio.Event()))
        ref = await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.scripted.wait_for_call(CHILD, 1)
        first = asyncio.create_task(
            mesh.manager.send_message(ref, CHILD, "held", idempotency_key="k1")
        )
        await held.reached.wait()  # the one send this node may handle is in its append

        with pytest.raises(NodeOverloaded) as busy:
            await mesh.manager.send_message(ref, CHILD, "second", idempotency_key="k2")
        assert busy.value.reason is RejectionReason.NODE_OVERLOADED and busy.value.retryable
        assert busy.value.metadata == {"limit": "inflight_sends"}

        held.release.set()
        assert (await first).accepted_seq > 0
        assert not (
            await mesh.manager.send_message(ref, CHILD, "second", idempotency_key="k2")
        ).duplicate
        mesh.manager.interrupt(CHILD)


async def test_a_new_session_past_the_resident_limit_is_refused_and_nothing_is_created() -> None:
    config = ManagerConfig(max_resident_sessions=1)
    async with in_process_mesh(presets(), config=config) as mesh:
        mesh.scripted.program("lead", Reply(gate=asyncio.Event()))
        await mesh.manager.create_root("Lead.", preset="lead")
        with pytest.raises(NodeOverloaded) as full:
            await mesh.manager.create_root("Another.", preset="lead")
        assert full.value.metadata == {"limit": "resident_sessions"}
        assert [a.session_id for a in mesh.manager.agents] == [ROOT]
        mesh.manager.interrupt(ROOT)


def test_limits_must_be_positive() -> None:
    for name in ("max_inbox_depth", "max_inflight_sends", "max_resident_sessions"):
        with pytest.raises(ValueError, match=name):
            ManagerConfig(**{name: 0})  # type: ignore[arg-type]


async def test_under_memory_pressure_only_idle_agents_that_may_end_are_passivated() -> None:
    async with in_process_mesh(presets()) as mesh:
        mesh.scripted.program("solo", Reply(text="first"), Reply(text="second"))
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        mesh.scripted.program("helper", Stall())
        idle = await mesh.manager.create_root("Answer.", preset="solo")
        delegating = await mesh.manager.create_root("Delegate.", preset="lead")
        await mesh.manager.wait_until(lambda: mesh.manager.agent(idle.session_id) is not None)
        await mesh.manager.wait_until(lambda: len(mesh.manager.agents) == 3)
        await mesh.manager.wait_until(lambda: mesh.manager.running(idle.session_id) is False)
        await mesh.manager.wait_until(lambda: mesh.manager.running(delegating.session_id) is False)
        # The idle root may end; the delegating root has a live (running) child; the child runs.
        assert mesh.manager.passivate_idle(10) == 1
        await mesh.manager.wait_until(lambda: mesh.manager.agent(idle.session_id) is None)
        assert await mesh.store.current_activation(idle.session_id) is None
        assert mesh.manager.agent(delegating.session_id) is not None
        assert len(mesh.manager.agents) == 2
        before = await mesh.transcript(idle.session_id)
        # Its next prompt cold-resumes it with everything it had.
        delivery = await mesh.manager.submit_prompt(idle.session_id, "Again.")
        assert delivery.kind is DeliveryKind.COLD_RESUMED
        await mesh.manager.wait_until(lambda: mesh.manager.running(idle.session_id) is False)
        after = await mesh.transcript(idle.session_id)
        assert after[: len(before)] == before
        assert mesh.manager.passivate_idle(0) == 0


async def test_a_turn_past_its_token_budget_ends_in_token_exhaustion_before_its_tools_run() -> None:
    """The preset's ``turn_token_budget`` counts prompt plus completion tokens the provider
    reports over one turn; the call that reaches it is recorded, its tool calls are not run,
    and the turn settles as token exhaustion. ``max_output_tokens`` reaches the provider."""
    frugal = Preset(
        name="frugal",
        system_prompt="You are brief.",
        model="frugal",
        limits=TurnLimits(max_output_tokens=64, turn_token_budget=30),
    )
    async with in_process_mesh((*presets(), frugal)) as mesh:
        mesh.scripted.program(
            "frugal",
            tool("spawn_agent", task="t", preset="helper"),  # about 20 tokens: under budget
            tool("spawn_agent", task="t2", preset="helper"),  # the budget is reached here
            Reply(text="never asked for"),
        )
        ref = await mesh.manager.create_root("Go.", preset="frugal")
        await mesh.manager.quiescent()
        records = await mesh.transcript(ref.session_id)
        first_turn = records[
            : next(n for n, r in enumerate(records) if isinstance(r.entry, TurnEndedEntry)) + 1
        ]
        steps = [r.entry for r in first_turn if isinstance(r.entry, AssistantStepEntry)]
        assert len(steps) == 2
        spent = sum(s.usage.input_tokens + s.usage.output_tokens for s in steps)
        assert spent >= 30 > steps[0].usage.input_tokens + steps[0].usage.output_tokens
        ended = first_turn[-1].entry
        assert isinstance(ended, TurnEndedEntry)
        assert ended.outcome is TurnOutcome.TOKEN_EXHAUSTION
        assert f"the turn used {spent} tokens; its budget is 30" in ended.detail
        results = [r.entry for r in first_turn if isinstance(r.entry, ToolResultEntry)]
        assert [r.is_error for r in results] == [False, True]  # the second spawn never ran
        assert results[1].content.startswith("not run: the turn ended")
        assert {r.max_output_tokens for r in mesh.recorder.requests_of(ref.session_id)} == {64}
        assert {r.max_output_tokens for r in mesh.recorder.requests_of(CHILD)} == {None}


# -- default turn budgets (ADR 0037) -------------------------------------------------------------

LOOPING = 5_000
"""Steps of a model that never stops asking for a tool: far past any default."""


def looping_presets(**limits: int) -> tuple[Preset, ...]:
    return (
        Preset(name="lead", system_prompt="You lead.", model="lead"),
        Preset(
            name="looper",
            system_prompt="You loop.",
            model="looper",
            limits=TurnLimits(**limits),
        ),
    )


def loop_forever(mesh: InProcessMesh) -> None:
    """The looper asks for one more tool call at every step, for ever (as a model that lost
    its place after a compaction did: issue 30)."""
    mesh.scripted.program("looper", *(tool("look_again") for _ in range(LOOPING)))


@tool_decorator(replay="safe")
def look_again() -> str:
    """Look once more."""
    return "nothing new"


def first_turn_steps(records: list[Record]) -> tuple[int, TurnEndedEntry]:
    ended = next(r.entry for r in records if isinstance(r.entry, TurnEndedEntry))
    assert isinstance(ended, TurnEndedEntry)
    return sum(isinstance(r.entry, AssistantStepEntry) for r in records), ended


async def test_a_model_that_loops_for_ever_is_stopped_at_the_default_call_limit() -> None:
    """No preset or namespace says anything: the default stops the turn after
    DEFAULT_TURN_LIMITS.max_model_calls model calls, with the typed outcome
    ``token-exhaustion``, and the parent's settlement notice carries it."""
    limit = DEFAULT_TURN_LIMITS.max_model_calls
    assert limit is not None
    async with in_process_mesh(tools=(look_again,), presets=looping_presets()) as mesh:
        loop_forever(mesh)
        mesh.scripted.program(
            "lead", tool("spawn_agent", task="Loop.", preset="looper"), Reply(text="Delegated.")
        )
        await mesh.manager.create_root("Lead.", preset="lead")
        await mesh.manager.quiescent()
        steps, ended = first_turn_steps(await mesh.transcript(CHILD))
        assert steps == limit
        assert ended.outcome is TurnOutcome.TOKEN_EXHAUSTION
        assert f"the turn made {limit} model calls; its limit is {limit}" in ended.detail
        [notice] = [
            r.entry
            for r in await mesh.transcript(ROOT)
            if isinstance(r.entry, SettlementNoticeEntry)
        ]
        assert notice.outcome is SettlementOutcome.TOKEN_EXHAUSTION
        assert notice.detail == ended.detail


async def test_a_presets_own_call_limit_overrides_the_default_and_the_namespaces() -> None:
    config = ManagerConfig(namespaces={"team": NamespaceLimits(turn=TurnLimits(max_model_calls=9))})
    async with in_process_mesh(
        looping_presets(max_model_calls=4), config=config, tools=(look_again,)
    ) as mesh:
        loop_forever(mesh)
        ref = await mesh.manager.create_root("Loop.", preset="looper", namespace="team")
        await mesh.manager.wait_until(lambda: mesh.manager.running(ref.session_id) is False)
        steps, ended = first_turn_steps(await mesh.transcript(ref.session_id))
    assert (steps, ended.outcome) == (4, TurnOutcome.TOKEN_EXHAUSTION)


async def test_a_namespaces_call_limit_overrides_the_default_for_its_sessions_only() -> None:
    config = ManagerConfig(namespaces={"team": NamespaceLimits(turn=TurnLimits(max_model_calls=7))})
    async with in_process_mesh(
        tools=(look_again,), presets=looping_presets(), config=config
    ) as mesh:
        loop_forever(mesh)
        ref = await mesh.manager.create_root("Loop.", preset="looper", namespace="team")
        await mesh.manager.wait_until(lambda: mesh.manager.running(ref.session_id) is False)
        steps, ended = first_turn_steps(await mesh.transcript(ref.session_id))
        assert (steps, ended.outcome) == (7, TurnOutcome.TOKEN_EXHAUSTION)


async def test_a_namespaces_token_budget_overrides_the_default() -> None:
    config = ManagerConfig(
        namespace_limits=NamespaceLimits(turn=TurnLimits(turn_token_budget=40)),
    )
    async with in_process_mesh(
        tools=(look_again,), presets=looping_presets(), config=config
    ) as mesh:
        loop_forever(mesh)
        ref = await mesh.manager.create_root("Loop.", preset="looper")
        await mesh.manager.wait_until(lambda: mesh.manager.running(ref.session_id) is False)
        steps, ended = first_turn_steps(await mesh.transcript(ref.session_id))
    assert ended.outcome is TurnOutcome.TOKEN_EXHAUSTION
    assert "its budget is 40" in ended.detail and steps < 10


def test_the_defaults_bound_a_turn_and_leave_room_for_a_long_one() -> None:
    """ADR 0037: a bound by default, far above the anchors' (10, 25), so a coding agent's
    turn of a few hundred steps runs; a token budget that a turn of that many calls over a
    large context does not reach first."""
    calls, tokens = DEFAULT_TURN_LIMITS.max_model_calls, DEFAULT_TURN_LIMITS.turn_token_budget
    assert calls is not None and tokens is not None
    assert 25 < 200 <= calls <= 1_000
    assert tokens >= 200 * 64_000
    assert NamespaceLimits().turn == DEFAULT_TURN_LIMITS
