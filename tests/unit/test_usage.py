"""A session's usage summary: sums over its model calls, cache shares, its first call."""

from __future__ import annotations

import pytest

from dsh_mesh.core import (
    AgentMessageEntry,
    AgentMessageSource,
    AssistantStepEntry,
    ChatMessage,
    CompactionEntry,
    ConsumedEntry,
    Entry,
    ForkPrefixEntry,
    Role,
    SessionId,
    SessionUsage,
    TaskEntry,
    ToolCall,
    ToolResultEntry,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    Usage,
    session_usage,
)


def step(input_tokens: int, output_tokens: int, cached: int = 0) -> AssistantStepEntry:
    return AssistantStepEntry(
        text="",
        tool_calls=(ToolCall(call_id="c", name="send_message", arguments_json="{}"),),
        usage=Usage(
            input_tokens=input_tokens, output_tokens=output_tokens, cached_input_tokens=cached
        ),
    )


def test_sums_every_call_and_keeps_the_first() -> None:
    usage = session_usage([step(1000, 20, 900), step(1200, 30, 1000), step(34, 6, 0)])
    assert usage == SessionUsage(
        model_calls=3,
        input_tokens=2234,
        output_tokens=56,
        cached_input_tokens=1900,
        first_call=Usage(input_tokens=1000, output_tokens=20, cached_input_tokens=900),
    )
    assert usage.cache_share == pytest.approx(1900 / 2234)
    assert usage.first_call_cache_share == pytest.approx(0.9)


def test_entries_other_than_steps_are_ignored() -> None:
    sender = SessionId("s-parent")
    entries: list[Entry] = [
        ForkPrefixEntry(messages=(ChatMessage(role=Role.USER, content="inherited"),)),
        TaskEntry(content="Do it."),
        TurnStartedEntry(turn_id=TurnId("t-1")),
        ConsumedEntry(seqs=(2,)),
        step(500, 8, 480),
        ToolResultEntry(call_id="c", name="send_message", content="ok"),
        AgentMessageEntry(source=AgentMessageSource(sender_session_id=sender), content="more"),
        step(600, 8, 0),
        TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.COMPLETED),
    ]
    usage = session_usage(entries)
    assert (usage.model_calls, usage.input_tokens, usage.output_tokens) == (2, 1100, 16)
    assert usage.cached_input_tokens == 480
    # The first call is the first step, not the inherited prefix before it.
    assert usage.first_call == Usage(input_tokens=500, output_tokens=8, cached_input_tokens=480)
    assert usage.first_call_cache_share == pytest.approx(0.96)


def test_a_compactions_summary_call_is_a_model_call() -> None:
    compaction = CompactionEntry(
        summary="s", from_seq=1, through_seq=4, usage=Usage(input_tokens=3000, output_tokens=200)
    )
    usage = session_usage([step(500, 8, 480), compaction, step(600, 8, 500)])
    assert (usage.model_calls, usage.input_tokens, usage.output_tokens) == (3, 4100, 216)
    assert usage.cached_input_tokens == 980


def test_no_calls() -> None:
    usage = session_usage([TaskEntry(content="Waiting.")])
    assert usage == SessionUsage()
    assert usage.model_calls == 0
    assert usage.first_call is None
    assert usage.cache_share == 0.0
    assert usage.first_call_cache_share is None
    assert session_usage([]) == SessionUsage()


def test_calls_that_report_no_input_have_a_zero_share() -> None:
    usage = session_usage([step(0, 0), step(0, 5)])
    assert usage.model_calls == 2
    assert usage.output_tokens == 5
    assert usage.cache_share == 0.0
    assert usage.first_call_cache_share == 0.0  # a call with no input: 0.0, not None


def test_a_transcript_summed_in_chunks_equals_one_sum() -> None:
    entries: list[Entry] = [TaskEntry(content="x"), step(10, 8, 2), step(20, 8, 15), step(5, 8)]
    whole = session_usage(entries)
    for cut in range(len(entries) + 1):
        parts = session_usage(entries[:cut]).followed_by(session_usage(entries[cut:]))
        assert parts == whole, cut
    assert whole.first_call == Usage(input_tokens=10, output_tokens=8, cached_input_tokens=2)
    # The earlier part's first call wins; an empty earlier part leaves the later one's.
    later = session_usage([step(7, 1, 7)])
    assert SessionUsage().followed_by(later).first_call == later.first_call
    assert whole.followed_by(later).first_call == whole.first_call


def test_session_usage_is_frozen() -> None:
    usage = session_usage([step(1, 1)])
    with pytest.raises(AttributeError):
        usage.model_calls = 5  # type: ignore[misc]


def test_the_demo_shows_the_first_call_share_of_a_fork_child() -> None:
    usage = session_usage([step(2000, 8, 1940), step(2100, 8, 2000)])
    plain = "2 model calls: 4,100 input (3,940 cached, 96%), 16 output"
    assert usage.describe(first_call=False) == plain
    assert usage.describe() == f"{plain}; first call 97% cached"
    assert SessionUsage().describe() == "no model calls"
