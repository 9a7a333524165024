"""The step boundary's two promises (docs/adr/0007), each forced with the interleaving that broke
it on a store whose appends suspend:

- messages waiting together are read in acceptance (seq) order, whatever order their appends'
  answers came back in;
- a ConsumedEntry is true: every Steer record durable before it (lower seq) is read by it or by
  an earlier one; none is left for a later boundary.
"""

from __future__ import annotations

import asyncio

import pytest

from dsh_mesh.agent import Agent
from dsh_mesh.core import AgentMessageEntry, RegistryUnavailable, Role, SessionId
from dsh_mesh.models import Reply, tool
from dsh_mesh.testing import (
    FaultySessionStore,
    InProcessMesh,
    boundary_violations,
    in_process_mesh,
    writing,
)
from tests.unit.conftest import GateTool, drain_loop, presets

ROOT = SessionId("s-1")
CHILD = SessionId("s-2")


async def _root_with_busy_child(mesh: InProcessMesh, gate_tool: GateTool, *, then: str) -> Agent:
    """A root whose child is inside a tool call (held by ``gate_tool``), then answers ``then``."""
    mesh.scripted.program("worker", tool("wait"), Reply(text=then))
    mesh.scripted.program("lead", tool("spawn_agent", task="t", preset="worker"), Reply())
    await mesh.manager.create_root("Lead.", preset="lead")
    await gate_tool.entered.wait()
    root = mesh.manager.agent(ROOT)
    assert root is not None
    return root


@pytest.mark.contract(9)
async def test_messages_waiting_together_are_read_in_seq_order_when_answers_come_back_reversed(
    gate_tool: GateTool,
) -> None:
    store = FaultySessionStore()
    answer = store.faults.hold("append", landed=True, when=writing(AgentMessageEntry))
    async with in_process_mesh(presets(gate_tool), store=store) as mesh:
        root = await _root_with_busy_child(mesh, gate_tool, then="read them")
        first = asyncio.create_task(mesh.manager.send_message(root.ref, CHILD, "first"))
        await answer.reached.wait()
        second = await mesh.manager.send_message(root.ref, CHILD, "second")
        answer.release.set()
        first_delivery = await first
        assert first_delivery.accepted_seq < second.accepted_seq

        gate_tool.gate.set()
        await mesh.manager.quiescent()
        step_two = mesh.recorder.requests_of(CHILD)[1].messages
        assert [m.role for m in step_two[-3:]] == [Role.TOOL, Role.USER, Role.USER]
        assert [m.content for m in step_two[-2:]] == [
            f"Agent {ROOT} sent a message:\nfirst",
            f"Agent {ROOT} sent a message:\nsecond",
        ]
        assert boundary_violations(await mesh.transcript(CHILD)) == []


@pytest.mark.contract(3)
@pytest.mark.contract(9)
async def test_a_message_durable_before_a_step_boundary_is_read_at_that_boundary(
    gate_tool: GateTool,
) -> None:
    store = FaultySessionStore()
    answer = store.faults.hold("append", landed=True, when=writing(AgentMessageEntry))
    async with in_process_mesh(presets(gate_tool), store=store) as mesh:
        root = await _root_with_busy_child(mesh, gate_tool, then="read it")
        # The message is durable (it has its seq) but its accept has not come back yet when
        # the child's tool returns and the child reaches its step boundary.
        sending = asyncio.create_task(mesh.manager.send_message(root.ref, CHILD, "early"))
        await answer.reached.wait()
        gate_tool.gate.set()
        await drain_loop()
        answer.release.set()
        await sending
        await mesh.manager.quiescent()

        records = await mesh.transcript(CHILD)
        assert boundary_violations(records) == []
        # ...and the model read it in the step right after that boundary.
        step_two = mesh.recorder.requests_of(CHILD)[1].messages
        assert step_two[-1].content == f"Agent {ROOT} sent a message:\nearly"


@pytest.mark.contract(3)
async def test_a_message_whose_accept_lost_its_answer_is_still_read_at_the_next_boundary(
    gate_tool: GateTool,
) -> None:
    store = FaultySessionStore()
    lost = RegistryUnavailable("etcd went away before it answered")
    store.faults.fail("append", lost, landed=True, when=writing(AgentMessageEntry))
    async with in_process_mesh(presets(gate_tool), store=store) as mesh:
        root = await _root_with_busy_child(mesh, gate_tool, then="read it")
        with pytest.raises(RegistryUnavailable):
            await mesh.manager.send_message(root.ref, CHILD, "landed unheard")
        gate_tool.gate.set()
        await mesh.manager.quiescent()

        records = await mesh.transcript(CHILD)
        assert boundary_violations(records) == []
        step_two = mesh.recorder.requests_of(CHILD)[1].messages
        assert step_two[-1].content == f"Agent {ROOT} sent a message:\nlanded unheard"
