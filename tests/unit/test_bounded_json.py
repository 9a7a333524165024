"""One bounded JSON parser (core/_json.py): depth and size are checked before anything is
parsed, without recursion, and a refusal quotes a bounded prefix of what it refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsh_mesh.core import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    MAX_QUOTE_CHARS,
    InvalidArgument,
    RejectionReason,
    bounded_quote,
    json_depth,
    parse_bounded,
)


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
