"""Idle agents passivate (ADR 0044): an agent with no turn running, nothing unread, nothing on
its way to it, no call waiting for a decision and no live child ends its activation once idle
for ``idle_passivate_after``; its next prompt or decision cold-resumes it with everything it
had, and it stops counting against its namespace's live sessions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TypeVar

import pytest

from dsh_mesh.agent import Agent
from dsh_mesh.core import (
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    DeliveryKind,
    Record,
    RegistryUnavailable,
    SessionId,
)
from dsh_mesh.models import Reply, Stall, tool
from dsh_mesh.runtime import ContinuationManager, ManagerConfig
from dsh_mesh.testing import FaultySessionStore, InProcessMesh, in_process_mesh
from dsh_mesh.tools import ApprovalPolicy, Preset
from dsh_mesh.tools import tool as tool_decorator
from tests.unit.conftest import CHILD, ROOT, presets

T = TypeVar("T")


@tool_decorator(replay="unsafe")
def deploy(env: str) -> str:
    """Deploy to an environment."""
    return f"deployed to {env}"


APPROVING = (
    Preset(
        name="lead",
        system_prompt="You lead.",
        model="lead",
        approvals=ApprovalPolicy(tools=("deploy",), timeout=timedelta(hours=1)),
    ),
)

HOUR = timedelta(hours=1)
"""An ``idle_passivate_after`` no test waits out: each asks the check itself, at a given now.
Each asks a second past the hour (``since + 3601``): at exactly ``since + 3600`` the float sum
may fall a hair short, depending on how long the machine has been up."""


def entries(records: list[Record], kind: type[T]) -> list[T]:
    return [r.entry for r in records if isinstance(r.entry, kind)]


def _idle_since(manager: ContinuationManager, session: SessionId) -> float:
    agent = manager.agent(session)
    assert agent is not None
    since = agent.idle_since
    assert since is not None
    return since


def _check(manager: ContinuationManager, now: float) -> int:
    idle = manager.idle_passivation
    assert idle is not None
    return idle.check(now)


async def _live(mesh: InProcessMesh) -> int:
    census = await mesh.store.namespace_census("default", since=datetime.now(UTC))
    return census.live_sessions


async def test_an_idle_root_passivates_once_idle_that_long_and_its_next_prompt_resumes_it() -> None:
    async with in_process_mesh(presets(), config=ManagerConfig(idle_passivate_after=HOUR)) as mesh:
        mesh.scripted.program("solo", Reply(text="first"), Reply(text="second"))
        await mesh.manager.create_root("Answer.", preset="solo")
        await mesh.manager.quiescent()
        since = _idle_since(mesh.manager, ROOT)
        assert await _live(mesh) == 1

        assert _check(mesh.manager, since + 3599) == 0  # idle, but not for long enough
        assert _check(mesh.manager, since + 3601) == 1
        await mesh.manager.wait_until(lambda: mesh.manager.agent(ROOT) is None)
        assert await mesh.store.current_activation(ROOT) is None
        assert await _live(mesh) == 0  # the quota counts it no more
        before = await mesh.transcript(ROOT)

        delivery = await mesh.manager.submit_prompt(ROOT, "Again.")
        assert delivery.kind is DeliveryKind.COLD_RESUMED
        await mesh.manager.quiescent()
        after = await mesh.transcript(ROOT)
        assert after[: len(before)] == before
        assert [e.text for e in entries(after, AssistantStepEntry)] == ["first", "second"]
        # Idle again from the end of that turn: the clock starts over.
        assert _idle_since(mesh.manager, ROOT) > since


async def test_a_root_with_a_live_child_or_a_running_turn_stays_resident() -> None:
    async with in_process_mesh(presets(), config=ManagerConfig(idle_passivate_after=HOUR)) as mesh:
        mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="helper"))
        mesh.scripted.program("helper", Stall())
        await mesh.manager.create_root("Delegate.", preset="lead")
        await mesh.manager.wait_until(lambda: mesh.manager.running(ROOT) is False)
        await mesh.manager.wait_until(lambda: mesh.manager.running(CHILD) is True)
        since = _idle_since(mesh.manager, ROOT)
        child = mesh.manager.agent(CHILD)
        assert child is not None and child.idle_since is None  # running: not idle

        assert _check(mesh.manager, since + 10 * 3600) == 0  # docs/adr/0004: its child is live
        assert mesh.manager.agent(ROOT) is not None
        mesh.manager.interrupt(CHILD)


async def test_an_agent_waiting_for_a_decision_stays_resident() -> None:
    config = ManagerConfig(idle_passivate_after=HOUR)
    async with in_process_mesh(APPROVING, tools=(deploy,), config=config) as team:
        team.scripted.program("lead", tool("deploy", env="prod"), Reply(text="shipped"))
        await team.manager.create_root("Ship it.", preset="lead")
        await team.manager.quiescent()
        [request] = entries(await team.transcript(ROOT), ApprovalRequestEntry)
        agent = team.manager.agent(ROOT)
        assert agent is not None and agent.idle_since is None
        assert _check(team.manager, 1e12) == 0

        allow = ApprovalDecisionEntry(
            call_id=request.call_id,
            decision=ApprovalDecision.ALLOW,
            request_digest=request.digest,
            by="client:alice",
        )
        await team.manager.resolve_approval(ROOT, allow)
        await team.manager.quiescent()
        assert _check(team.manager, _idle_since(team.manager, ROOT) + 3601) == 1


async def test_a_send_on_its_way_holds_an_idle_agent() -> None:
    async with in_process_mesh(presets(), config=ManagerConfig(idle_passivate_after=HOUR)) as mesh:
        mesh.scripted.program("solo", Reply(text="first"))
        await mesh.manager.create_root("Answer.", preset="solo")
        await mesh.manager.quiescent()
        since = _idle_since(mesh.manager, ROOT)
        with mesh.manager._admission.reserve(ROOT):  # a send accepted, not yet in the inbox
            assert _check(mesh.manager, since + 3601) == 0
        assert _check(mesh.manager, since + 3601) == 1


async def test_the_check_runs_by_itself_while_the_manager_runs() -> None:
    config = ManagerConfig(idle_passivate_after=timedelta(milliseconds=20))
    async with in_process_mesh(presets(), config=config) as mesh:
        mesh.scripted.program("solo", Reply(text="first"))
        await mesh.manager.create_root("Answer.", preset="solo")
        await mesh.manager.wait_until(lambda: not mesh.manager.agents)
        assert await mesh.store.current_activation(ROOT) is None
        steps = entries(await mesh.transcript(ROOT), AssistantStepEntry)
        assert [e.text for e in steps] == ["first"]


async def test_a_defect_in_one_check_is_logged_and_the_next_check_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ManagerConfig(idle_passivate_after=timedelta(milliseconds=20))
    async with in_process_mesh(presets(), config=config) as mesh:
        idle = mesh.manager.idle_passivation
        assert idle is not None
        may_settle, asked = idle._may_settle, []

        def defective_once(agent: Agent) -> bool:
            asked.append(agent.session_id)
            if len(asked) == 1:
                raise RuntimeError("a defect")
            return may_settle(agent)

        idle._may_settle = defective_once
        mesh.scripted.program("solo", Reply(text="first"))
        await mesh.manager.create_root("Answer.", preset="solo")
        await mesh.manager.wait_until(lambda: not mesh.manager.agents)
    assert len(asked) >= 2  # the loop, and the drivers' task group, lived on
    assert "idle passivation: not checked this time" in caplog.text


async def test_off_there_is_no_check_and_an_idle_root_stays() -> None:
    async with in_process_mesh(presets(), config=ManagerConfig(idle_passivate_after=None)) as mesh:
        assert mesh.manager.idle_passivation is None
        mesh.scripted.program("solo", Reply(text="first"))
        await mesh.manager.create_root("Answer.", preset="solo")
        await mesh.manager.quiescent()
        assert mesh.manager.agent(ROOT) is not None


def test_idle_passivate_after_is_positive_or_off() -> None:
    assert ManagerConfig().idle_passivate_after == timedelta(minutes=15)
    for bad in (timedelta(0), timedelta(seconds=-1)):
        with pytest.raises(ValueError, match="idle_passivate_after"):
            ManagerConfig(idle_passivate_after=bad)


async def test_an_agent_in_doubt_about_an_answer_that_may_have_landed_stays_resident() -> None:
    """An accept whose answer was lost may have left a record the agent has not read: it reads
    the transcript past what it holds at its next boundary, so it must not leave before."""
    async with in_process_mesh(presets(), config=ManagerConfig(idle_passivate_after=HOUR)) as mesh:
        mesh.scripted.program("solo", Reply(text="first"))
        await mesh.manager.create_root("Answer.", preset="solo")
        await mesh.manager.quiescent()
        since = _idle_since(mesh.manager, ROOT)
        agent = mesh.manager.agent(ROOT)
        assert agent is not None
        agent.doubt()
        assert agent.idle_since is None
        assert _check(mesh.manager, since + 3601) == 0


async def test_etcd_away_when_an_idle_root_passivates_loses_nothing_and_its_prompt_resumes_it() -> (
    None
):
    """The release fails (etcd away): the agent leaves memory, its activation stays in etcd
    bound to this node's lease. The next prompt finds it held here by no agent, releases it,
    resumes the session and reads the prompt: nothing unread is left behind."""
    store = FaultySessionStore()
    store.faults.fail("release", RegistryUnavailable("etcd is away"), times=2)
    config = ManagerConfig(idle_passivate_after=HOUR)
    async with in_process_mesh(presets(), store=store, config=config) as mesh:
        mesh.scripted.program("solo", Reply(text="first"), Reply(text="second"))
        await mesh.manager.create_root("Answer.", preset="solo")
        await mesh.manager.quiescent()
        assert _check(mesh.manager, _idle_since(mesh.manager, ROOT) + 3601) == 1
        await mesh.manager.wait_until(lambda: mesh.manager.agent(ROOT) is None)
        held = await mesh.store.current_activation(ROOT)
        assert held is not None  # released by nobody yet

        delivery = await mesh.manager.submit_prompt(ROOT, "Again.")
        assert delivery.kind is DeliveryKind.COLD_RESUMED
        await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)
        assert [e.text for e in entries(records, AssistantStepEntry)] == ["first", "second"]
        resumed = await mesh.store.current_activation(ROOT)
        assert resumed is not None and resumed.activation_id != held.activation_id
