"""The OpenAI-compatible provider against a local chat-completions server
(``dsh_mesh.testing.ChatCompletionsServer``: real HTTP on loopback, streamed SSE, a simulated
prefix cache, every request body recorded):

- a fork child's first request repeats its parent's bytes through the inherited turn, and its
  first call reports a high cache hit share;
- parallel tool calls map onto the agent's tools;
- 429 and 5xx are retried with the same body, then surface as an error settlement carrying the
  endpoint's message;
- a prompt past the model's context, or a call cut at its token limit, settles as token
  exhaustion;
- interrupting a turn closes its HTTP request;
- real node processes, configured by a presets file, serve a root from the endpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from dsh_mesh.client import AssistantStep, MeshClient, SessionPage, TurnEnded
from dsh_mesh.core import (
    AssistantStepEntry,
    ChatMessage,
    Entry,
    InvalidArgument,
    Role,
    SessionId,
    SettlementNoticeEntry,
    SettlementOutcome,
    TurnEndedEntry,
    TurnOutcome,
    session_usage,
)
from dsh_mesh.models import (
    ModelRequest,
    ModelRouter,
    OpenAIEndpoint,
    OpenAIProvider,
    Reply,
    RetryPolicy,
    ScriptedProvider,
    complete,
    tool,
)
from dsh_mesh.testing import (
    ChatCompletionsServer,
    Completion,
    EtcdAddress,
    Failure,
    InProcessMesh,
    LocalCluster,
    RecordedRequest,
    ScriptedToolCall,
    Stall,
    in_process_mesh,
)
from dsh_mesh.tools import Preset

WAIT = 20
ROOT = SessionId("s-1")
FAST = RetryPolicy(
    max_attempts=4,
    initial_backoff=timedelta(milliseconds=5),
    max_backoff=timedelta(milliseconds=20),
    budget=timedelta(seconds=10),
)
PRESETS = (
    Preset(name="lead", system_prompt="You lead a team of agents.", model="openai:test-model"),
    Preset(name="scripted-lead", system_prompt="You delegate.", model="lead"),
    Preset(name="real", system_prompt="You answer.", model="openai:test-model"),
)


def last_message(request: RecordedRequest) -> dict[str, object]:
    message = request.messages[-1]
    assert isinstance(message, dict)
    return message


def fork_responder(request: RecordedRequest) -> Completion:
    """The lead answers its first task, forks two children in parallel when asked, and says
    so; a fork child answers its task."""
    last = last_message(request)
    content = str(last.get("content") or "")
    if last["role"] == "tool":
        return Completion(text="forked")
    if content.startswith("Explore option"):
        return Completion(text=f"{content.split('.')[0]}: explored.", usage_form="deepseek")
    if content == "Now fork.":
        return Completion(
            tool_calls=(
                ScriptedToolCall(
                    call_id="call_b", name="fork_agent", arguments='{"task":"Explore option B."}'
                ),
                ScriptedToolCall(
                    call_id="call_c", name="fork_agent", arguments='{"task":"Explore option C."}'
                ),
            ),
            interleave=True,
        )
    return Completion(text="first turn done")


@pytest.fixture
async def server() -> AsyncIterator[ChatCompletionsServer]:
    async with ChatCompletionsServer(fork_responder) as running:
        yield running


@pytest.fixture
async def mesh(server: ChatCompletionsServer) -> AsyncIterator[InProcessMesh]:
    async with router_to(server) as router, in_process_mesh(PRESETS, provider=router) as running:
        yield running


class router_to:
    """A router whose ``openai`` endpoint is ``server`` (scripted programs for the rest)."""

    def __init__(self, server: ChatCompletionsServer, scripted: ScriptedProvider | None = None):
        endpoint = OpenAIEndpoint(base_url=server.base_url, retry=FAST)
        self.router = ModelRouter(
            {"openai": OpenAIProvider(endpoint)}, default=scripted or ScriptedProvider()
        )

    async def __aenter__(self) -> ModelRouter:
        return self.router

    async def __aexit__(self, *_: object) -> None:
        await self.router.aclose()


async def entries(mesh: InProcessMesh, session: SessionId) -> list[Entry]:
    return [r.entry for r in await mesh.transcript(session)]


def bodies_of(server: ChatCompletionsServer, first_user: str) -> list[bytes]:
    return [
        r.body
        for r in server.requests
        if len(r.messages) > 1 and r.messages[1].get("content") == "Plan the work."
        and any(str(m.get("content", "")).startswith(first_user) for m in r.messages)
    ]  # fmt: skip


@pytest.mark.contract(7)
async def test_a_fork_childs_request_repeats_its_parents_bytes_and_hits_the_cache(
    server: ChatCompletionsServer, mesh: InProcessMesh
) -> None:
    ref = await mesh.manager.create_root("Plan the work.", preset="lead")
    await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
    await mesh.manager.submit_prompt(ref.session_id, "Now fork.")
    children = [SessionId("s-2"), SessionId("s-3")]
    # The lead's three calls, one per child, and at least one more as the lead reads their
    # settlement notices.
    await asyncio.wait_for(server.wait_requests(6), WAIT)
    await asyncio.wait_for(mesh.manager.quiescent(), WAIT)

    # Parallel tool calls: both forks ran, in the order the model gave them.
    lead = await entries(mesh, ref.session_id)
    [forking] = [e for e in lead if isinstance(e, AssistantStepEntry) and e.tool_calls]
    assert [c.call_id for c in forking.tool_calls] == ["call_b", "call_c"]
    assert [json.loads(c.arguments_json)["task"] for c in forking.tool_calls] == [
        "Explore option B.",
        "Explore option C.",
    ]

    # The parent's request of its second turn and a fork child's first request are the same
    # bytes up to the end of the inherited turn; they part at the next message.
    [parent] = [r.body for r in server.requests if last_message(r).get("content") == "Now fork."]
    [child] = [
        r.body
        for r in server.requests
        if str(last_message(r).get("content", "")).startswith("Explore option B.")
    ]
    # The tools on the wire are the registry's definitions, in registry order, schemas verbatim.
    registry = mesh.manager.registry.resolve(PRESETS[0]).descriptors
    sent = json.loads(parent)["tools"]
    assert [t["function"]["name"] for t in sent] == [d.name for d in registry]
    for descriptor in registry:
        assert b'"parameters":' + descriptor.input_schema_json.encode() in parent
    boundary = parent.index(b'{"role":"user","content":"Now fork."}')
    assert parent[:boundary].endswith(b'{"role":"assistant","content":"first turn done"},')
    assert child[:boundary] == parent[:boundary]  # head, tools and the inherited turn
    assert child[boundary:].startswith(b'{"role":"user","content":"Explore option B.')
    assert boundary > len(parent) // 2

    # The child's first call reports the provider's cache hits (DeepSeek's form here).
    for session in children:
        usage = session_usage(await entries(mesh, session))
        assert usage.model_calls == 1 and usage.first_call is not None
        assert usage.first_call.cached_input_tokens > 0
        assert usage.first_call_cache_share is not None and usage.first_call_cache_share > 0.5
    # Whereas the parent's first call had nothing cached.
    parent_usage = session_usage(lead)
    assert parent_usage.first_call is not None
    assert parent_usage.first_call.cached_input_tokens == 0
    assert parent_usage.model_calls == len(
        [r for r in server.requests if r.messages[1].get("content") == "Plan the work."]
    ) - len(children)


async def test_rate_limits_and_server_errors_are_retried_with_the_same_body(
    server: ChatCompletionsServer, mesh: InProcessMesh
) -> None:
    server.enqueue(
        Failure(status=429, retry_after=0, message="slow down"),
        Failure(status=500, message="boom"),
        Completion(text="after two retries"),
    )
    ref = await mesh.manager.create_root("Hello.", preset="real")
    await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
    assert len(server.requests) == 3
    assert len({r.body for r in server.requests}) == 1
    steps = [e for e in await entries(mesh, ref.session_id) if isinstance(e, AssistantStepEntry)]
    assert [s.text for s in steps] == ["after two retries"]


async def test_an_endpoint_failing_past_the_retry_budget_settles_with_its_message(
    server: ChatCompletionsServer,
) -> None:
    """A child whose endpoint keeps failing settles ``error``; its parent's notice carries the
    endpoint's own message."""
    for _ in range(FAST.max_attempts):
        server.enqueue(Failure(status=503, message="the model is loading"))
    scripted = ScriptedProvider()
    scripted.program("lead", tool("spawn_agent", task="Answer.", preset="real"), Reply(text="ok"))
    async with (
        router_to(server, scripted) as router,
        in_process_mesh(PRESETS, provider=router, scripted=scripted) as mesh,
    ):
        await mesh.manager.create_root("Delegate.", preset="scripted-lead")
        await asyncio.wait_for(
            mesh.manager.wait_until(lambda: mesh.manager.agent(SessionId("s-2")) is None), WAIT
        )
        await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
        notices = [e for e in await entries(mesh, ROOT) if isinstance(e, SettlementNoticeEntry)]
    assert len(server.requests) == FAST.max_attempts
    [notice] = notices
    assert notice.outcome is SettlementOutcome.ERROR
    assert "the model is loading" in notice.detail
    assert f"after {FAST.max_attempts} attempts" in notice.detail


async def test_a_refusal_is_not_retried_and_fails_the_turn_with_its_message(
    server: ChatCompletionsServer, mesh: InProcessMesh
) -> None:
    server.enqueue(Failure(status=400, message="tools are not supported by this model"))
    ref = await mesh.manager.create_root("Hello.", preset="real")
    await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
    assert len(server.requests) == 1
    [ended] = [e for e in await entries(mesh, ref.session_id) if isinstance(e, TurnEndedEntry)]
    assert ended.outcome is TurnOutcome.ERROR
    assert "HTTP 400: tools are not supported by this model" in ended.detail


@pytest.mark.parametrize("how", ["context", "length"])
async def test_a_full_context_or_a_cut_answer_settles_as_token_exhaustion(how: str) -> None:
    scripted = ScriptedProvider()
    scripted.program("lead", tool("spawn_agent", task="Answer.", preset="real"), Reply(text="ok"))
    limit = 40 if how == "context" else None
    async with ChatCompletionsServer(max_context_tokens=limit) as server:
        if how == "length":
            server.enqueue(Completion(text="half an ans", finish_reason="length"))
        async with (
            router_to(server, scripted) as router,
            in_process_mesh(PRESETS, provider=router, scripted=scripted) as mesh,
        ):
            await mesh.manager.create_root("Delegate.", preset="scripted-lead")
            await asyncio.wait_for(
                mesh.manager.wait_until(lambda: mesh.manager.agent(SessionId("s-2")) is None),
                WAIT,
            )
            await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
            notices = [e for e in await entries(mesh, ROOT) if isinstance(e, SettlementNoticeEntry)]
        assert len(server.requests) == 1
    [notice] = notices
    assert notice.outcome is SettlementOutcome.TOKEN_EXHAUSTION
    if how == "context":
        assert "maximum context length is 40 tokens" in notice.detail
    else:
        assert notice.terminal_output == "half an ans"


async def test_interrupting_a_turn_closes_its_http_request(
    server: ChatCompletionsServer, mesh: InProcessMesh
) -> None:
    server.enqueue(Stall(text="thinking"))
    ref = await mesh.manager.create_root("Think forever.", preset="real")
    await asyncio.wait_for(server.wait_requests(1), WAIT)
    await asyncio.wait_for(mesh.manager.wait_until(lambda: server.open_streams == 1), WAIT)
    assert mesh.manager.interrupt(ref.session_id) is not None
    await asyncio.wait_for(server.wait_disconnect(1), WAIT)
    await asyncio.wait_for(mesh.manager.quiescent(), WAIT)
    [ended] = [e for e in await entries(mesh, ref.session_id) if isinstance(e, TurnEndedEntry)]
    assert ended.outcome is TurnOutcome.CANCELLED
    assert server.open_streams == 0


# -- real node processes ---------------------------------------------------------------------


PRESETS_FILE = """
[endpoints.local]
base_url = "{base_url}"
api_key_env = "TEST_LLM_KEY"
[endpoints.local.retry]
max_attempts = 3
initial_backoff_s = 0.01

[presets.answerer]
system_prompt = "You answer from the presets file."
model = "local:served-model"
max_output_tokens = 256
"""


async def test_nodes_configured_by_a_presets_file_serve_a_root_from_the_endpoint(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    async with ChatCompletionsServer(api_key="sk-local-test") as server:
        server.enqueue(
            Failure(status=503, message="warming up"),
            Completion(text="Answered over HTTP."),
        )
        presets = tmp_path / "presets.toml"
        presets.write_text(PRESETS_FILE.format(base_url=server.base_url))
        with LocalCluster(
            etcd_endpoint=etcd.endpoint,
            scenario="tests.integration.scenarios:TREE",
            presets_file=presets,
            env={"TEST_LLM_KEY": "sk-local-test"},
            nodes=("node-a",),
        ) as cluster:
            address = cluster["node-a"].address
            assert address is not None
            async with MeshClient(address, token=cluster.settings.cluster_token) as client:
                root = await client.create_root("answerer", "What is a lease?")
                page = await until_turn_ended(client, root.session_id)
        steps = [e.body for e in page.transcript if isinstance(e.body, AssistantStep)]
        assert [s.text for s in steps] == ["Answered over HTTP."]
        assert page.info.model == "local:served-model"
        assert page.usage is not None and page.usage.model_calls == 1
        assert page.usage.input_tokens > 0 and page.usage.output_tokens > 0
        first, retried = server.requests
        assert first.body == retried.body
        assert first.headers["authorization"] == "Bearer sk-local-test"
        assert first.model == "served-model"
        assert first.json["max_tokens"] == 256
        assert first.messages[0] == {
            "role": "system",
            "content": "You answer from the presets file.",
        }


async def until_turn_ended(client: MeshClient, session: str) -> SessionPage:
    async with asyncio.timeout(WAIT):
        while True:
            page = await client.get_session(session)
            if any(isinstance(e.body, TurnEnded) for e in page.transcript):
                return page
            await asyncio.sleep(0.1)


HI = ModelRequest(
    session_id=ROOT,
    model="test-model",
    system_prompt="p",
    tools=(),
    messages=(ChatMessage(role=Role.USER, content="hi"),),
)
"""The smallest request: one user message."""


async def test_calls_share_pooled_connections(server: ChatCompletionsServer) -> None:
    """One provider keeps its connections alive between calls (and across retries)."""
    server.enqueue(Failure(status=503), Completion(text="a"), Completion(text="b"))
    provider = OpenAIProvider(OpenAIEndpoint(base_url=server.base_url, retry=FAST))
    try:
        texts = [(await complete(provider, HI)).text for _ in range(2)]
    finally:
        await provider.aclose()
    assert texts == ["a", "b"]
    assert len(server.requests) == 3
    assert {r.connection for r in server.requests} == {1}


@pytest.mark.parametrize("pool", [5, 20])
async def test_a_pool_holds_its_size_in_calls_at_once_however_it_is_split(
    server: ChatCompletionsServer, pool: int
) -> None:
    """A pool bigger than one httpx client (``POOL_SHARD``) is split in several, and still
    serves ``max_connections`` calls at once, each on a connection of its own, and no more."""
    calls = pool + 2
    server.enqueue(*(Stall(text="thinking") for _ in range(calls)))
    provider = OpenAIProvider(OpenAIEndpoint(base_url=server.base_url, max_connections=pool))

    async def stalled() -> None:
        async for _ in provider.stream(HI):
            pass

    streams = [asyncio.create_task(stalled()) for _ in range(calls)]
    try:
        await asyncio.wait_for(server.wait_requests(pool), WAIT)
        await asyncio.sleep(0.3)  # any call beyond the pool would have arrived by now
        assert len(server.requests) == pool
        assert server.open_streams == pool
        assert server.connections == pool
    finally:
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await provider.aclose()


def test_a_node_refuses_to_start_on_a_presets_file_it_cannot_run(tmp_path: Path) -> None:
    """Before it dials anything: exit status 2 and one error line naming the file and key."""
    presets = tmp_path / "presets.toml"
    presets.write_text("[presets.lead]\nsystem_prompt = 'x'\ntools = ['report']\n")
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsh_mesh.node",
            "--plaintext",
            "--log-store",
            f"sqlite:{tmp_path / 'log.db'}",
            "--presets-file",
            str(presets),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("DSH_")},
            "DSH_CLUSTER_TOKEN": "a-token-of-thirty-two-characters-long",
        },
    )
    assert started.returncode == 2
    [line] = started.stderr.strip().splitlines()
    assert line.startswith("dsh-mesh-node: error: ")
    assert f"{presets}: presets.lead.tools: unknown tools ['report']" in line


async def test_a_root_on_an_endpoint_nobody_configured_is_refused_at_creation(
    mesh: InProcessMesh,
) -> None:
    writes = mesh.store.writes
    with pytest.raises(InvalidArgument, match="'opneai', which is not configured"):
        await mesh.manager.create_root("Hello.", preset="real", model="opneai:test-model")
    assert mesh.store.writes == writes
