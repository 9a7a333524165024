"""The one text boundary (core/_text.py): every string an entry holds is valid Unicode, made so
when the entry is built, with a note on prose of how many characters were replaced."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dsh_mesh.core import (
    MAX_APPROVAL_REASON_CHARS,
    ApprovalDecision,
    ApprovalDecisionEntry,
    AssistantStepEntry,
    ChatMessage,
    Role,
    ToolCall,
    ToolDescriptor,
    ToolResultEntry,
    Usage,
    is_valid_text,
    replacement_note,
    valid_prose,
    valid_text,
)


def test_lone_surrogates_are_replaced_and_counted() -> None:
    assert valid_text("caf\udce9") == ("caf\ufffd", 1)
    assert valid_text("\ud800\ud800x\udfff") == ("\ufffd\ufffdx\ufffd", 3)


def test_a_high_surrogate_followed_by_a_low_one_is_the_character_they_spell() -> None:
    assert valid_text("a\ud83d\ude00b") == ("a\U0001f600b", 0)


def test_a_replacement_character_already_there_is_not_counted() -> None:
    assert valid_text("\ufffd\ud800") == ("\ufffd\ufffd", 1)


def test_valid_text_is_returned_as_it_is() -> None:
    text = "naïve \U0001f600 \x00 \ufffd"
    assert valid_text(text) == (text, 0)
    assert valid_prose(text) is text


def test_prose_gains_a_note_of_how_many_were_replaced() -> None:
    assert valid_prose("x\ud800") == "x\ufffd\n" + replacement_note(1)
    assert replacement_note(1) == "[dsh-mesh: 1 invalid character was replaced with U+FFFD]"
    assert replacement_note(4) == "[dsh-mesh: 4 invalid characters were replaced with U+FFFD]"


@given(st.text())
def test_any_text_becomes_valid_utf8_and_a_second_pass_changes_nothing(text: str) -> None:
    once = valid_prose(text)
    once.encode("utf-8")
    assert is_valid_text(once)
    assert valid_prose(once) == once


def test_every_string_of_an_entry_is_valid_once_built_and_only_prose_is_noted() -> None:
    step = AssistantStepEntry(
        text="I read caf\udce9.",
        tool_calls=(ToolCall(call_id="c-1", name="read", arguments_json='{"p":"\ud800"}'),),
        usage=Usage(),
    )
    assert step.text == "I read caf\ufffd.\n" + replacement_note(1)
    assert step.tool_calls[0].arguments_json == '{"p":"\ufffd"}'  # still JSON: no note
    result = ToolResultEntry(call_id="c-\udc80", name="read", content="\udcff" * 3)
    assert result.call_id == "c-\ufffd"  # an id: made valid, no note
    assert result.content == "\ufffd" * 3 + "\n" + replacement_note(3)
    assert ChatMessage(role=Role.TOOL, content="\ud800").content.endswith(replacement_note(1))
    described = ToolDescriptor(name="t", description="d\ud800", input_schema_json="{}")
    assert described.description == "d\ufffd\n" + replacement_note(1)


def test_building_an_entry_from_valid_text_keeps_it_identical() -> None:
    entry = ToolResultEntry(call_id="c", name="n", content="plain")
    assert entry == ToolResultEntry(call_id="c", name="n", content="plain")
    assert entry.content == "plain"


def test_a_reason_at_its_bound_with_a_lone_surrogate_still_builds() -> None:
    """The bound is judged before the note is added: a decision stored at the bound before
    the text boundary existed reads again."""
    reason = "x" * (MAX_APPROVAL_REASON_CHARS - 1) + "\ud800"
    decision = ApprovalDecisionEntry(
        call_id="c", decision=ApprovalDecision.DENY, request_digest="d", reason=reason
    )
    assert decision.reason.endswith(replacement_note(1))
