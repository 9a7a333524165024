"""The OpenAI-compatible provider against a real inference engine: llama.cpp's own HTTP server
(``dsh_mesh.testing.LlamaServer``, from the ``xllamacpp`` wheel) on the tiny model the test
writes (``write_tiny_model``: random weights plus a crafted script, so what it says is known):

- text streams in pieces, and the usage chunk reports prompt, completion and cached tokens
  from the engine's real prefix cache;
- a tool call is put together from the pieces the engine streams;
- a call the engine's token limit cut off is dropped, and the step is token exhaustion;
- real node processes, configured by a presets file, run a lead that forks: the fork child's
  first call is mostly served from the engine's cache, its parent's first call was not;
- the server's lifecycle: starts once, stops idempotently, always reaped, a failed start says so.

Nothing is downloaded; each test starts its own server (a fresh cache) in well under a second.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsh_mesh.client import (
    AssistantStep,
    MeshClient,
    SessionPage,
    SettlementNotice,
    ToolResult,
    TurnEnded,
)
from dsh_mesh.core import ChatMessage, Role, SessionId, SettlementOutcome, TurnOutcome
from dsh_mesh.models import (
    Finished,
    FinishReason,
    ModelEvent,
    ModelRequest,
    OpenAIEndpoint,
    OpenAIProvider,
    RetryPolicy,
    TextDelta,
    ToolCallEvent,
)
from dsh_mesh.models._openai_wire import request_body
from dsh_mesh.testing import (
    EtcdAddress,
    LlamaServer,
    LlamaServerError,
    LocalCluster,
    TinyModel,
    write_tiny_model,
)
from dsh_mesh.tools import SEND_MESSAGE_DESCRIPTOR, SPAWN_DESCRIPTORS

WAIT = 30
TOOLS = (SEND_MESSAGE_DESCRIPTOR, *SPAWN_DESCRIPTORS.values())
FAST = RetryPolicy(max_attempts=2, initial_backoff=timedelta(milliseconds=10))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture
async def llama(tiny: TinyModel) -> AsyncIterator[LlamaServer]:
    async with LlamaServer(tiny.path) as server:
        yield server


@pytest.fixture
async def provider(llama: LlamaServer) -> AsyncIterator[OpenAIProvider]:
    model = OpenAIProvider(OpenAIEndpoint(base_url=llama.base_url, retry=FAST), name="llama")
    try:
        yield model
    finally:
        await model.aclose()


def request(
    last: str, *, tools: bool = False, max_output_tokens: int | None = None
) -> ModelRequest:
    return ModelRequest(
        session_id=SessionId("s-1"),
        model="tiny",
        system_prompt="You answer briefly.",
        tools=TOOLS if tools else (),
        messages=(ChatMessage(role=Role.USER, content=last),),
        max_output_tokens=max_output_tokens,
    )


async def events_of(provider: OpenAIProvider, call: ModelRequest) -> list[ModelEvent]:
    return [event async for event in provider.stream(call)]


async def raw_chunks(server: LlamaServer, call: ModelRequest) -> list[dict[str, Any]]:
    """The engine's own streamed chunks for ``call``, read without the provider."""
    body = request_body(call, model=call.model, max_output_tokens=call.max_output_tokens)
    chunks: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(base_url=server.base_url + "/") as client,
        client.stream("POST", "chat/completions", content=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def tool_call_pieces(chunks: list[dict[str, Any]]) -> list[str]:
    """The argument pieces of every tool-call delta, in stream order."""
    return [
        call.get("function", {}).get("arguments") or ""
        for chunk in chunks
        for choice in chunk.get("choices") or ()
        for call in choice.get("delta", {}).get("tool_calls") or ()
    ]


async def test_text_streams_in_pieces_with_the_engines_usage_and_prefix_cache(
    tiny: TinyModel, provider: OpenAIProvider
) -> None:
    first = await events_of(provider, request("Hello there."))
    *deltas, finished = first
    assert deltas == [TextDelta(text=piece) for piece in tiny.reply]
    assert isinstance(finished, Finished) and finished.finish_reason is FinishReason.STOP
    usage = finished.usage
    assert usage.input_tokens > 20 and usage.output_tokens >= len(tiny.reply)
    assert usage.cached_input_tokens == 0  # a fresh server has nothing cached

    again = (await events_of(provider, request("Hello there.")))[-1]
    assert isinstance(again, Finished)
    # The same prompt again: all of it cached but the last token or so, which the engine
    # evaluates anew to get the next token's logits.
    assert again.usage.input_tokens == usage.input_tokens
    assert usage.input_tokens - 2 <= again.usage.cached_input_tokens < usage.input_tokens

    other = (await events_of(provider, request("Hello, someone else.")))[-1]
    assert isinstance(other, Finished)
    # Another last message: only the shared head (system prompt, "Hello") is cached.
    assert 0 < other.usage.cached_input_tokens < other.usage.input_tokens - 10


async def test_a_tool_call_is_put_together_from_the_pieces_the_engine_streams(
    tiny: TinyModel, llama: LlamaServer, provider: OpenAIProvider
) -> None:
    call = request(f"{tiny.call_prefix}fork_agent on the open question.", tools=True)
    pieces = tool_call_pieces(await raw_chunks(llama, call))
    assert len(pieces) > 5  # the arguments arrive a token at a time
    assert json.loads("".join(pieces)) == {"task": tiny.task}

    *calls, finished = await events_of(provider, call)
    assert [type(e) for e in calls] == [ToolCallEvent]
    [event] = calls
    assert isinstance(event, ToolCallEvent)
    assert (event.call.name, json.loads(event.call.arguments_json)) == (
        "fork_agent",
        {"task": tiny.task},
    )
    assert event.call.call_id  # the engine's id, sent back with the result
    assert isinstance(finished, Finished) and finished.finish_reason is FinishReason.TOOL_CALLS
    assert finished.usage.output_tokens > len(pieces)


async def test_a_call_the_token_limit_cut_off_is_dropped_and_the_step_is_exhausted(
    tiny: TinyModel, llama: LlamaServer, provider: OpenAIProvider
) -> None:
    whole = request(f"{tiny.call_prefix}fork_agent.", tools=True)
    finished = (await events_of(provider, whole))[-1]
    assert isinstance(finished, Finished)
    # Stop the same call in the middle of its arguments (`"Go"}}</tool_call>` and the end of
    # the turn are its last 8 tokens).
    cut = request(
        f"{tiny.call_prefix}fork_agent.",
        tools=True,
        max_output_tokens=finished.usage.output_tokens - 6,
    )
    pieces = tool_call_pieces(await raw_chunks(llama, cut))
    assert pieces and "".join(pieces).startswith('{"task":')  # the engine sent half a call
    with pytest.raises(json.JSONDecodeError):
        json.loads("".join(pieces))

    events = await events_of(provider, cut)
    assert [type(e) for e in events] == [Finished]
    [ended] = events
    assert isinstance(ended, Finished) and ended.finish_reason is FinishReason.LENGTH


# -- real node processes ---------------------------------------------------------------------

LEAD_PROMPT = (
    "You lead a small team of agents. Split the work into parts and fork a child for each part"
    " that needs exploring; answer briefly."
)
PRESETS_FILE = """
[endpoints.llama]
base_url = "{base_url}"
[endpoints.llama.retry]
max_attempts = 2
initial_backoff_s = 0.01

[presets.forker]
system_prompt = "{system_prompt}"
model = "llama:tiny"
max_output_tokens = 128
"""


async def until(
    client: MeshClient, session: str, done: Callable[[SessionPage], bool]
) -> SessionPage:
    """Read ``session`` until ``done`` says so (within WAIT seconds); past that, fail with
    what the transcript held."""
    page: SessionPage | None = None
    try:
        async with asyncio.timeout(WAIT):
            while True:
                page = await client.get_session(session)
                if done(page):
                    return page
                await asyncio.sleep(0.05)
    except TimeoutError:
        held = [] if page is None else [type(body).__name__ for body in bodies(page)]
        raise AssertionError(f"{session} not done after {WAIT} s; it holds {held}") from None


def bodies(page: SessionPage) -> list[object]:
    return [entry.body for entry in page.transcript]


def turns_ended(page: SessionPage) -> int:
    return sum(isinstance(body, TurnEnded) for body in bodies(page))


def answered_notice(page: SessionPage) -> bool:
    """The lead holds a settlement notice, and a turn ended after it."""
    seen = bodies(page)
    notices = [i for i, body in enumerate(seen) if isinstance(body, SettlementNotice)]
    return bool(notices) and isinstance(seen[-1], TurnEnded) and notices[0] < len(seen) - 1


async def test_a_fork_childs_first_call_is_served_from_the_engines_cache(
    etcd: EtcdAddress, tiny: TinyModel, llama: LlamaServer, tmp_path: Path
) -> None:
    presets = tmp_path / "presets.toml"
    presets.write_text(PRESETS_FILE.format(base_url=llama.base_url, system_prompt=LEAD_PROMPT))
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:TREE",
        presets_file=presets,
        nodes=("node-a", "node-b"),
    ) as cluster:
        address = cluster["node-a"].address
        assert address is not None
        async with MeshClient(address, token=cluster.settings.cluster_token) as client:
            root = await client.create_root("forker", "Plan the work.")
            await until(client, root.session_id, lambda page: turns_ended(page) == 1)
            await client.prompt(root.session_id, f"{tiny.call_prefix}fork_agent for each part.")
            # The forking turn, and the child's settlement notice read by a step: in a turn of
            # its own, or in the forking turn when the notice lands before that turn ends.
            lead = await until(client, root.session_id, answered_notice)
            [notice] = [b for b in bodies(lead) if isinstance(b, SettlementNotice)]
            child = await until(client, notice.child_session, lambda page: turns_ended(page) == 1)
    check_fork(lead, child, tiny)


def check_fork(lead: SessionPage, child: SessionPage, tiny: TinyModel) -> None:
    """The lead answered, forked once, answered the notice; the child answered once. The
    child's first call found its parent's prefix in the engine's cache."""
    steps = [b for b in bodies(lead) if isinstance(b, AssistantStep)]
    forks = [c for s in steps for c in s.tool_calls]
    assert [(c.name, json.loads(c.arguments_json)) for c in forks] == [
        ("fork_agent", {"task": tiny.task})
    ]
    [result] = [b for b in bodies(lead) if isinstance(b, ToolResult)]
    assert child.info.session_id in result.content
    # Two turns when the notice steered into the forking turn, three when it started its own.
    outcomes = [b.outcome for b in bodies(lead) if isinstance(b, TurnEnded)]
    assert outcomes in ([TurnOutcome.COMPLETED] * 2, [TurnOutcome.COMPLETED] * 3)
    [notice] = [b for b in bodies(lead) if isinstance(b, SettlementNotice)]
    assert notice.outcome is SettlementOutcome.COMPLETED
    answers = [s.text for s in steps if not s.tool_calls]
    assert answers[0] == tiny.reply and set(answers) == {tiny.reply}
    after = bodies(lead)[bodies(lead).index(notice) :]
    assert any(isinstance(b, AssistantStep) and not b.tool_calls for b in after)
    child_steps = [b for b in bodies(child) if isinstance(b, AssistantStep)]
    assert [s.text for s in child_steps] == [tiny.reply]

    assert lead.usage is not None and child.usage is not None
    parent_first = lead.usage.first_call
    assert parent_first is not None and parent_first.cached_input_tokens == 0
    child_share = child.usage.first_call_cache_share
    assert child_share is not None and child_share > 0.75
    assert child.usage.first_call is not None
    assert child.usage.first_call.cached_input_tokens < child.usage.first_call.input_tokens


async def test_the_server_starts_once_stops_idempotently_and_reports_a_failed_start(
    tiny: TinyModel, tmp_path: Path
) -> None:
    server = LlamaServer(tiny.path)
    await server.shutdown()  # before start: nothing to do
    with pytest.raises(RuntimeError, match="never started"):
        _ = server.base_url
    async with server:
        pid = server.pid
        assert pid is not None and server.base_url.startswith("http://127.0.0.1:")
        with pytest.raises(RuntimeError, match="starts once"):
            await server.start()
    assert server.pid is None
    await server.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    failing = LlamaServer(broken)
    with pytest.raises(LlamaServerError, match="did not start"):
        await failing.start()
    assert failing.pid is None
