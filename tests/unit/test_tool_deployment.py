"""A session's tools mean the same thing on every node: a node that lacks a tool a session's
header records, or serves one whose descriptor differs, refuses to resume that session with
``TOOLS_UNAVAILABLE`` (and holds no activation of it after), as it would refuse an unknown
model. A node that serves the same tool resumes it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest

from dsh_mesh.core import (
    NodeId,
    RandomIds,
    RejectionReason,
    SessionId,
    ToolsUnavailable,
)
from dsh_mesh.models import Action, Call, Reply, ScriptedProvider, Stall, tool
from dsh_mesh.runtime import ContinuationManager, InMemorySessionStore, ManagerConfig
from dsh_mesh.tools import FunctionTool, Preset, ToolContext
from dsh_mesh.tools import tool as python_tool
from dsh_mesh.transport import status_of

ROOT = SessionId("s-root")
PROGRAMS: dict[str, Sequence[Action]] = {
    "lead": (tool("spawn_agent", task="Take notes.", preset="helper"), Stall()),
    "helper": (Call(calls=(("read_note", {"name": "a"}),)), Reply(text="done")),
}


def read_note_tool(description: str = "Read a note.") -> FunctionTool:
    async def read_note(name: str, context: ToolContext) -> str:
        return f"note {name}"

    read_note.__doc__ = description
    return python_tool(read_note)


def node(
    store: InMemorySessionStore, name: str, tools: tuple[FunctionTool, ...]
) -> ContinuationManager:
    return ContinuationManager(
        store=store,
        provider=ScriptedProvider(programs=PROGRAMS, resume_from_transcript=True),
        presets=(
            Preset(name="lead", system_prompt="You lead.", model="lead"),
            Preset(name="helper", system_prompt="You help.", model="helper"),
        ),
        config=ManagerConfig(node_id=NodeId(name)),
        ids=RandomIds(),
        tools=tools,
    )


async def settled_child(store: InMemorySessionStore) -> SessionId:
    """Node one (with the tool) runs the child to its end; the child is then absent."""
    async with node(store, "node-1", (read_note_tool(),)) as one:
        await one.create_root("Lead.", preset="lead", session_id=ROOT)
        async with asyncio.timeout(10):
            while True:  # until the child has run its turn and settled (the root stalls)
                children = [
                    h.session_id
                    for h in [await store.get_header(SessionId(s)) for s in list(store._headers)]
                    if h is not None and h.parent_session == ROOT
                ]
                if children and await store.current_activation(children[0]) is None:
                    break
                await asyncio.sleep(0.01)
        [child] = children
        header = await store.get_header(child)
        assert header is not None
        assert "read_note" in [d.name for d in header.spec.tools]
    for session in (ROOT, child):
        current = await store.current_activation(session)
        if current is not None:
            await store.release(current)
    return child


@pytest.mark.parametrize(
    ("tools", "problem"),
    [((), "missing"), ((read_note_tool("Read a note, differently."),), "descriptor")],
    ids=["not-deployed", "other-descriptor"],
)
async def test_a_node_that_cannot_serve_a_recorded_tool_refuses_the_resume(
    tools: tuple[FunctionTool, ...], problem: str
) -> None:
    store = InMemorySessionStore()
    child = await settled_child(store)
    async with node(store, "node-2", tools) as two:
        with pytest.raises(ToolsUnavailable) as refused:
            await two.resume(child)
    assert refused.value.reason is RejectionReason.TOOLS_UNAVAILABLE
    assert refused.value.metadata == {"tool": "read_note", "problem": problem}
    assert not refused.value.retryable
    assert status_of(RejectionReason.TOOLS_UNAVAILABLE) is grpc.StatusCode.FAILED_PRECONDITION
    assert await store.current_activation(child) is None  # released, not held by a node


async def test_a_node_that_serves_the_same_tool_resumes_the_session() -> None:
    store = InMemorySessionStore()
    child = await settled_child(store)
    async with node(store, "node-2", (read_note_tool(),)) as two:
        activation = await two.resume(child)
        agent = two.agent(child)
        assert activation.node_id == "node-2" and agent is not None
        assert agent.tools.get("read_note") is not None
