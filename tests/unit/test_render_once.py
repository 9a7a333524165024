"""A turn renders its growing context once per record, and the provider encodes each message
once per turn (ADR 0047, section 12): what is sent is byte for byte what rendering and encoding
everything afresh would send, cleared outputs and all."""

from __future__ import annotations

import pytest

from dsh_mesh.agent import render
from dsh_mesh.agent._render import Shown
from dsh_mesh.core import (
    AssistantStepEntry,
    ChatMessage,
    Record,
    SessionId,
    TaskEntry,
    ToolCall,
    ToolOutputsClearedEntry,
    ToolResultEntry,
    Usage,
)
from dsh_mesh.models import ModelRequest
from dsh_mesh.models import _openai_wire as wire


def _turn(steps: int) -> list[Record]:
    records = [Record(seq=1, entry=TaskEntry(content="Count the ticks."))]
    for n in range(steps):
        call = ToolCall(call_id=f"call_{n}", name="tick", arguments_json=f'{{"n":{n}}}')
        step = AssistantStepEntry(text=f"step {n}", tool_calls=(call,), usage=Usage())
        result = ToolResultEntry(call_id=call.call_id, name="tick", content=f"ticked {n}")
        records += [
            Record(seq=len(records) + 1, entry=step),
            Record(seq=len(records) + 2, entry=result),
        ]
    return records


def test_rendering_a_growing_turn_with_what_was_made_renders_the_same_and_reuses_it() -> None:
    records = _turn(6)
    made: Shown = {}
    earlier = render(records[:5], made=made)
    assert earlier == render(records[:5])
    later = render(records, made=made)
    assert later == render(records)
    assert all(a is b for a, b in zip(earlier[1:], later[1:], strict=False))  # made once


def test_an_output_cleared_later_shows_as_its_stub_though_it_was_made_whole() -> None:
    records = _turn(3)
    made: Shown = {}
    whole = render(records, made=made)
    cleared = [*records, Record(seq=len(records) + 1, entry=ToolOutputsClearedEntry(seqs=(3,)))]
    stubbed = render(cleared, made=made)
    assert stubbed == render(cleared)
    assert stubbed[1] != whole[1] and "cleared" in stubbed[1].content  # seq 3, shown second
    assert render(records, clear_all=True, made=made) == render(records, clear_all=True)


def test_a_record_replaced_under_the_same_seq_is_made_again() -> None:
    records = _turn(1)
    made: Shown = {}
    render(records, made=made)
    other = Record(seq=3, entry=ToolResultEntry(call_id="call_0", name="tick", content="other"))
    assert render([*records[:2], other], made=made)[1].content == "other"


def _request(records: list[Record], memo: dict[object, object]) -> ModelRequest:
    return ModelRequest(
        session_id=SessionId("s-1"),
        model="m",
        system_prompt="p",
        tools=(),
        messages=render(records),
        memo=memo,
    )


def test_each_message_of_a_turn_is_encoded_once_and_the_bytes_are_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoded: list[str] = []
    original = wire._message

    def counting(message: ChatMessage) -> str:
        text = original(message)
        encoded.append(text)
        return text

    monkeypatch.setattr(wire, "_message", counting)
    records = _turn(4)
    memo: dict[object, object] = {}
    first = wire.request_body(_request(records[:3], memo), model="m")
    assert first == wire.request_body(_request(records[:3], {}), model="m")
    encoded.clear()
    second = wire.request_body(_request(records, memo), model="m")
    assert second == wire.request_body(_request(records, {}), model="m")
    # The six messages the first request lacked, then all eight again without a memo.
    assert len(encoded) == (8 - 2) + 8
