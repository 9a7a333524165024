"""Context compaction against the local chat-completions server over real HTTP (docs/context.md):
the provider's reported prompt tokens trigger it, a refusal as too long triggers it, the summary
request repeats the conversation's bytes so its prefix is cached, and the first request after a
compaction still hits the cache of its head; a compacted child keeps its task (its parent's id)
and reads its parent's message whole."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence

from bench._reader import BODY, PAGES, manual_reader, pages_read, read_page
from dsh_mesh.agent import SUMMARY_FRAME
from dsh_mesh.core import (
    AssistantStepEntry,
    CompactionEntry,
    Record,
    SessionId,
    TaskEntry,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.models import (
    ModelRouter,
    OpenAIEndpoint,
    OpenAIProvider,
    Reply,
    RetryPolicy,
    ScriptedProvider,
    child,
    send,
    tool,
)
from dsh_mesh.testing import (
    ChatCompletionsServer,
    Completion,
    RecordedRequest,
    ScriptedToolCall,
    in_process_mesh,
)
from dsh_mesh.tools import ContextPolicy, Preset

WAIT = 60
ROOT = SessionId("s-1")


def reader_presets(context: ContextPolicy) -> tuple[Preset, ...]:
    return (
        Preset(
            name="reader",
            system_prompt="You read manuals. " * 20,
            model="openai:test-model",
            context=context,
        ),
    )


def router(server: ChatCompletionsServer) -> ModelRouter:
    retry = RetryPolicy(max_attempts=2)
    endpoint = OpenAIEndpoint(base_url=server.base_url, retry=retry)
    return ModelRouter({"openai": OpenAIProvider(endpoint)}, default=ScriptedProvider())


def of(records: Sequence[Record], kind: type) -> list[Record]:
    return [r for r in records if isinstance(r.entry, kind)]


async def run_reader(server: ChatCompletionsServer, context: ContextPolicy) -> list[Record]:
    models = router(server)
    try:
        async with in_process_mesh(
            reader_presets(context), provider=models, tools=(read_page,)
        ) as mesh:
            await mesh.manager.create_root("Read the whole manual.", preset="reader")
            await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
            return await mesh.transcript(ROOT)
    finally:
        await models.aclose()


def assert_read_every_page_once(records: Sequence[Record]) -> None:
    [ended] = [r.entry for r in of(records, TurnEndedEntry)]
    assert isinstance(ended, TurnEndedEntry)
    assert ended.outcome is TurnOutcome.COMPLETED, ended.detail
    results = [r.entry.content for r in of(records, ToolResultEntry)]  # type: ignore[union-attr]
    assert results == [f"page {n}: {BODY}" for n in range(1, PAGES + 1)]


async def test_reported_prompt_tokens_trigger_compaction_and_the_head_stays_cached() -> None:
    window = ContextPolicy(window_tokens=4000, compact_at=0.6, clear_tool_outputs=False)
    async with ChatCompletionsServer(manual_reader) as server:
        records = await run_reader(server, window)
        bodies = [r.body for r in server.requests]

    assert_read_every_page_once(records)
    compactions = of(records, CompactionEntry)
    assert len(compactions) >= 2
    # Every step's prompt, as the provider reported it, stayed under the window.
    steps = [r.entry for r in of(records, AssistantStepEntry)]
    assert all(s.usage.input_tokens < 4000 for s in steps)  # type: ignore[union-attr]
    # The summary request repeats the conversation's bytes: the provider's cache serves most of
    # it. The first request after it still shares the head (system prompt, tools, task).
    first = compactions[0]
    assert isinstance(first.entry, CompactionEntry)
    summary_usage = first.entry.usage
    assert summary_usage.cached_input_tokens / summary_usage.input_tokens > 0.8
    before = next(
        r for r in reversed(records[: first.seq]) if isinstance(r.entry, AssistantStepEntry)
    )
    after = next(r for r in records[first.seq :] if isinstance(r.entry, AssistantStepEntry))
    assert isinstance(before.entry, AssistantStepEntry) and isinstance(
        after.entry, AssistantStepEntry
    )
    assert after.entry.usage.cached_input_tokens > 0
    assert after.entry.usage.input_tokens < before.entry.usage.input_tokens
    # What went over the wire after it: the head, the task, the summary, then what followed.
    wire = [json.loads(b) for b in bodies]
    summarised = next(
        w for w in wire if any(SUMMARY_FRAME in str(m.get("content")) for m in w["messages"])
    )
    roles = [m["role"] for m in summarised["messages"][:3]]
    assert roles == ["system", "user", "user"]
    assert summarised["messages"][1]["content"] == "Read the whole manual."


async def test_a_refusal_as_too_long_compacts_and_the_step_is_sent_again() -> None:
    # The preset knows no window: only the server's 400 "context_length_exceeded" tells.
    async with ChatCompletionsServer(manual_reader, max_context_tokens=3000) as server:
        records = await run_reader(server, ContextPolicy())
        refused = [r for r in server.requests if len(r.body) / 4 > 3000]

    assert_read_every_page_once(records)
    assert of(records, CompactionEntry)
    assert refused  # the server did refuse, and the agent went on


_PARENT_ID = re.compile(r'parent agent_id: "([^"]+)"')


def child_reader(request: RecordedRequest) -> Completion:
    """A child reading the manual: after the last page it sends its parent (whose id it reads
    from its task, wherever the conversation stands) one result, then finishes."""
    read = pages_read(request)
    if isinstance(request.json, dict) and request.json.get("tool_choice") == "none":
        return Completion(text=f"Summary: pages 1 to {read} read; all say the lease outlives.")
    if read < PAGES:
        return manual_reader(request)
    if read == PAGES:
        task = next(str(m["content"]) for m in request.messages if m.get("role") == "user")
        found = _PARENT_ID.search(task)
        assert found is not None, "the task lost its parent's id"
        result = json.dumps({"agent_id": found.group(1), "message": "the lease outlives"})
        return Completion(
            tool_calls=(
                ScriptedToolCall(call_id="call_send", name="send_message", arguments=result),
            )
        )
    return Completion(text="sent my result")


async def test_over_http_a_compacted_child_keeps_its_task_and_reads_its_parents_message_whole() -> (
    None
):
    scripted = ScriptedProvider()
    scripted.program(
        "lead",
        tool("spawn_agent", task="Read the whole manual.", preset="http-reader"),
        send(child(0), "also check the appendix"),
        Reply(text="waiting"),
        Reply(text="got it"),
    )
    window = ContextPolicy(window_tokens=4000, compact_at=0.6, clear_tool_outputs=False)
    presets = (
        Preset(name="lead", system_prompt="You lead.", model="lead"),
        Preset(
            name="http-reader",
            system_prompt="You read manuals for your parent. " * 10,
            model="openai:test-model",
            context=window,
        ),
    )
    async with ChatCompletionsServer(child_reader) as server:
        endpoint = OpenAIEndpoint(base_url=server.base_url, retry=RetryPolicy(max_attempts=2))
        models = ModelRouter({"openai": OpenAIProvider(endpoint)}, default=scripted)
        try:
            async with in_process_mesh(
                presets, scripted=scripted, provider=models, tools=(read_page,)
            ) as mesh:
                await mesh.manager.create_root("Lead.", preset="lead")
                await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
                child_records = await mesh.transcript(SessionId("s-2"))
                root_records = await mesh.transcript(ROOT)
        finally:
            await models.aclose()
        bodies = [json.loads(r.body) for r in server.requests]

    assert of(child_records, CompactionEntry)
    [task] = [r.entry.content for r in child_records if isinstance(r.entry, TaskEntry)]
    assert _PARENT_ID.search(task) is not None
    steps = [b for b in bodies if b.get("tool_choice") != "none"]
    compacted = [
        b for b in steps if any(SUMMARY_FRAME in str(m.get("content")) for m in b["messages"])
    ]
    assert compacted
    # Every request after a compaction starts with the task, whole, then the summary.
    for body in compacted:
        assert body["messages"][1] == {"role": "user", "content": task}
        assert str(body["messages"][2]["content"]).startswith(SUMMARY_FRAME)
    # The parent's message reached a step's request verbatim, never only a summary.
    framed = f"Agent {ROOT} sent a message:\nalso check the appendix"
    assert any(m.get("content") == framed for b in steps for m in b["messages"])
    # The result reached the parent: the child still knew whom to send it to.
    assert any(getattr(r.entry, "content", None) == "the lease outlives" for r in root_records)
