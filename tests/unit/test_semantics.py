"""Pure semantics: headers, session ids, framing, the one source, pending inbound and rendering."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsh_mesh.agent import render
from dsh_mesh.core import (
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    AssistantStepEntry,
    ChatMessage,
    CompactionEntry,
    ConsumedEntry,
    DeliveryKind,
    Entry,
    ForkOrigin,
    HumanPromptEntry,
    InvalidArgument,
    Record,
    Role,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolCall,
    ToolResultEntry,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    Usage,
    frame_agent_message,
    parse_session_id,
    pending_inbound,
)

SPEC = SessionSpec(preset="p", model="m")
ROOT = SessionId("s-root")
CHILD = SessionId("s-child")
OTHER = SessionId("s-other")

# -- SessionHeader ---------------------------------------------------------------------------


def test_well_formed_headers_are_accepted() -> None:
    SessionHeader(session_id=ROOT, kind=SessionKind.ROOT, parent_session=None, spec=SPEC)
    for kind in (SessionKind.CONTINUABLE_CHILD, SessionKind.ONE_SHOT_CHILD):
        SessionHeader(session_id=CHILD, kind=kind, parent_session=ROOT, spec=SPEC)
    SessionHeader(
        session_id=CHILD,
        kind=SessionKind.CONTINUABLE_CHILD,
        parent_session=ROOT,
        spec=SPEC,
        fork_origin=ForkOrigin(parent_session=ROOT, prefix_seq=3),
    )


def test_a_root_with_a_parent_is_invalid() -> None:
    with pytest.raises(InvalidArgument):
        SessionHeader(session_id=ROOT, kind=SessionKind.ROOT, parent_session=OTHER, spec=SPEC)


@pytest.mark.parametrize("kind", [SessionKind.CONTINUABLE_CHILD, SessionKind.ONE_SHOT_CHILD])
def test_a_child_without_a_parent_is_invalid(kind: SessionKind) -> None:
    with pytest.raises(InvalidArgument):
        SessionHeader(session_id=CHILD, kind=kind, parent_session=None, spec=SPEC)


@pytest.mark.parametrize("kind", [SessionKind.CONTINUABLE_CHILD, SessionKind.ONE_SHOT_CHILD])
def test_a_session_cannot_be_its_own_parent(kind: SessionKind) -> None:
    with pytest.raises(InvalidArgument):
        SessionHeader(session_id=CHILD, kind=kind, parent_session=CHILD, spec=SPEC)


def test_a_fork_inherits_only_from_its_own_parent() -> None:
    with pytest.raises(InvalidArgument):
        SessionHeader(
            session_id=CHILD,
            kind=SessionKind.CONTINUABLE_CHILD,
            parent_session=ROOT,
            spec=SPEC,
            fork_origin=ForkOrigin(parent_session=OTHER, prefix_seq=1),
        )


# -- session ids ------------------------------------------------------------------------------

WHITESPACE = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]


@pytest.mark.parametrize(
    "text",
    ["s-1", "a", "S.9", "node:s-42", "s_1-2.3:4", "0", "x" * 128, "s-" + "f" * 24],
)
def test_ordinary_session_ids_are_accepted_unchanged(text: str) -> None:
    parsed = parse_session_id(text)
    assert parsed == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        " s-1",
        "s-1 ",
        "s 1",
        "s-1\n",
        "\ts-1",
        "x" * 129,
        "s-" + "1" * 127,
        "s-\x00",
        "s-\x1b[0m",
        "s-1\x7f",
        "s-\u200b1",
    ],
)
def test_malformed_session_ids_are_rejected(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_session_id(text)


ID_LIKE = st.text(
    alphabet=st.sampled_from("abcXYZ019._:-/ \t\u00e9\u0000"), min_size=0, max_size=140
)


@given(st.one_of(ID_LIKE, st.text(max_size=40)))
def test_an_accepted_id_round_trips_unchanged(text: str) -> None:
    try:
        parsed = parse_session_id(text)
    except InvalidArgument:
        return
    assert parsed == text
    assert parse_session_id(parsed) == parsed
    assert 1 <= len(parsed) <= 128


@given(st.text(max_size=60), st.sampled_from(WHITESPACE), st.text(max_size=60))
def test_an_id_containing_whitespace_is_rejected(head: str, space: str, tail: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_session_id(head + space + tail)


@given(st.text(st.characters(codec="ascii", categories=["Cc"]), min_size=1), st.integers(0, 3))
def test_an_id_containing_control_characters_is_rejected(controls: str, at: int) -> None:
    base = "s-1234"
    with pytest.raises(InvalidArgument):
        parse_session_id(base[:at] + controls + base[at:])


# -- framing and the one source --------------------------------------------------------------


@pytest.mark.contract(5)
def test_an_agent_message_is_framed_exactly() -> None:
    source = AgentMessageSource(sender_session_id=SessionId("s-7"))
    assert frame_agent_message(source, "result: 42") == "Agent s-7 sent a message:\nresult: 42"
    assert frame_agent_message(source, "two\nlines") == "Agent s-7 sent a message:\ntwo\nlines"


@pytest.mark.contract(5)
def test_the_agent_message_source_is_a_relay_attributed_to_its_sender() -> None:
    source = AgentMessageSource(sender_session_id=SessionId("s-7"))
    assert source.kind == "agent-message"
    assert source.form == "relay"
    assert source.sender_session_id == "s-7"


@pytest.mark.contract(5)
def test_a_rendered_agent_message_carries_the_frame() -> None:
    source = AgentMessageSource(sender_session_id=SessionId("s-7"))
    records = [
        Record(seq=1, entry=AgentMessageEntry(source=source, content="hello")),
        Record(seq=2, entry=ConsumedEntry(seqs=(1,))),
    ]
    assert render(records) == (
        ChatMessage(role=Role.USER, content="Agent s-7 sent a message:\nhello"),
    )


# -- pending inbound and rendering -----------------------------------------------------------

CALL = ToolCall(call_id="call-1", name="probe", arguments_json="{}")
PARENT_SOURCE = AgentMessageSource(sender_session_id=ROOT)


def mid_step_transcript() -> list[Record]:
    """One turn: the task, a step with a tool call, a message accepted while that call ran, the
    call's result, then the step boundary that consumed the message, then a final step."""
    entries: list[Entry] = [
        TaskEntry(content="Do the task."),  # 1
        TurnStartedEntry(turn_id=TurnId("t-1")),  # 2
        ConsumedEntry(seqs=(1,)),  # 3
        AssistantStepEntry(text="probing", tool_calls=(CALL,), usage=Usage()),  # 4
        AgentMessageEntry(source=PARENT_SOURCE, content="also check X"),  # 5: mid-step
        ToolResultEntry(call_id="call-1", name="probe", content="probe ok"),  # 6
        ConsumedEntry(seqs=(5,)),  # 7: the step boundary
        AssistantStepEntry(text="done", tool_calls=(), usage=Usage()),  # 8
        TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.COMPLETED),  # 9
    ]
    return [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]


@pytest.mark.contract(9)
def test_a_message_accepted_mid_step_renders_after_that_steps_tool_result() -> None:
    messages = render(mid_step_transcript())
    assert messages == (
        ChatMessage(role=Role.USER, content="Do the task."),
        ChatMessage(role=Role.ASSISTANT, content="probing", tool_calls=(CALL,)),
        ChatMessage(role=Role.TOOL, content="probe ok", tool_call_id="call-1"),
        ChatMessage(role=Role.USER, content=f"Agent {ROOT} sent a message:\nalso check X"),
        ChatMessage(role=Role.ASSISTANT, content="done"),
    )


@pytest.mark.contract(9)
def test_an_accepted_but_unconsumed_message_is_pending_and_not_rendered() -> None:
    records = mid_step_transcript()[:6]  # accepted at 5, the boundary (7) not yet written
    assert [r.seq for r in pending_inbound(records)] == [5]
    rendered = render(records)
    assert all("also check X" not in m.content for m in rendered)
    assert rendered[-1] == ChatMessage(role=Role.TOOL, content="probe ok", tool_call_id="call-1")
    assert pending_inbound(mid_step_transcript()) == []


@pytest.mark.contract(9)
def test_pending_inbound_keeps_acceptance_order_and_every_inbound_kind() -> None:
    notice = SettlementNoticeEntry(
        child_session=CHILD,
        child_activation=ActivationId("a-9"),
        child_kind=SessionKind.CONTINUABLE_CHILD,
        outcome=SettlementOutcome.COMPLETED,
        terminal_output="out",
    )
    entries: list[Entry] = [
        TaskEntry(content="task"),  # 1
        ConsumedEntry(seqs=(1,)),  # 2
        AgentMessageEntry(source=PARENT_SOURCE, content="first"),  # 3
        HumanPromptEntry(content="human"),  # 4
        notice,  # 5
        AgentMessageEntry(source=PARENT_SOURCE, content="second"),  # 6
        ConsumedEntry(seqs=(5,)),  # 7
    ]
    records = [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]
    assert [r.seq for r in pending_inbound(records)] == [3, 4, 6]
    assert [r.seq for r in pending_inbound(records[:2])] == []


@pytest.mark.contract(9)
def test_inbound_renders_in_the_order_its_boundary_consumed_it() -> None:
    entries: list[Entry] = [
        AgentMessageEntry(source=PARENT_SOURCE, content="one"),  # 1
        AgentMessageEntry(source=PARENT_SOURCE, content="two"),  # 2
        ConsumedEntry(seqs=(1, 2)),  # 3
    ]
    records = [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]
    assert [m.content.splitlines()[-1] for m in render(records)] == ["one", "two"]


@pytest.mark.contract(7)
def test_rendering_a_prefix_of_records_yields_a_prefix_of_the_rendering() -> None:
    records = mid_step_transcript()
    full = render(records)
    lengths = []
    for cut in range(len(records) + 1):
        partial = render(records[:cut])
        assert partial == full[: len(partial)], cut
        lengths.append(len(partial))
    assert lengths == sorted(lengths)
    assert lengths[-1] == len(full) == 5


# -- trace context: observability only --------------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def notice(trace: str = "") -> SettlementNoticeEntry:
    return SettlementNoticeEntry(
        child_session=CHILD,
        child_activation=ActivationId("a-9"),
        child_kind=SessionKind.CONTINUABLE_CHILD,
        outcome=SettlementOutcome.COMPLETED,
        terminal_output="out",
        trace=trace,
    )


def test_entries_carry_no_trace_by_default_and_accept_a_traceparent() -> None:
    assert AgentMessageEntry(source=PARENT_SOURCE, content="x").trace == ""
    assert notice().trace == ""
    assert AgentMessageEntry(source=PARENT_SOURCE, content="x", trace=TRACEPARENT).trace
    assert notice(TRACEPARENT).trace == TRACEPARENT


@pytest.mark.parametrize(
    "trace",
    [
        " ",
        "traceparent",
        TRACEPARENT.upper(),
        TRACEPARENT + " ",
        "ff" + TRACEPARENT[2:],
        "00-" + "0" * 32 + TRACEPARENT[35:],
        TRACEPARENT[:36] + "0" * 16 + "-01",
    ],
)
def test_a_malformed_trace_is_invalid(trace: str) -> None:
    with pytest.raises(InvalidArgument):
        AgentMessageEntry(source=PARENT_SOURCE, content="x", trace=trace)
    with pytest.raises(InvalidArgument):
        notice(trace)


def test_a_trace_changes_neither_rendering_nor_pending_inbound() -> None:
    def transcript(trace: str) -> list[Record]:
        entries: list[Entry] = [
            AgentMessageEntry(source=PARENT_SOURCE, content="one", trace=trace),  # 1
            notice(trace),  # 2
            ConsumedEntry(seqs=(1, 2)),  # 3
            AgentMessageEntry(source=PARENT_SOURCE, content="two", trace=trace),  # 4
        ]
        return [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]

    traced, untraced = transcript(TRACEPARENT), transcript("")
    assert render(traced) == render(untraced)
    assert all(TRACEPARENT not in m.content for m in render(traced))
    assert [r.seq for r in pending_inbound(traced)] == [r.seq for r in pending_inbound(untraced)]


# -- delivery kind: observability only --------------------------------------------------------


def test_an_agent_message_records_no_delivery_kind_by_default() -> None:
    assert AgentMessageEntry(source=PARENT_SOURCE, content="x").delivery is None
    for kind in DeliveryKind:
        assert AgentMessageEntry(source=PARENT_SOURCE, content="x", delivery=kind).delivery is kind


@pytest.mark.parametrize("kind", list(DeliveryKind))
def test_a_delivery_kind_changes_neither_rendering_nor_pending_inbound(kind: DeliveryKind) -> None:
    def transcript(delivery: DeliveryKind | None) -> list[Record]:
        entries: list[Entry] = [
            AgentMessageEntry(source=PARENT_SOURCE, content="one", delivery=delivery),  # 1
            ConsumedEntry(seqs=(1,)),  # 2
            AgentMessageEntry(source=PARENT_SOURCE, content="two", delivery=delivery),  # 3
        ]
        return [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]

    recorded, unrecorded = transcript(kind), transcript(None)
    assert render(recorded) == render(unrecorded)
    assert all(kind.value not in m.content for m in render(recorded))
    assert [r.seq for r in pending_inbound(recorded)] == [
        r.seq for r in pending_inbound(unrecorded)
    ]


@pytest.mark.parametrize(
    ("from_seq", "through_seq", "pending"),
    [(0, 3, ()), (4, 3, ()), (1, 3, (4,)), (1, 3, (0,))],
)
def test_a_compaction_covers_a_range_and_keeps_only_seqs_within_it(
    from_seq: int, through_seq: int, pending: tuple[int, ...]
) -> None:
    with pytest.raises(InvalidArgument):
        CompactionEntry(summary="s", from_seq=from_seq, through_seq=through_seq, pending=pending)
