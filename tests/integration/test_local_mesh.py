"""``LocalMesh`` and ``run`` on a tree: a root that spawns a child is answered only once the
child's notice has been read and the root has answered after it; a call waiting for a
person holds ``run`` until its deadline, which names the call. Real etcd, SQLite and gRPC; the
model is the project's chat server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

import dsh_mesh
import dsh_mesh.embedded._local as local_module
from dsh_mesh.client import ForkPrefix
from dsh_mesh.core import Cost, ModelPrice, Role, TurnOutcome, usage_cost
from dsh_mesh.embedded import LocalMeshError
from dsh_mesh.node import Node
from dsh_mesh.testing import (
    ChatCompletionsServer,
    Completion,
    EtcdServer,
    RecordedRequest,
    Reply,
    ScriptedToolCall,
)

pytestmark = pytest.mark.timeout(120)

LEAD = dsh_mesh.Preset(
    name="lead",
    system_prompt="You lead. Ask a helper.",
    model="openai:gpt-4o-mini",
    tools=("spawn_agent",),
)
HELPER = dsh_mesh.Preset(name="helper", system_prompt="You help.", model="openai:gpt-4o-mini")


@dsh_mesh.tool
def deploy(service: str) -> str:
    """Deploy one service."""
    return f"{service} deployed"


GATED = dsh_mesh.Preset(
    name="gated",
    system_prompt="You deploy.",
    model="openai:gpt-4o-mini",
    tools=("deploy",),
    approvals=dsh_mesh.ApprovalPolicy(tools=("deploy",)),
)


def model(request: RecordedRequest) -> Reply:
    messages = request.json["messages"]
    system, last = messages[0]["content"], messages[-1]
    if system == "You help.":
        return Completion(text="The answer is 42.")
    if system == "You deploy.":
        return Completion(
            tool_calls=(ScriptedToolCall(call_id="d1", name="deploy", arguments="{}"),)
        )
    if last["role"] == "tool":
        return Completion(text="Asked the helper; waiting.")
    if "The answer is 42." in json.dumps(last["content"]):
        return Completion(text="The helper says 42.")
    arguments = json.dumps({"task": "Find the answer.", "preset": "helper"})
    return Completion(
        tool_calls=(ScriptedToolCall(call_id="s1", name="spawn_agent", arguments=arguments),)
    )


@pytest.fixture
async def mesh() -> AsyncIterator[dsh_mesh.LocalMesh]:
    async with ChatCompletionsServer(responder=model) as chat:
        endpoint = dsh_mesh.OpenAIEndpoint(base_url=chat.base_url)
        async with dsh_mesh.LocalMesh(
            presets=[LEAD, HELPER, GATED], tools=[deploy], endpoints={"openai": endpoint}, nodes=2
        ) as running:
            yield running


async def test_run_answers_after_the_childs_notice_and_counts_the_whole_tree(
    mesh: dsh_mesh.LocalMesh,
) -> None:
    result = await mesh.run("lead", "What is the answer?", deadline=timedelta(seconds=60))
    assert result.answer == "The helper says 42."
    assert result.outcome is TurnOutcome.COMPLETED and result.completed
    assert result.sessions == 2
    # lead: spawn, "waiting", the answer after the notice; helper: one answer.
    assert result.usage.model_calls == 4
    listed = [agent async for agent in mesh.client.list_agents(result.session_id)]
    assert len(listed) == 2


async def test_a_call_waiting_for_a_person_holds_run_until_its_deadline_which_names_it(
    mesh: dsh_mesh.LocalMesh,
) -> None:
    with pytest.raises(TimeoutError, match=r"calls \['d1'\] waiting for a decision"):
        await mesh.run("gated", "Deploy.", deadline=timedelta(seconds=3))


async def test_two_nodes_serve_and_each_takes_the_token() -> None:
    async with ChatCompletionsServer(responder=model) as chat:
        endpoint = dsh_mesh.OpenAIEndpoint(base_url=chat.base_url)
        async with dsh_mesh.LocalMesh(
            presets=[HELPER], endpoints={"openai": endpoint}, nodes=2
        ) as mesh:
            assert len(set(mesh.addresses)) == 2
            for address in mesh.addresses:
                async with dsh_mesh.MeshClient(address, token=mesh.token) as client:
                    result = await client.run("helper", "Hi.", deadline=timedelta(seconds=30))
                    assert result.answer == "The answer is 42."


async def test_prices_give_a_cost_in_get_session_in_run_and_in_list_prices() -> None:
    price = ModelPrice(
        input_usd_per_mtok=2.0, cached_input_usd_per_mtok=1.0, output_usd_per_mtok=8.0
    )
    prices = {"openai:gpt-4o-mini": price}
    async with ChatCompletionsServer(responder=model) as chat:
        endpoint = dsh_mesh.OpenAIEndpoint(base_url=chat.base_url)
        async with dsh_mesh.LocalMesh(
            presets=[LEAD, HELPER],
            endpoints={"openai": endpoint},
            prices=prices,
        ) as mesh:
            assert await mesh.client.prices() == prices
            result = await mesh.run("lead", "What is the answer?", deadline=timedelta(seconds=60))
            assert result.usage.model_calls == 4 and result.cost.unpriced_calls == 0
            # Every call of the tree is of one model: its cost is that price of the sum.
            expected = usage_cost(result.usage, "openai:gpt-4o-mini", prices)
            assert result.cost.usd == pytest.approx(expected.usd)
            page = await mesh.client.get_session(result.session_id)
            assert page.usage is not None and page.cost is not None
            assert page.usage.model_calls == 3  # the root's own: spawn, waiting, the answer
            expected = usage_cost(page.usage, "openai:gpt-4o-mini", prices)
            assert page.cost.usd == pytest.approx(expected.usd) and page.cost.unpriced_calls == 0
            assert 0 < page.cost.usd < result.cost.usd


async def test_a_call_of_a_model_without_a_price_is_counted_unpriced() -> None:
    async with ChatCompletionsServer(responder=model) as chat:
        endpoint = dsh_mesh.OpenAIEndpoint(base_url=chat.base_url)
        async with dsh_mesh.LocalMesh(presets=[HELPER], endpoints={"openai": endpoint}) as mesh:
            assert await mesh.client.prices() == {}
            result = await mesh.run("helper", "Hi.", deadline=timedelta(seconds=30))
            assert result.cost == Cost(0.0, 1)
            page = await mesh.client.get_session(result.session_id)
            assert page.cost == Cost(0.0, 1)


FORKER = dsh_mesh.Preset(
    name="forker",
    system_prompt="You fork.",
    model="openai:gpt-4o-mini",
    tools=("fork_agent",),
)


def fork_model(request: RecordedRequest) -> Reply:
    """The forker answers its first task; told to fork, it forks (the fork inherits that
    completed first turn), its fork answers, and the forker answers after the notice."""
    messages = request.json["messages"]
    said = json.dumps(messages[-1]["content"])
    if "Check the fork." in said:
        return Completion(text="Fork checked.")
    if messages[-1]["role"] == "tool":
        return Completion(text="Forked; waiting.")
    if "Fork checked." in said:
        return Completion(text="The fork says: checked.")
    if "Fork now." in said:
        arguments = json.dumps({"task": "Check the fork."})
        return Completion(
            tool_calls=(ScriptedToolCall(call_id="f1", name="fork_agent", arguments=arguments),)
        )
    return Completion(text="Hello back.")


async def test_a_fork_childs_inherited_prefix_reads_over_grpc_as_its_first_entry() -> None:
    async with ChatCompletionsServer(responder=fork_model) as chat:
        endpoint = dsh_mesh.OpenAIEndpoint(base_url=chat.base_url)
        async with dsh_mesh.LocalMesh(presets=[FORKER], endpoints={"openai": endpoint}) as mesh:
            first_turn = await mesh.run("forker", "Hello.", deadline=timedelta(seconds=60))
            assert first_turn.answer == "Hello back."
            await mesh.client.prompt(first_turn.session_id, "Fork now.")
            wait = timedelta(seconds=60)
            result = await mesh.client.wait(first_turn.session_id, deadline=wait)
            assert result.answer == "The fork says: checked." and result.sessions == 2
            [fork] = [
                agent.info.session_id
                async for agent in mesh.client.list_agents(result.session_id)
                if agent.info.session_id != result.session_id
            ]
            page = await mesh.client.get_session(fork)
            first = page.transcript[0].body
            assert isinstance(first, ForkPrefix), first
            # The parent's completed first turn, as its model saw it: the task, the answer.
            said = [(m.role, m.content) for m in first.messages]
            assert said[0][0] is Role.USER and "Hello." in said[0][1]
            assert said[-1] == (Role.ASSISTANT, "Hello back.")


def test_a_preset_naming_a_tool_nobody_gives_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="names tool 'deploy'"):
        dsh_mesh.LocalMesh(presets=[GATED])
    with pytest.raises(ValueError, match="preset names must differ"):
        dsh_mesh.LocalMesh(presets=[HELPER, HELPER])


async def test_a_start_that_fails_names_what_did_not_start_and_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[EtcdServer] = []

    class Recorded(EtcdServer):
        def start(self) -> None:
            started.append(self)
            super().start()

    async def broken(self: Node, **_: object) -> None:
        raise RuntimeError("this node cannot start")

    monkeypatch.setattr(local_module, "EtcdServer", Recorded)
    monkeypatch.setattr(Node, "run", broken)
    mesh = dsh_mesh.LocalMesh(presets=[HELPER])
    with pytest.raises(LocalMeshError, match="local-1 stopped before it served: this node"):
        async with mesh:
            pytest.fail("a mesh whose node did not start was entered")
    [etcd] = started
    assert not etcd.running  # stopped again, with its data
    assert mesh.addresses == ()
    with pytest.raises(RuntimeError, match="not running"):
        _ = mesh.client


async def cli(mesh: dsh_mesh.LocalMesh, *args: str) -> tuple[int, str, str]:
    """``dsh-mesh --node <the mesh's first node> ARGS``, as a process; exit status and output."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dsh_mesh.cli",
        "--node",
        mesh.addresses[0],
        *args,
        env={**os.environ, "DSH_CLUSTER_TOKEN": mesh.token},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_spawn_wait_prints_the_answer_once_the_tree_settles(
    mesh: dsh_mesh.LocalMesh,
) -> None:
    code, out, err = await cli(mesh, "spawn", "--preset", "lead", "--wait", "What is it?")
    assert code == 0, err
    assert out == "The helper says 42.\n"
    assert "2 agents, 4 model calls" in err
    code, out, err = await cli(mesh, "spawn", "--preset", "helper", "--wait", "--json", "Hi.")
    assert code == 0, err
    assert json.loads(out)["answer"] == "The answer is 42."
    # A call waiting for a person holds it: --timeout gives up, says what waits, exit 1.
    code, out, err = await cli(
        mesh, "spawn", "--preset", "gated", "--wait", "--timeout", "2", "Go."
    )
    assert code == 1 and out == ""
    assert "has not settled" in err and "waiting for a decision" in err, err
