"""Structured answers (ADR 0052): a session whose spec names an output schema has each turn's
final answer checked; a mismatch is answered with a correction and asked again, twice at most;
the matching value is the turn's ``output_json`` and its settlement notice's."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from dsh_mesh.agent import AnswerChecker, _steps
from dsh_mesh.core import (
    ANSWER_RETRIES,
    MAX_OUTPUT_SCHEMA_BYTES,
    AnswerInvalid,
    AnswerRejectedEntry,
    AssistantStepEntry,
    ChatMessage,
    InvalidArgument,
    Role,
    SessionId,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    TurnEndedEntry,
    TurnOutcome,
    answer_value,
    check_output_schema,
    frame_answer_rejected,
    output_instruction,
    parse_output_schema,
)
from dsh_mesh.models import CallPurpose, ModelRequest, OpenAIEndpoint, Reply, tool
from dsh_mesh.models._openai_wire import request_body
from dsh_mesh.node import PresetFileError, load_presets
from dsh_mesh.testing import in_process_mesh
from dsh_mesh.tools import Preset
from tests.unit.conftest import CHILD, ROOT, of_type

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "why": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
SCHEMA_JSON = check_output_schema(SCHEMA)


def answering_presets(*, lead: Mapping[str, object] | None = None) -> tuple[Preset, ...]:
    return (
        Preset(name="lead", system_prompt="You lead.", model="lead", output_schema=lead),
        Preset(name="helper", system_prompt="You help.", model="helper", output_schema=SCHEMA),
        Preset(name="plain", system_prompt="You answer.", model="plain"),
    )


# -- the schema and the answer, pure ------------------------------------------------------------


def test_an_answer_that_matches_is_its_canonical_value() -> None:
    assert answer_value('{ "why": "sum", "answer": 4 }', SCHEMA_JSON) == '{"answer":4,"why":"sum"}'
    assert answer_value('\n```json\n{"answer": 4}\n```\n', SCHEMA_JSON) == '{"answer":4}'
    assert answer_value('```\n{"answer": 5}\n```', SCHEMA_JSON) == '{"answer":5}'


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("It is four.", "not JSON"),
        ('{"answer": "four"}', "at [\"answer\"]: 'four' is not of type 'integer'"),
        ('{"why": "no answer"}', "'answer' is a required property"),
        ('{"answer": 4, "extra": 1}', "Additional properties"),
        ("[4]", "is not of type 'object'"),
    ],
)
def test_an_answer_that_does_not_match_says_why(text: str, says: str) -> None:
    with pytest.raises(AnswerInvalid, match=None) as invalid:
        answer_value(text, SCHEMA_JSON)
    assert says in str(invalid.value)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ([], "non-empty JSON object"),
        ({}, "non-empty JSON object"),
        ("{}", "non-empty JSON object"),
        ({"type": 5}, "not a valid JSON schema"),
        ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "not a valid JSON schema"),
        ({"enum": ["x" * MAX_OUTPUT_SCHEMA_BYTES]}, "at most 65,536 bytes"),
    ],
)
def test_a_schema_that_is_not_one_is_refused(schema: object, says: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_output_schema(schema)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    "reference",
    [
        {"$ref": "http://169.254.169.254/latest/meta-data"},
        {"properties": {"a": {"$ref": "other.json#/x"}}},
        {"items": [{"$dynamicRef": "https://example.com/s"}]},
    ],
)
def test_a_schema_that_refers_out_of_itself_is_refused(reference: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="may only refer within itself"):
        check_output_schema(reference)


def test_a_reference_within_the_schema_is_followed_and_nothing_is_retrieved() -> None:
    schema = check_output_schema({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"})
    assert answer_value("3", schema) == "3"
    with pytest.raises(AnswerInvalid, match="is not of type 'integer'"):
        answer_value('"three"', schema)
    # A stored schema from before the check above is still never fetched from: unresolvable.
    with pytest.raises(AnswerInvalid, match="cannot resolve"):
        answer_value("3", '{"$ref":"http://127.0.0.1:9/schema.json"}')


def test_a_schema_of_too_many_objects_or_not_unicode_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="at most 1,000 JSON objects"):
        check_output_schema({"anyOf": [{}] * 1000})
    assert check_output_schema({"anyOf": [{}] * 998})
    with pytest.raises(InvalidArgument, match="valid Unicode"):
        check_output_schema({"const": "\ud800"})


def test_references_are_read_only_where_they_are_references() -> None:
    # A property named $ref, and data that holds a "$ref", are no references.
    schema = check_output_schema(
        {
            "type": "object",
            "properties": {"$ref": {"type": "string"}},
            "examples": [{"$ref": "http://example.com/x"}],
        }
    )
    assert answer_value('{"$ref": "x"}', schema) == '{"$ref":"x"}'


def test_an_answer_too_large_or_not_unicode_does_not_match() -> None:
    anything = check_output_schema({"type": "array"})
    with pytest.raises(AnswerInvalid, match="longer than 524,288 bytes"):
        answer_value("[" + "1," * 300_000 + "1]", anything)
    # Short to write, long as canonical JSON: 1e5 is 100000.0.
    with pytest.raises(AnswerInvalid, match="at most 262,144"):
        answer_value("[" + ",".join(["1e5"] * 60_000) + "]", anything)
    with pytest.raises(AnswerInvalid, match="not valid Unicode"):
        answer_value('["\\ud800"]', anything)


def test_a_schema_too_deep_is_refused_before_it_is_read() -> None:
    deep: dict[str, object] = {"type": "array"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidArgument, match="32 levels"):
        check_output_schema(deep)


def test_a_schema_as_text_is_parsed_and_checked() -> None:
    assert parse_output_schema("") == ""
    assert parse_output_schema(json.dumps(SCHEMA, indent=2)) == SCHEMA_JSON
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_output_schema("{not json")
    with pytest.raises(InvalidArgument, match="nested deeper than 32"):
        parse_output_schema("[" * 40 + "]" * 40)
    with pytest.raises(InvalidArgument, match="non-empty JSON object"):
        parse_output_schema("4")


def test_a_preset_refuses_a_schema_that_is_not_one_when_it_is_made() -> None:
    with pytest.raises(InvalidArgument, match="not a valid JSON schema"):
        Preset(name="p", system_prompt="s", output_schema={"type": "nonsense"})
    assert Preset(name="p", system_prompt="s").output_schema_json() == ""
    assert Preset(name="p", system_prompt="s", output_schema=SCHEMA).output_schema_json() == (
        SCHEMA_JSON
    )


# -- the agent ----------------------------------------------------------------------------------


async def test_a_root_answer_that_does_not_match_is_corrected_and_asked_again() -> None:
    async with in_process_mesh(answering_presets(lead=SCHEMA)) as mesh:
        mesh.scripted.program(
            "lead", Reply(text="It is four."), Reply(text='```json\n{"answer": 4}\n```')
        )
        await mesh.manager.create_root("What is 2+2?", preset="lead")
        await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)

        task = of_type(records, TaskEntry)[0].entry
        assert isinstance(task, TaskEntry)
        assert task.content == f"What is 2+2?\n\n{output_instruction(SCHEMA_JSON)}"
        kinds = [type(r.entry).__name__ for r in records if not isinstance(r.entry, TaskEntry)]
        assert kinds == [
            "TurnStartedEntry",
            "ConsumedEntry",
            "AssistantStepEntry",
            "AnswerRejectedEntry",
            "AssistantStepEntry",
            "TurnEndedEntry",
        ]
        rejected = of_type(records, AnswerRejectedEntry)[0].entry
        assert isinstance(rejected, AnswerRejectedEntry)
        assert "not JSON" in rejected.reason and rejected.schema == SCHEMA_JSON
        ended = records[-1].entry
        assert isinstance(ended, TurnEndedEntry)
        assert (ended.outcome, ended.output_json) == (TurnOutcome.COMPLETED, '{"answer":4}')

        requests = mesh.recorder.requests_of(ROOT)
        assert [r.output_schema for r in requests] == [SCHEMA_JSON, SCHEMA_JSON]
        correction = requests[1].messages[-1]
        assert correction.role is Role.USER
        assert correction.content == frame_answer_rejected(rejected.reason, SCHEMA_JSON)
        assert requests[1].messages[-2].content == "It is four."


async def test_a_turn_whose_answers_never_match_ends_with_error_after_its_retries() -> None:
    async with in_process_mesh(answering_presets(lead=SCHEMA)) as mesh:
        mesh.scripted.program("lead", *(Reply(text=f"no {n}") for n in range(5)))
        await mesh.manager.create_root("Answer.", preset="lead")
        await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)

        assert len(of_type(records, AssistantStepEntry)) == ANSWER_RETRIES + 1
        assert len(of_type(records, AnswerRejectedEntry)) == ANSWER_RETRIES + 1
        ended = records[-1].entry
        assert isinstance(ended, TurnEndedEntry)
        assert ended.outcome is TurnOutcome.ERROR and ended.output_json == ""
        assert f"in {ANSWER_RETRIES + 1} tries" in ended.detail and "not JSON" in ended.detail


async def test_a_turn_that_ends_while_its_children_work_is_not_checked() -> None:
    async with in_process_mesh(answering_presets(lead=SCHEMA)) as mesh:
        helper_done = asyncio.Event()
        mesh.scripted.program(
            "lead",
            tool("spawn_agent", task="Look.", preset="plain"),
            Reply(text="I wait for my helper."),  # no final answer yet: its child works
            Reply(text='{"answer": 8}'),  # the turn the helper's notice starts
        )
        mesh.scripted.program("plain", Reply(text="seven", gate=helper_done))
        await mesh.manager.create_root("Ask.", preset="lead")
        await mesh.manager.wait_until(
            lambda: mesh.manager.agent(ROOT) is not None and mesh.manager.agent(ROOT).turns_run == 1  # type: ignore[union-attr]
        )
        helper_done.set()
        await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)
        assert not of_type(records, AnswerRejectedEntry)
        ended = [r.entry for r in of_type(records, TurnEndedEntry)]
        assert [(e.outcome, e.output_json) for e in ended if isinstance(e, TurnEndedEntry)] == [
            (TurnOutcome.COMPLETED, ""),
            (TurnOutcome.COMPLETED, '{"answer":8}'),
        ]
        assert not of_type(await mesh.transcript(CHILD), AnswerRejectedEntry)  # no schema there


async def test_a_child_with_a_schema_reports_its_value_in_its_settlement_notice() -> None:
    async with in_process_mesh(answering_presets()) as mesh:
        mesh.scripted.program(
            "lead", tool("spawn_agent", task="Count.", preset="helper"), Reply(text="done")
        )
        mesh.scripted.program("helper", Reply(text='{"answer": 3, "why": "counted"}'))
        await mesh.manager.create_root("Delegate.", preset="lead")
        await mesh.manager.quiescent()

        child_task = of_type(await mesh.transcript(CHILD), TaskEntry)[0].entry
        assert isinstance(child_task, TaskEntry)
        assert child_task.content.endswith(output_instruction(SCHEMA_JSON))
        notice = of_type(await mesh.transcript(ROOT), SettlementNoticeEntry)[0].entry
        assert isinstance(notice, SettlementNoticeEntry)
        assert notice.outcome is SettlementOutcome.COMPLETED
        assert notice.output_json == '{"answer":3,"why":"counted"}'
        assert notice.terminal_output == '{"answer": 3, "why": "counted"}'
        ended = of_type(await mesh.transcript(ROOT), TurnEndedEntry)[-1].entry
        assert isinstance(ended, TurnEndedEntry) and ended.output_json == ""  # lead: none


async def test_a_root_may_name_its_own_schema_in_place_of_its_presets() -> None:
    own = check_output_schema({"type": "array", "items": {"type": "string"}})
    async with in_process_mesh(answering_presets(lead=SCHEMA)) as mesh:
        mesh.scripted.program("lead", Reply(text='["a", "b"]'))
        await mesh.manager.create_root("List.", preset="lead", output_schema=own)
        await mesh.manager.quiescent()
        header = await mesh.manager.header(ROOT)
        assert header.spec.output_schema == own
        ended = (await mesh.transcript(ROOT))[-1].entry
        assert isinstance(ended, TurnEndedEntry) and ended.output_json == '["a","b"]'


async def test_a_session_without_a_schema_is_never_checked() -> None:
    async with in_process_mesh(answering_presets()) as mesh:
        mesh.scripted.program("plain", Reply(text="not JSON at all"))
        await mesh.manager.create_root("Hi.", preset="plain")
        await mesh.manager.quiescent()
        records = await mesh.transcript(ROOT)
        assert not of_type(records, AnswerRejectedEntry)
        ended = records[-1].entry
        assert isinstance(ended, TurnEndedEntry)
        assert (ended.outcome, ended.output_json) == (TurnOutcome.COMPLETED, "")
        assert mesh.recorder.requests_of(ROOT)[0].output_schema == ""


async def test_a_check_that_backtracks_counts_as_no_match_and_never_stalls_the_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hostile schema: checking this answer backtracks for seconds. The node's loop goes on
    # meanwhile (no gap between its ticks near the check's length); the answer counts as not
    # matching, and the next one against the same schema is refused at once.
    monkeypatch.setattr(_steps, "ANSWER_CHECK_SECONDS", 0.5)
    hostile = {"type": "string", "pattern": "^(a+)+$"}
    async with in_process_mesh(answering_presets(lead=hostile)) as mesh:
        slow = json.dumps("a" * 30 + "!")
        mesh.scripted.program("lead", Reply(text=slow), Reply(text='"aa"'))
        await mesh.manager.create_root("Go.", preset="lead")
        ticks = [time.monotonic()]
        while mesh.manager.agent(ROOT) is None or not mesh.manager.agent(ROOT).at_rest:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())
        gaps = [later - earlier for earlier, later in itertools.pairwise(ticks)]
        assert max(gaps) < 0.4, max(gaps)
        records = await mesh.transcript(ROOT)
        reasons = [r.entry.reason for r in records if isinstance(r.entry, AnswerRejectedEntry)]
        assert reasons[0] == "checking it against the schema took more than 0.5 s"
        assert "this node checks no more answers against it" in reasons[1]
        ended = records[-1].entry
        assert isinstance(ended, TurnEndedEntry) and ended.output_json == ""


async def test_a_check_cancelled_midway_never_answers_the_next_one() -> None:
    checker = AnswerChecker()
    try:
        hostile = check_output_schema({"type": "string", "pattern": "^(a+)+$"})
        assert await checker.check('"aa"', hostile, seconds=30) == '"aa"'  # started, warm
        slow = asyncio.ensure_future(checker.check(json.dumps("a" * 30 + "!"), hostile, seconds=30))
        await asyncio.sleep(0.2)  # the worker is inside the check
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert await checker.check('{"answer": 5}', SCHEMA_JSON, seconds=30) == '{"answer":5}'
        with pytest.raises(AnswerInvalid, match="not JSON"):
            await checker.check("five", SCHEMA_JSON, seconds=30)
    finally:
        await checker.close()


# -- where a schema comes from and where it goes -----------------------------------------------


def test_a_presets_file_names_a_schema_inline_or_in_a_file(tmp_path: Path) -> None:
    (tmp_path / "answer.json").write_text(json.dumps(SCHEMA, indent=2))
    path = tmp_path / "presets.toml"
    path.write_text(
        "[presets.inline]\n"
        'system_prompt = "s"\n'
        'output_schema = { type = "array", items = { type = "string" } }\n'
        "[presets.filed]\n"
        'system_prompt = "s"\n'
        'output_schema_file = "answer.json"\n'
        "[presets.none]\n"
        'system_prompt = "s"\n'
        "[endpoints.local]\n"
        'base_url = "http://127.0.0.1:9/v1"\n'
        "structured_outputs = false\n"
    )
    loaded = load_presets(path, environ={})
    inline, filed, none = loaded.presets
    assert inline.output_schema_json() == '{"items":{"type":"string"},"type":"array"}'
    assert filed.output_schema_json() == SCHEMA_JSON
    assert none.output_schema_json() == ""
    assert loaded.endpoints["local"].structured_outputs is False
    assert loaded.endpoints["openai"].structured_outputs is True


@pytest.mark.parametrize(
    ("preset", "complaint"),
    [
        ('output_schema = { type = "nonsense" }', "presets.p: not a valid JSON schema"),
        ('output_schema = "object"', "presets.p.output_schema must be a table"),
        ('output_schema_file = "missing.json"', "presets.p.output_schema_file: .*No such file"),
        ('output_schema_file = "bad.json"', "presets.p.output_schema_file: .*not valid JSON"),
        (
            'output_schema = { type = "object" }\noutput_schema_file = "bad.json"',
            "at most one of output_schema, output_schema_file",
        ),
    ],
)
def test_a_presets_file_with_a_schema_that_is_not_one_is_refused(
    tmp_path: Path, preset: str, complaint: str
) -> None:
    (tmp_path / "bad.json").write_text("{nope")
    path = tmp_path / "presets.toml"
    path.write_text(f'[presets.p]\nsystem_prompt = "s"\n{preset}\n')
    with pytest.raises(PresetFileError, match=complaint):
        load_presets(path, environ={})


def test_a_step_asks_the_server_for_the_schema_and_a_compaction_does_not() -> None:
    step = ModelRequest(
        session_id=SessionId("s-1"),
        model="m",
        system_prompt="s",
        tools=(),
        messages=(ChatMessage(role=Role.USER, content="Go."),),
        output_schema=SCHEMA_JSON,
    )
    body = json.loads(request_body(step, model="m", output_schema=step.output_schema))
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA},
    }
    assert list(body)[-1] == "response_format"  # after the conversation: the prefix is kept
    plain = request_body(step, model="m")
    assert request_body(step, model="m", output_schema=SCHEMA_JSON).startswith(plain[:-1])
    assert "response_format" not in json.loads(plain)
    summary = dataclasses.replace(step, purpose=CallPurpose.COMPACTION)
    assert "response_format" not in json.loads(
        request_body(summary, model="m", output_schema=SCHEMA_JSON)
    )
    with pytest.raises(ValueError, match="response_format"):
        OpenAIEndpoint(body={"response_format": {"type": "json_object"}})
