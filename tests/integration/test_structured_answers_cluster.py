"""Structured answers across real processes (ADR 0052): a root's own schema over gRPC and a
preset's from its file reach the chat-completions server as ``response_format``; a mismatch is
answered with a correction and asked again; the value comes back as ``RunResult.output``, in
``TurnEnded.output_json`` and in a child's settlement notice; a schema that is not one is
refused with INVALID_ARGUMENT; ``spawn --output-schema --wait`` prints the value."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dsh_mesh.client import AnswerRejected, MeshClient, SettlementNotice, TurnEnded
from dsh_mesh.core import IdempotencyConflict, InvalidArgument, check_output_schema
from dsh_mesh.testing import (
    ChatCompletionsServer,
    Completion,
    EtcdAddress,
    RecordedRequest,
    ScriptedToolCall,
)
from tests.integration.served import address, cli, served_cluster

WAIT = 60
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
}
COUNT_SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}}}
PRESETS = """
[presets.answerer]
system_prompt = "You answer."
model = "local:served-model"
tools = []

[presets.lead]
system_prompt = "You lead."
model = "local:served-model"
tools = ["spawn_agent"]

[presets.counter]
system_prompt = "You count."
model = "local:served-model"
tools = []
output_schema_file = "count.json"
"""


def _system(request: RecordedRequest) -> str:
    return str(request.messages[0]["content"])


def _last(request: RecordedRequest) -> str:
    return str(request.messages[-1].get("content") or "")


async def _model(request: RecordedRequest) -> Completion:
    system = _system(request)
    if system == "You answer.":
        if "cannot be accepted" in _last(request):
            return Completion(text='```json\n{"answer": 4}\n```')
        return Completion(text="Four, I think.")
    if system == "You count.":
        return Completion(text='{"count": 3}')
    if request.messages[-1].get("role") == "user" and "Count." in _last(request):
        spawn = json.dumps({"preset": "counter", "task": "Count the files."})
        return Completion(
            tool_calls=(ScriptedToolCall(call_id="c-1", name="spawn_agent", arguments=spawn),)
        )
    return Completion(text="done")


async def test_a_schema_is_asked_for_checked_corrected_and_its_value_returned(
    etcd: EtcdAddress, tmp_path: Path
) -> None:
    (tmp_path / "count.json").write_text(json.dumps(COUNT_SCHEMA))
    async with ChatCompletionsServer(responder=_model) as server:
        with served_cluster(etcd, tmp_path, server, PRESETS) as cluster:
            token = cluster.settings.cluster_token
            async with MeshClient(address(cluster), token=token) as client, asyncio.timeout(WAIT):
                # A root's own schema: asked for, refused once, corrected, returned parsed.
                result = await client.run("answerer", "What is 2+2?", output_schema=ANSWER_SCHEMA)
                assert result.completed and result.output == {"answer": 4}
                asked = [r for r in server.requests if _system(r) == "You answer."]
                assert len(asked) == 2
                for request in asked:
                    assert request.json["response_format"] == {
                        "type": "json_schema",
                        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
                    }
                assert "cannot be accepted: the answer is not JSON" in _last(asked[1])
                page = await client.get_session(result.session_id)
                assert page.info.output_schema == check_output_schema(ANSWER_SCHEMA)
                bodies = [entry.body for entry in page.transcript]
                rejected = [b for b in bodies if isinstance(b, AnswerRejected)]
                assert len(rejected) == 1 and "not JSON" in rejected[0].reason
                ended = [b for b in bodies if isinstance(b, TurnEnded)]
                assert [e.output_json for e in ended] == ['{"answer":4}']

                # A preset's schema (its file): the child's value reaches its parent.
                lead = await client.run("lead", "Count.")
                assert lead.completed and lead.output is None  # the lead names no schema
                notices = [
                    entry.body
                    async for page in client.session_pages(lead.session_id)
                    for entry in page.transcript
                    if isinstance(entry.body, SettlementNotice)
                ]
                assert [n.output_json for n in notices] == ['{"count":3}']
                counted = [r for r in server.requests if _system(r) == "You count."]
                assert counted[0].json["response_format"]["json_schema"]["schema"] == (COUNT_SCHEMA)

                # A retry finds its root only when it asks for the same schema.
                first = await client.create_root(
                    "answerer", "Again?", request_id="r-schema", output_schema=ANSWER_SCHEMA
                )
                again = await client.create_root(
                    "answerer", "Again?", request_id="r-schema", output_schema=ANSWER_SCHEMA
                )
                assert again.session_id == first.session_id
                for other in (None, COUNT_SCHEMA):
                    with pytest.raises(IdempotencyConflict, match="output schema"):
                        await client.create_root(
                            "answerer", "Again?", request_id="r-schema", output_schema=other
                        )
                await client.wait(first.session_id)

                # A schema that is not one: refused, typed, nothing created.
                with pytest.raises(InvalidArgument, match="not a valid JSON schema"):
                    await client.create_root("answerer", "Go.", output_schema={"type": "nonsense"})

            # The command line: --output-schema FILE, --wait prints the value; show says so.
            schema_file = tmp_path / "answer.json"
            schema_file.write_text(json.dumps(ANSWER_SCHEMA))
            command = cli(cluster, tmp_path)
            spawned = await asyncio.to_thread(
                command.run,
                *("spawn", "--preset", "answerer", "--output-schema", str(schema_file)),
                *("--wait", "--timeout", str(WAIT), "What is 2+2?"),
                timeout=WAIT * 2,
            )
            assert spawned.returncode == 0, spawned.stderr
            assert spawned.stdout.strip() == '{"answer":4}'
            shown = await asyncio.to_thread(command.run, "show", result.session_id, timeout=WAIT)
            assert shown.returncode == 0, shown.stderr
            assert "answers   match its output schema {" in shown.stdout
            assert "rejected  answer asked again: the answer is not JSON" in shown.stdout
            assert 'ended completed, output {"answer":4}' in shown.stdout
