"""Every example of docs/python.md runs as written, as its own Python process, against the
project's OpenAI-compatible chat server standing in for the model (``OPENAI_BASE_URL``).

The ``embedded`` and ``approvals`` examples start their own ``LocalMesh`` (a real etcd, a
SQLite store, in-process nodes). The ``client`` and ``interrupt`` examples reach a cluster
named by ``DSH_NODE`` and ``DSH_CLUSTER_TOKEN``, as a user's program would: here a
``LocalMesh`` this test runs, with the ``assistant`` preset the page says they expect.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

import dsh_mesh
from dsh_mesh.testing import (
    ChatCompletionsServer,
    Completion,
    RecordedRequest,
    Reply,
    ScriptedToolCall,
    Stall,
)

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "python.md"
_EXAMPLE = re.compile(r"<!-- python-example: (\w+) -->\n```python\n(.*?)```", re.DOTALL)
RUN_SECONDS = 90.0
pytestmark = pytest.mark.timeout(240)

ASSISTANT = dsh_mesh.Preset(
    name="assistant", system_prompt="You are a helpful assistant.", model="openai:gpt-4o-mini"
)


def examples() -> dict[str, str]:
    return dict(_EXAMPLE.findall(PAGE.read_text()))


def _said(request: RecordedRequest) -> tuple[str, str, str]:
    """The request's system prompt, its last message's role and the text of its last user
    message."""
    messages = request.json["messages"]
    users = [m for m in messages if m["role"] == "user"]
    return messages[0]["content"], messages[-1]["role"], json.dumps(users[-1]["content"])


def model(request: RecordedRequest) -> Reply:
    """The model every example talks to, answering by who asks and what was said last."""
    system, last, user = _said(request)
    if "You answer sums" in system:
        if last == "tool":
            return Completion(text="2 + 3 = 5.")
        return Completion(
            tool_calls=(ScriptedToolCall(call_id="c1", name="add", arguments='{"a": 2, "b": 3}'),)
        )
    if "You deploy" in system:
        if last == "tool":
            return Completion(text="The web service is deployed.")
        return Completion(
            tool_calls=(
                ScriptedToolCall(call_id="d1", name="deploy", arguments='{"service": "web"}'),
            )
        )
    if "You extract invoice fields" in system:
        if "cannot be accepted" in user:  # the mesh's correction: answer in the schema
            return Completion(text='{"vendor": "ACME Corp", "total": 1250.5}')
        return Completion(text="ACME Corp, 1,250.50.")
    if "You write short poems" in system:
        return Completion(text="Held while it is kept;\nlet go, another takes it.", pieces=4)
    if "very long essay" in user:
        return Stall()
    if "next one" in user:
        return Completion(text="7.")
    return Completion(text="2, 3 and 5.")


@pytest.fixture
async def chat() -> AsyncIterator[ChatCompletionsServer]:
    async with ChatCompletionsServer(responder=model) as server:
        yield server


@pytest.fixture
async def cluster(chat: ChatCompletionsServer) -> AsyncIterator[dsh_mesh.LocalMesh]:
    endpoint = dsh_mesh.OpenAIEndpoint(base_url=chat.base_url)
    async with dsh_mesh.LocalMesh(presets=[ASSISTANT], endpoints={"openai": endpoint}) as mesh:
        yield mesh


async def run_example(name: str, tmp_path: Path, env: Mapping[str, str]) -> str:
    """Run the example ``name`` of the page as a script; its standard output."""
    script = tmp_path / f"{name}.py"
    script.write_text(examples()[name])
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), RUN_SECONDS)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, err.decode()[-3000:]
    return out.decode()


def model_env(chat: ChatCompletionsServer) -> dict[str, str]:
    return {"OPENAI_BASE_URL": chat.base_url, "OPENAI_API_KEY": "sk-test"}


def cluster_env(mesh: dsh_mesh.LocalMesh) -> dict[str, str]:
    return {"DSH_NODE": mesh.addresses[0], "DSH_CLUSTER_TOKEN": mesh.token}


def test_the_page_has_each_example_this_test_runs() -> None:
    assert sorted(examples()) == [
        "approvals",
        "client",
        "embedded",
        "interrupt",
        "streaming",
        "structured",
    ]


async def test_embedded_runs_a_code_preset_and_tool_to_its_answer(
    chat: ChatCompletionsServer, tmp_path: Path
) -> None:
    out = await run_example("embedded", tmp_path, model_env(chat))
    assert "answer: 2 + 3 = 5." in out
    assert "outcome: completed" in out
    assert "usage: 2 model calls" in out
    # The tool ran in the example's process and its result reached the model.
    tool_results = [m for m in chat.requests[-1].json["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_results] == ["5"]


async def test_client_streams_awaits_and_prompts(
    chat: ChatCompletionsServer, cluster: dsh_mesh.LocalMesh, tmp_path: Path
) -> None:
    out = await run_example("client", tmp_path, {**model_env(chat), **cluster_env(cluster)})
    lines = out.splitlines()
    assert lines[:3] == ["step: 2, 3 and 5.", "answer: 2, 3 and 5.", "answer: 7."], out
    assert lines[3].startswith("usage: 2 model calls"), out


async def test_interrupt_cancels_the_running_turn(
    chat: ChatCompletionsServer, cluster: dsh_mesh.LocalMesh, tmp_path: Path
) -> None:
    out = await run_example("interrupt", tmp_path, {**model_env(chat), **cluster_env(cluster)})
    assert out.splitlines() == ["interrupted: True", "outcome: cancelled"], out


async def test_approvals_waits_for_the_decision_then_runs_the_call_once(
    chat: ChatCompletionsServer, tmp_path: Path
) -> None:
    out = await run_example("approvals", tmp_path, model_env(chat))
    assert out.splitlines() == [
        'asks: deploy {"service": "web"}',
        "answer: The web service is deployed.",
    ], out
    tool_results = [m for m in chat.requests[-1].json["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_results] == ["web is deployed"]


async def test_structured_asks_again_and_returns_the_parsed_value(
    chat: ChatCompletionsServer, tmp_path: Path
) -> None:
    out = await run_example("structured", tmp_path, model_env(chat))
    assert "output: {'total': 1250.5, 'vendor': 'ACME Corp'}" in out  # canonical: keys sorted
    assert "total: 1250.5" in out
    assert "model calls: 2" in out  # the first answer was not JSON: corrected, asked again
    body = chat.requests[0].json
    assert body["response_format"]["json_schema"]["schema"]["required"] == ["vendor", "total"]


async def test_streaming_prints_the_text_as_it_comes_then_the_step(
    chat: ChatCompletionsServer, tmp_path: Path
) -> None:
    out = await run_example("streaming", tmp_path, model_env(chat))
    text = "Held while it is kept;\nlet go, another takes it."
    streamed, _, step = out.partition("\nstep: ")
    assert step.strip() == text
    pieces = streamed.split("|")[:-1]
    assert len(pieces) > 1 and "".join(pieces) == text  # in pieces, before the step
