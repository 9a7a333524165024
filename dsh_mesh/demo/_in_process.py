"""The in-process demo: a root agent, two continuable children and a one-shot child.

Run with ``python -m dsh_mesh.demo --in-process``. Everything is scripted and deterministic;
it prints each transcript with sources and settlement notices.
"""

from __future__ import annotations

import asyncio

from dsh_mesh.core import (
    Record,
    SequentialIds,
    SessionId,
    ToolResultEntry,
    session_usage,
)
from dsh_mesh.demo._describe import describe
from dsh_mesh.demo._scenario import sibling
from dsh_mesh.models import PARENT, Call, Reply, ScriptedProvider, child, send
from dsh_mesh.runtime import ContinuationManager, InMemorySessionStore
from dsh_mesh.tools import Preset


def build_provider(followup: asyncio.Event, resume_a: asyncio.Event) -> ScriptedProvider:
    provider = ScriptedProvider()
    provider.program(
        "lead",
        Call(
            text="I will split the survey between two researchers and a glossary helper.",
            calls=(("spawn_agent", {"task": "Survey etcd lease semantics.", "preset": "alpha"}),),
        ),
        Call(
            calls=(
                (
                    "spawn_agent",
                    {
                        "task": lambda c: (
                            f"Survey gRPC deadlines. sibling agent_id: {c.child_id(0)}"
                        ),
                        "preset": "beta",
                    },
                ),
                ("spawn_one_shot", {"task": "Define 'activation' in one line.", "preset": "gloss"}),
            ),
        ),
        send(child(0), "Also check what happens when keepalive fails past the TTL.", gate=followup),
        Reply(text="Delegated. I will merge results as they arrive."),
        Reply(text="Merged the findings received so far."),
        Reply(text="All delegates have settled; the survey is complete."),
    )
    provider.program(
        "alpha",
        send(PARENT, "Progress: leases are granted with a TTL and kept alive by refresh."),
        Reply(text="Reading the keepalive code...", gate=resume_a),
        send(
            PARENT,
            "Result: a lease expires TTL seconds after its last refresh; keys bound to it vanish, "
            "so a node that misses keepalives past the TTL loses its activations.",
        ),
        Reply(text="Survey of etcd leases complete."),
    )
    provider.program(
        "beta",
        send(sibling, "Hi sibling, want to compare notes?"),
        send(PARENT, "Result: every gRPC call carries a deadline; servers see it as time left."),
        Reply(text="Survey of gRPC deadlines complete."),
    )
    provider.program("gloss", Reply(text="Activation: one live residency of a session on a node."))
    return provider


PRESETS = (
    Preset(name="lead", system_prompt="You lead a survey team.", model="lead"),
    Preset(name="alpha", system_prompt="You are a careful researcher.", model="alpha"),
    Preset(name="beta", system_prompt="You are a careful researcher.", model="beta"),
    Preset(name="gloss", system_prompt="You write glossary entries.", model="gloss"),
)


async def run_demo() -> dict[SessionId, list[Record]]:
    """Run the scenario and return every transcript, root first."""
    followup, resume_a = asyncio.Event(), asyncio.Event()
    provider = build_provider(followup, resume_a)
    store = InMemorySessionStore()
    ids = SequentialIds()
    async with ContinuationManager(
        store=store, provider=provider, presets=PRESETS, ids=ids
    ) as manager:
        root = await manager.create_root("Survey the coordination stack.", preset="lead")
        alpha = SessionId("s-2")
        # Steer a running child: the parent's follow-up goes out while alpha is mid-turn...
        await provider.wait_for_call(alpha, 2)
        followup.set()
        await manager.wait_until(lambda: _has_tool_result(manager, root.session_id, 4))
        # ...and alpha reads it at its next step boundary.
        resume_a.set()
        await manager.quiescent()
        transcripts = {root.session_id: await manager.transcript(root.session_id)}
        for session in (SessionId("s-2"), SessionId("s-3"), SessionId("s-4")):
            transcripts[session] = await manager.transcript(session)
    return transcripts


def _has_tool_result(manager: ContinuationManager, session: SessionId, count: int) -> bool:
    agent = manager.agent(session)
    records = agent.records if agent is not None else ()
    return sum(isinstance(r.entry, ToolResultEntry) for r in records) >= count


def main() -> None:
    """Run the in-process demo and print its transcripts."""
    transcripts = asyncio.run(run_demo())
    names = {
        "s-1": "root (lead)",
        "s-2": "child alpha (continuable)",
        "s-3": "child beta (continuable)",
        "s-4": "child gloss (one-shot)",
    }
    for session, records in transcripts.items():
        print(f"\n=== {session}: {names.get(session, '')} ===")
        print(f"  usage: {session_usage(r.entry for r in records).describe(first_call=False)}")
        for record in records:
            print(describe(record))
