"""What a model returns is bounded and bound (docs/adr/0038-what-a-model-returns.md): each call
of a step has one id of its own, so its result and its approval bind to exactly that call;
empty, huge or malformed ids are replaced; arguments nested too deep or too large are answered
with an error result and the turn goes on; a step always fits the log store's entry limit.
Against the scripted provider in one process (strict: it refuses, as OpenAI does, a request
whose tool calls and results do not pair up)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TypeVar

import pytest

from dsh_mesh.core import (
    MAX_CALL_ID_CHARS,
    MAX_CALLS_PER_STEP,
    MAX_STEP_BYTES,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    Record,
    Role,
    SessionId,
    ToolCall,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.models import Raw, Reply
from dsh_mesh.registry import encode_entry
from dsh_mesh.registry._store import MAX_ENTRY_BYTES
from dsh_mesh.testing import InProcessMesh, calls_without_one_answer, in_process_mesh
from dsh_mesh.tools import ApprovalPolicy, Preset
from dsh_mesh.tools import tool as tool_decorator

ROOT = SessionId("s-1")
RAN: list[str] = []
T = TypeVar("T")


@tool_decorator(replay="unsafe")
def deploy(env: str) -> str:
    """Deploy to an environment."""
    RAN.append(f"deploy {env}")
    return f"deployed to {env}"


@tool_decorator(replay="safe")
def status(env: str) -> str:
    """Read an environment's status."""
    RAN.append(f"status {env}")
    return f"{env} is up"


@tool_decorator(replay="safe")
def note(text: str) -> str:
    """Keep a note."""
    RAN.append(f"note {len(text)}")
    return f"noted {len(text)} characters"


PRESETS = (
    Preset(
        name="lead",
        system_prompt="You lead.",
        model="lead",
        approvals=ApprovalPolicy(tools=("deploy",), timeout=timedelta(hours=1)),
    ),
)


@pytest.fixture
async def team() -> AsyncIterator[InProcessMesh]:
    RAN.clear()
    async with in_process_mesh(PRESETS, tools=(deploy, status, note)) as running:
        yield running


def entries(records: list[Record], kind: type[T]) -> list[T]:
    return [r.entry for r in records if isinstance(r.entry, kind)]


def call(call_id: str, name: str, arguments: str) -> ToolCall:
    return ToolCall(call_id=call_id, name=name, arguments_json=arguments)


async def ended(team: InProcessMesh) -> list[Record]:
    await team.manager.quiescent()
    records = await team.transcript(ROOT)
    assert calls_without_one_answer(records) == []
    return records


def fits_the_store(records: list[Record]) -> None:
    for record in records:
        assert len(encode_entry(record.entry)) <= MAX_ENTRY_BYTES


WELL_FORMED_ID = re.compile(r"[A-Za-z0-9_.:-]+")


# -- exactly one binding per call ---------------------------------------------------------------


@pytest.mark.parametrize("gated_first", [True, False], ids=["gated-first", "ungated-first"])
async def test_two_calls_sharing_an_id_each_get_their_own_and_bind_one_result_and_one_approval(
    team: InProcessMesh, gated_first: bool
) -> None:
    gated, ungated = (
        call("c-1", "deploy", '{"env": "prod"}'),
        call("c-1", "status", '{"env": "qa"}'),
    )
    calls = (gated, ungated) if gated_first else (ungated, gated)
    team.scripted.program("lead", Raw(calls=calls), Reply(text="done"))
    await team.manager.create_root("Go.", preset="lead")
    await team.manager.quiescent()

    records = await team.transcript(ROOT)
    [step] = entries(records, AssistantStepEntry)
    ids = [c.call_id for c in step.tool_calls]
    assert ids[0] == "c-1" and len(set(ids)) == 2  # the first keeps its id, the second not
    renamed = step.tool_calls[1]
    assert renamed.given_id == "c-1" and WELL_FORMED_ID.fullmatch(renamed.call_id)
    gated_id = next(c.call_id for c in step.tool_calls if c.name == "deploy")
    # One request, for the gated call alone: the ungated one is never asked for approval.
    [request] = entries(records, ApprovalRequestEntry)
    assert (request.call_id, request.tool) == (gated_id, "deploy")
    assert "deploy prod" not in RAN

    await team.manager.resolve_approval(
        ROOT,
        ApprovalDecisionEntry(
            call_id=request.call_id,
            decision=ApprovalDecision.ALLOW,
            request_digest=request.digest,
            by="client:alice",
        ),
    )
    records = await ended(team)

    assert sorted(RAN) == ["deploy prod", "status qa"]
    results = {r.call_id: r for r in entries(records, ToolResultEntry)}
    assert set(results) == set(ids)
    assert results[gated_id].content == "deployed to prod"
    ungated_id = next(i for i in ids if i != gated_id)
    assert results[ungated_id].content == "qa is up"
    assert len(entries(records, ApprovalRequestEntry)) == 1
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED
    # The model is shown the ids it will get back: each call in its step, each result after it.
    shown = team.recorder.requests_of(ROOT)[-1].messages
    [assistant] = [m for m in shown if m.role is Role.ASSISTANT]
    assert [c.call_id for c in assistant.tool_calls] == ids
    assert [m.tool_call_id for m in shown if m.role is Role.TOOL] == [
        r.call_id for r in entries(records, ToolResultEntry)
    ]


async def test_an_id_the_model_gave_twice_is_made_unique_around_an_id_it_also_gave(
    team: InProcessMesh,
) -> None:
    # The model's own ids are kept where they are unique: the renamed one avoids them all.
    calls = (
        call("x", "status", '{"env": "a"}'),
        call("x", "status", '{"env": "b"}'),
        call("x_2", "status", '{"env": "c"}'),
    )
    team.scripted.program("lead", Raw(calls=calls), Reply())
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)
    step = entries(records, AssistantStepEntry)[0]
    ids = [c.call_id for c in step.tool_calls]
    assert ids[0] == "x" and ids[2] == "x_2" and len(set(ids)) == 3
    assert [c.given_id for c in step.tool_calls] == [None, "x", None]
    assert [r.content for r in entries(records, ToolResultEntry)] == [
        "a is up",
        "b is up",
        "c is up",
    ]


async def test_empty_huge_and_malformed_ids_are_replaced_with_bounded_ones(
    team: InProcessMesh,
) -> None:
    huge = "h" * 1_000_000
    calls = (
        call("", "status", '{"env": "a"}'),
        call(huge, "status", '{"env": "b"}'),
        call("bad id\n<script>", "status", '{"env": "c"}'),
        call("", "status", '{"env": "d"}'),
    )
    team.scripted.program("lead", Raw(calls=calls), Reply(text="done"))
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)

    step = entries(records, AssistantStepEntry)[0]
    ids = [c.call_id for c in step.tool_calls]
    assert len(set(ids)) == 4
    assert all(WELL_FORMED_ID.fullmatch(i) and len(i) <= MAX_CALL_ID_CHARS for i in ids)
    given = [c.given_id for c in step.tool_calls]
    assert given[0] == given[3] == "" and given[2] == "bad id\n<script>"
    assert given[1] is not None and given[1].startswith("h" * 64) and len(given[1]) < 200
    assert [r.content for r in entries(records, ToolResultEntry)] == [
        "a is up",
        "b is up",
        "c is up",
        "d is up",
    ]
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED
    fits_the_store(records)


def test_the_checker_counts_a_step_whose_calls_share_an_id() -> None:
    from dsh_mesh.core import Usage

    step = AssistantStepEntry(
        text="",
        tool_calls=(call("c-1", "status", "{}"), call("c-1", "deploy", "{}")),
        usage=Usage(),
    )
    records = [
        Record(seq=1, entry=step),
        Record(seq=2, entry=ToolResultEntry(call_id="c-1", name="status", content="ok")),
        Record(seq=3, entry=AssistantStepEntry(text="done", tool_calls=(), usage=Usage())),
    ]
    [violation] = calls_without_one_answer(records)
    assert "c-1" in violation and "seq 1" in violation


# -- bounded arguments ----------------------------------------------------------------------------


async def test_arguments_nested_100_000_deep_get_an_error_result_and_the_turn_goes_on(
    team: InProcessMesh,
) -> None:
    deep = '{"env": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}"
    calls = (call("c-1", "status", deep), call("c-2", "status", '{"env": "qa"}'))
    team.scripted.program("lead", Raw(calls=calls), Reply(text="done"))
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)

    first, second = entries(records, ToolResultEntry)
    assert first.is_error and "nested deeper than 64" in first.content
    assert len(first.content) < 500
    assert (second.content, second.is_error) == ("qa is up", False)
    assert RAN == ["status qa"]
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED
    assert entries(records, AssistantStepEntry)[-1].text == "done"
    [step, _] = entries(records, AssistantStepEntry)
    assert step.tool_calls[0].arguments_json == "{}"  # not kept, not shown to the model again
    assert step.tool_calls[0].refused == first.content


async def test_a_gated_call_with_arguments_too_deep_is_answered_not_asked(
    team: InProcessMesh,
) -> None:
    deep = '{"env": ' + "[" * 1000 + "]" * 1000 + "}"
    team.scripted.program("lead", Raw(calls=(call("c-1", "deploy", deep),)), Reply())
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)
    assert entries(records, ApprovalRequestEntry) == []
    [result] = entries(records, ToolResultEntry)
    assert result.is_error and "nested deeper than 64" in result.content
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED


async def test_arguments_larger_than_a_step_may_hold_get_an_error_result_and_fit_the_store(
    team: InProcessMesh,
) -> None:
    huge = json.dumps({"text": "x" * (MAX_STEP_BYTES + 1)})
    calls = (call("c-1", "note", huge), call("c-2", "note", '{"text": "small"}'))
    team.scripted.program("lead", Raw(calls=calls), Reply(text="done"))
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)

    first, second = entries(records, ToolResultEntry)
    assert first.is_error and f"larger than {MAX_STEP_BYTES} bytes" in first.content
    assert second.content == "noted 5 characters"
    assert RAN == ["note 5"]
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED
    fits_the_store(records)


async def test_calls_whose_arguments_together_overflow_the_step_are_refused_from_there_on(
    team: InProcessMesh,
) -> None:
    third = MAX_STEP_BYTES // 3
    piece = json.dumps({"text": "y" * third})
    calls = tuple(call(f"c-{n}", "note", piece) for n in range(4))
    team.scripted.program("lead", Raw(calls=calls), Reply(text="done"))
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)

    results = entries(records, ToolResultEntry)
    assert [r.is_error for r in results] == [False, False, True, True]
    assert "together" in results[2].content
    assert [f"note {third}", f"note {third}"] == RAN
    fits_the_store(records)


async def test_a_step_with_huge_text_and_huge_arguments_still_fits_the_store(
    team: InProcessMesh,
) -> None:
    text = "\x01" * 2_000_000  # six bytes each once escaped in the stored JSON
    piece = json.dumps({"text": "\x02" * 100_000})  # escaped in the arguments, again when stored
    calls = (call("c-1", "note", piece), call("c-2", "note", '{"text": "small"}'))
    team.scripted.program("lead", Raw(calls=calls, text=text), Reply(text="done"))
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)
    fits_the_store(records)
    step = entries(records, AssistantStepEntry)[0]
    assert step.text.endswith("]") and "cut" in step.text.splitlines()[-1]
    assert entries(records, TurnEndedEntry)[-1].outcome is TurnOutcome.COMPLETED
    assert entries(records, ToolResultEntry)[-1].content == "noted 5 characters"


async def test_a_step_of_more_calls_than_a_step_may_make_keeps_the_first_and_says_so(
    team: InProcessMesh,
) -> None:
    calls = tuple(call(f"c-{n}", "status", '{"env": "e"}') for n in range(10_000))
    team.scripted.program("lead", Raw(calls=calls), Reply(text="done"))
    await team.manager.create_root("Go.", preset="lead")
    records = await ended(team)
    step = entries(records, AssistantStepEntry)[0]
    assert len(step.tool_calls) == MAX_CALLS_PER_STEP
    assert f"{10_000 - MAX_CALLS_PER_STEP} more tool calls" in step.text
    assert len(entries(records, ToolResultEntry)) == MAX_CALLS_PER_STEP
    fits_the_store(records)
