"""One bounded JSON parser (core/_json.py): depth and size are checked before anything is
parsed, without recursion, and a refusal quotes a bounded prefix of what it refused."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsh_mesh.core import (
    MAX_CALLS_PER_STEP,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    MAX_QUOTE_CHARS,
    MAX_STEP_BYTES,
    MAX_TOOL_NAME_CHARS,
    InvalidArgument,
    RejectionReason,
    ToolCall,
    Usage,
    bounded_quote,
    json_depth,
    parse_bounded,
    recorded_step,
)
from dsh_mesh.registry import encode_entry


def test_json_nested_100_000_deep_is_refused_typed_not_a_recursion_error() -> None:
    text = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidArgument) as refused:
        parse_bounded(text, max_depth=64, max_bytes=1024 * 1024)
    assert refused.value.reason is RejectionReason.INVALID_ARGUMENT
    assert "nested deeper than 64" in refused.value.detail
    assert refused.value.metadata == {"limit": "json_depth", "max": "64"}
    assert len(refused.value.detail) < 300


def test_an_unclosed_nest_is_refused_by_depth_too() -> None:
    with pytest.raises(InvalidArgument, match="nested deeper than 64"):
        parse_bounded('{"a":' * 100_000, max_depth=64, max_bytes=1024 * 1024)


def test_depth_exactly_at_the_limit_parses() -> None:
    text = "[" * 64 + "]" * 64
    assert json_depth(text) == 64
    value = parse_bounded(text, max_depth=64, max_bytes=1024)
    for _ in range(63):
        value = value[0]
    assert value == []
    with pytest.raises(InvalidArgument):
        parse_bounded("[" + text + "]", max_depth=64, max_bytes=1024)


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"a": '[[[[{{{{\\"[[[[', "b": ["]]]]"]})
    assert json_depth(text) == 2
    assert parse_bounded(text, max_depth=2, max_bytes=1024) == json.loads(text)


def test_an_unterminated_string_hides_the_brackets_after_it() -> None:
    assert json_depth('["' + "[" * 1000) == 1


def test_size_is_counted_in_utf8_bytes() -> None:
    text = json.dumps("é" * 600, ensure_ascii=False)  # 602 characters, 1202 bytes
    assert parse_bounded(text, max_depth=1, max_bytes=1202) == "é" * 600
    with pytest.raises(InvalidArgument) as refused:
        parse_bounded(text, max_depth=1, max_bytes=1201)
    assert "larger than 1201 bytes" in refused.value.detail
    assert refused.value.metadata == {"limit": "json_bytes", "max": "1201"}


def test_a_huge_text_is_refused_by_size_and_quoted_briefly() -> None:
    text = '{"x": "' + "a" * (2 * 1024 * 1024) + '"}'
    with pytest.raises(InvalidArgument) as refused:
        parse_bounded(text)
    assert f"larger than {MAX_JSON_BYTES} bytes" in refused.value.detail
    assert len(refused.value.detail) < 100 + MAX_QUOTE_CHARS


def test_text_that_is_not_json_is_refused_with_a_bounded_quote() -> None:
    text = "{nope" + "x" * 10_000
    with pytest.raises(InvalidArgument) as refused:
        parse_bounded(text)
    assert "not valid JSON" in refused.value.detail
    assert "{nope" in refused.value.detail
    assert len(refused.value.detail) < 200 + MAX_QUOTE_CHARS


def test_an_integer_of_100_000_digits_is_refused_typed() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_bounded("9" * 100_000)


def test_the_defaults_are_the_documented_ones() -> None:
    assert MAX_JSON_DEPTH == 64
    assert MAX_JSON_BYTES == 1024 * 1024
    assert parse_bounded('{"a": [1, 2, {"b": null}]}') == {"a": [1, 2, {"b": None}]}


def test_bounded_quote_cuts_and_says_how_much_was_cut() -> None:
    assert bounded_quote("short") == "'short'"
    quoted = bounded_quote("x" * 10_000, max_chars=10)
    assert quoted == "'xxxxxxxxxx'... (9990 more characters)"
    assert bounded_quote("a\nb\ud800", max_chars=10) == "'a\\nb\\ud800'"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@given(json_values)
def test_the_scan_agrees_with_the_parsed_depth(value: object) -> None:
    text = json.dumps(value)
    assert json_depth(text) == _depth(value)
    assert parse_bounded(text, max_depth=max(_depth(value), 1)) == value


# -- recorded_step (core/_calls.py): what a model's step is recorded as -------------------------

ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=80)
CALL_IDS = st.sampled_from(["c-1", "c-1_2", "", "x" * 65, "a b", "call_0"]) | ANY_TEXT
MODEL_CALLS = st.lists(
    st.builds(
        ToolCall,
        call_id=CALL_IDS,
        name=st.sampled_from(["status", "n" * 200]) | ANY_TEXT,
        arguments_json=st.sampled_from(['{"a": 1}', "[" * 70 + "]" * 70, "{", ""]) | ANY_TEXT,
    ),
    max_size=80,
)


@given(ANY_TEXT, MODEL_CALLS)
def test_a_recorded_step_has_unique_bounded_ids_and_recording_it_again_changes_nothing(
    text: str, calls: list[ToolCall]
) -> None:
    step = recorded_step(text, calls, Usage())
    ids = [c.call_id for c in step.tool_calls]
    assert len(ids) == len(set(ids)) == min(len(calls), MAX_CALLS_PER_STEP)
    assert all(re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", i) for i in ids)
    assert all(len(c.name) <= MAX_TOOL_NAME_CHARS for c in step.tool_calls)
    for sent, recorded in zip(calls, step.tool_calls, strict=False):
        assert (recorded.given_id is None) == (recorded.call_id == sent.call_id)
        assert bool(recorded.refused) == (recorded.arguments_json != sent.arguments_json)
    # The same answer is recorded the same way on any node, and a recorded step is final.
    assert recorded_step(text, calls, Usage()) == step
    assert recorded_step(step.text, step.tool_calls, Usage()) == step


def test_a_step_of_the_largest_calls_and_text_stays_inside_a_store_entry() -> None:
    calls = [
        ToolCall(call_id="\x01" * 10_000, name="\x01" * 10_000, arguments_json="\x01" * 50_000)
        for _ in range(1000)
    ]
    step = recorded_step("\x01" * 3_000_000, calls, Usage())
    assert len(encode_entry(step)) <= MAX_STEP_BYTES + 64 * 1024


def test_many_brackets_shallowly_nested_are_scanned_and_accepted() -> None:
    """More opening brackets than the limit, none nested deeper than it: the scan decides."""
    text = "[" + ",".join(["[]"] * 100) + "]"
    assert parse_bounded(text, max_depth=2, max_bytes=1024) == [[]] * 100
    with pytest.raises(InvalidArgument, match="nested deeper than 1"):
        parse_bounded(text, max_depth=1, max_bytes=1024)
