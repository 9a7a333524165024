"""``DSH_DEMO_MODEL=openai:<model> make demo`` runs the cluster demo on a real endpoint: here a
local chat-completions server plays the model, so the whole path runs (presets file written by
the demo, real node processes, the OpenAI-compatible provider, real HTTP) and is checked."""

from __future__ import annotations

import json
import re
from datetime import timedelta

from dsh_mesh.core import AgentMessageEntry, SettlementNoticeEntry, SettlementOutcome
from dsh_mesh.demo import print_real_run, run_real_demo
from dsh_mesh.demo._real import LEAD_PROMPT, RESEARCHER_PROMPT, demo_model, endpoint_of
from dsh_mesh.testing import ChatCompletionsServer, Completion, RecordedRequest, ScriptedToolCall

_PARENT = re.compile(r'parent agent_id: "([^"]+)"')


def model(request: RecordedRequest) -> Completion:
    """A lead that spawns two researchers and writes the briefing once both have reported; a
    researcher that sends its findings to its parent, then finishes."""
    system = request.messages[0]["content"]
    last = request.messages[-1]
    if system == RESEARCHER_PROMPT:
        if last["role"] == "tool":
            return Completion(text="Done.")
        parent = _PARENT.search(request.messages[1]["content"])
        assert parent is not None, "the task carries the parent's id"
        message = {"agent_id": parent.group(1), "message": "Findings: leases fence writers."}
        return Completion(
            tool_calls=(
                ScriptedToolCall(call_id="r1", name="send_message", arguments=json.dumps(message)),
            )
        )
    assert system == LEAD_PROMPT
    if len(request.messages) == 2:
        return Completion(
            tool_calls=tuple(
                ScriptedToolCall(
                    call_id=f"s{n}",
                    name="spawn_agent",
                    arguments=json.dumps({"task": topic, "preset": "researcher"}),
                )
                for n, topic in enumerate(("etcd leases", "gRPC deadlines"))
            )
        )
    heard = sum("Findings:" in str(m.get("content")) for m in request.messages)
    return Completion(text="Briefing: nothing is lost." if heard == 2 else "Waiting.")


async def test_the_demo_runs_on_a_real_endpoint_when_one_is_named() -> None:
    assert demo_model({}) is None
    assert demo_model({"DSH_DEMO_MODEL": "openai:m"}) == "openai:m"
    async with ChatCompletionsServer(model) as server:
        environ = {"OPENAI_BASE_URL": server.base_url}
        assert endpoint_of("openai:demo-model", environ) == (
            f"model 'demo-model' at {server.base_url}"
        )
        assert "no endpoint named 'nowhere'" in endpoint_of("nowhere:x", environ)
        lines: list[str] = []
        run = await run_real_demo(
            "openai:demo-model",
            say=lines.append,
            patience=timedelta(seconds=60),
            environ=environ,
        )
    assert run.quiet
    assert len(run.headers) == 3
    root = run.transcripts[run.root]
    findings = [r for r in root if isinstance(r.entry, AgentMessageEntry)]
    assert len(findings) == 2
    notices = [r.entry for r in root if isinstance(r.entry, SettlementNoticeEntry)]
    assert [n.outcome for n in notices] == [SettlementOutcome.COMPLETED] * 2
    assert all(usage.model_calls > 0 for usage in run.usage.values())
    assert {r.model for r in server.requests} == {"demo-model"}
    printed: list[str] = []
    print_real_run(run, printed.append)
    assert any("Briefing: nothing is lost." in line for line in printed)
    assert printed[-1].strip().startswith("3 agents,")
