"""Token deltas across nodes (ADR 0053): a watch served by one node process shows the model text
of a session running on another as the local chat-completions server streams it, before the
step is stored, and the stored transcript holds no trace of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

from dsh_mesh.client import (
    AssistantStep,
    Consumed,
    HumanPrompt,
    MeshClient,
    SessionEvent,
    Task,
    TurnEnded,
    TurnStarted,
)
from dsh_mesh.testing import (
    ChatCompletionsServer,
    Completion,
    EtcdAddress,
    RecordedRequest,
)
from tests.integration.served import address, served_cluster

WAIT = 60
PRESETS = """
[presets.writer]
system_prompt = "You write slowly."
model = "local:served-model"
"""
ATTEMPTS = 4
"""Turns the test may take: the relay at the hosting node is set up just after the watch tells
where the session runs, and a turn that starts before that shows only the text after it."""


def answer(n: int) -> str:
    return f"Answer {n}: the lease outlives\nits holder, by design."


async def test_a_watch_on_one_node_shows_the_text_of_a_step_written_on_another(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    go = asyncio.Event()
    calls = 0

    async def model(_request: RecordedRequest) -> Completion:
        nonlocal calls
        await go.wait()  # not before the watch has seen where the session runs
        calls += 1
        return Completion(text=answer(calls), pieces=5)

    async with ChatCompletionsServer(responder=model) as server:
        with served_cluster(etcd, tmp_path, server, PRESETS, nodes=("node-a", "node-b")) as cluster:
            a, b = address(cluster, "node-a"), address(cluster, "node-b")
            token = cluster.settings.cluster_token
            async with (
                MeshClient(a, token=token) as on_a,
                MeshClient(b, token=token) as on_b,
            ):
                root = await on_a.create_root("writer", "Tell me.", node="node-a")
                events = on_b.watch(root.session_id, deltas=True)
                async with asyncio.timeout(WAIT):
                    whole = await _a_whole_step(events, on_a, root.session_id, go)
                    await events.aclose()
                page = await on_b.get_session(root.session_id)

    deltas, step = whole
    assert len(deltas) >= 2, "the text came in several pieces"
    assert "".join(d.delta.text for d in deltas if d.delta) == step.text
    assert all(d.delta is not None and d.delta.dropped == 0 for d in deltas)
    assert server.requests  # the model was asked over HTTP
    # Never stored: the transcript holds what a watch without deltas shows, nothing else.
    kinds = {type(e.body) for e in page.transcript}
    assert kinds <= {Task, HumanPrompt, Consumed, TurnStarted, AssistantStep, TurnEnded}
    assert [e.body.text for e in page.transcript if isinstance(e.body, AssistantStep)] == [
        answer(n) for n in range(1, calls + 1)
    ]


async def _a_whole_step(
    events: AsyncGenerator[SessionEvent, None],
    client: MeshClient,
    session: str,
    go: asyncio.Event,
) -> tuple[list[SessionEvent], AssistantStep]:
    """Read the watch until a step whose every piece came as a delta before it (prompting
    again when a step's first pieces went by before the relay was set up); return that
    step's deltas and the step."""
    deltas: list[SessionEvent] = []
    attempts = 0
    async for event in events:
        if event.activated is not None and event.activated.node_id == "node-a":
            go.set()
        if event.delta is not None:
            assert event.session_id == session
            deltas.append(event)
        elif event.entry is not None and isinstance(event.entry.body, AssistantStep):
            step = event.entry.body
            text = "".join(d.delta.text for d in deltas if d.delta)
            if deltas and text == step.text:
                return deltas, step
            assert step.text.endswith(text), "deltas are the step's text, in order"
            attempts += 1
            assert attempts < ATTEMPTS, "no step's text came whole as deltas"
            deltas = []
            await client.prompt(session, "Again.")
    raise AssertionError("the watch ended")
