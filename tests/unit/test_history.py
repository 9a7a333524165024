"""The history checker finds each kind of violation, and passes a clean run.

Each test builds the durable transcripts and node histories of a tiny run by hand, clean, then
breaks exactly one promise and checks that the checker counts exactly that one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dsh_mesh.core import (
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    Entry,
    HumanPromptEntry,
    Record,
    RejectionReason,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolCall,
    ToolResultEntry,
    Usage,
)
from dsh_mesh.runtime import HistoryLog
from dsh_mesh.testing import (
    HUMAN,
    NodeHistory,
    Outcome,
    Send,
    Verdict,
    WriteEvent,
    agent_sends,
    blind_resends,
    calls_without_one_answer,
    check,
    compaction_violations,
    load_node_history,
    writers_of,
)
from dsh_mesh.testing._edges import (
    EDGE_MAX_OUTPUT,
    EDGE_TOOL,
    HUGE_TEXT,
    MCP_DIE,
    MCP_ECHO,
    MCP_HUGE,
    MCP_MAX_OUTPUT,
    PLAIN_TEXT,
    StoredEntry,
)
from dsh_mesh.testing.probe_tools import GARBLED_TEXT, ProbeRun
from dsh_mesh.tools import ToolOutput, cut

ROOT = SessionId("root")
CHILD = SessionId("child")
A1 = ActivationId("child-a1")
R1 = ActivationId("root-a1")


def records(*entries: Entry) -> list[Record]:
    return [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]


def step(*calls: tuple[str, str, str]) -> AssistantStepEntry:
    """An assistant step calling send_message for each (call id, target, message)."""
    return AssistantStepEntry(
        text="",
        tool_calls=tuple(
            ToolCall(
                call_id=call_id,
                name="send_message",
                arguments_json=json.dumps({"agent_id": target, "message": message}),
            )
            for call_id, target, message in calls
        ),
        usage=Usage(),
    )


def delivered(call_id: str, target: str) -> ToolResultEntry:
    return ToolResultEntry(
        call_id=call_id,
        name="send_message",
        content=json.dumps({"delivered": "steer-running", "agent_id": target}),
    )


def refused(call_id: str, reason: RejectionReason) -> ToolResultEntry:
    return ToolResultEntry(
        call_id=call_id,
        name="send_message",
        content=json.dumps({"rejected": reason.value, "detail": "no"}),
        is_error=True,
    )


def from_child(content: str) -> AgentMessageEntry:
    return AgentMessageEntry(source=AgentMessageSource(sender_session_id=CHILD), content=content)


def notice(activation: ActivationId = A1) -> SettlementNoticeEntry:
    return SettlementNoticeEntry(
        child_session=CHILD,
        child_activation=activation,
        child_kind=SessionKind.CONTINUABLE_CHILD,
        outcome=SettlementOutcome.COMPLETED,
        terminal_output="done",
    )


def child_transcript(*results: Entry) -> list[Record]:
    """The child: a task, one step sending m1 and m2 to the root, their results."""
    return records(
        TaskEntry(content="work"),
        ConsumedEntry(seqs=(1,)),
        step(("c1", ROOT, "m1"), ("c2", ROOT, "m2")),
        *results,
    )


CLEAN_CHILD = child_transcript(delivered("c1", ROOT), delivered("c2", ROOT))


def root_transcript(*entries: Entry) -> list[Record]:
    return records(HumanPromptEntry(content="go"), ConsumedEntry(seqs=(1,)), *entries)


CLEAN_ROOT = root_transcript(
    from_child("m1"), from_child("m2"), notice(), ConsumedEntry(seqs=(3, 4, 5))
)
PROMPT = Send(sender=HUMAN, target=ROOT, content="go", outcome=Outcome.ACKED)


def history_of(transcripts: dict[SessionId, list[Record]], **writers: str | None) -> NodeHistory:
    """Every write reported, fenced on ``writers[session]`` (one activation per session)."""
    return NodeHistory(
        writes=tuple(
            WriteEvent(
                node="node-a",
                time=0.0,
                session=session,
                seq=r.seq,
                writer=writers[session],
                entry=type(r.entry).__name__,
            )
            for session, rs in transcripts.items()
            for r in rs
        )
    )


def judge(
    root: list[Record], child: list[Record], *extra: Send, history: NodeHistory | None = None
) -> Verdict:
    transcripts = {ROOT: root, CHILD: child}
    history = history or history_of(transcripts, root=R1, child=A1)
    sends = [PROMPT, *agent_sends(transcripts, writers_of(history)), *extra]
    return check(sends, transcripts, history)


def only(verdict: Verdict, kind: str) -> None:
    counts = {
        name: getattr(verdict, name)
        for name in (
            "lost",
            "duplicated",
            "order_violations",
            "notice_violations",
            "overlapping_activations",
            "wrong_reasons",
            "phantoms",
            "unanswered_calls",
            "untrue_boundaries",
            "untrue_compactions",
            "blind_resends",
        )
    }
    assert counts[kind] >= 1, verdict.summary()
    assert all(count == 0 for name, count in counts.items() if name != kind), verdict.summary()


def test_a_clean_run_checks_clean_with_its_figures() -> None:
    verdict = judge(CLEAN_ROOT, CLEAN_CHILD)
    assert verdict.clean, verdict.summary()
    assert (verdict.operations, verdict.acked, verdict.rejected, verdict.unknown) == (3, 3, 0, 0)
    assert verdict.delivered == 5  # root: prompt, m1, m2, notice; child: task
    assert "CLEAN" in verdict.summary(faults={"kill": 2}, failovers=[1.5, 2.0], ttl=2.0)


def test_an_acknowledged_message_missing_from_its_target_is_lost() -> None:
    root = root_transcript(from_child("m1"), notice(), ConsumedEntry(seqs=(3, 4)))
    only(judge(root, CLEAN_CHILD), "lost")


def test_an_acknowledged_message_never_consumed_is_lost() -> None:
    root = root_transcript(from_child("m1"), from_child("m2"), notice(), ConsumedEntry(seqs=(3, 5)))
    verdict = judge(root, CLEAN_CHILD)
    # The boundary that skipped m2 is also untrue; nothing else is counted.
    assert verdict.lost == 1 and verdict.untrue_boundaries == 1, verdict.summary()
    assert len(verdict.violations) == 2, verdict.summary()


def test_a_second_copy_of_a_message_is_a_duplicate() -> None:
    root = root_transcript(
        from_child("m1"),
        from_child("m1"),
        from_child("m2"),
        notice(),
        ConsumedEntry(seqs=(3, 4, 5, 6)),
    )
    only(judge(root, CLEAN_CHILD), "duplicated")


def test_an_entry_consumed_into_two_steps_is_a_duplicate() -> None:
    root = root_transcript(
        from_child("m1"),
        from_child("m2"),
        notice(),
        ConsumedEntry(seqs=(3, 4, 5)),
        ConsumedEntry(seqs=(4,)),
    )
    only(judge(root, CLEAN_CHILD), "duplicated")


def test_two_notices_for_one_activation_are_a_duplicate() -> None:
    root = root_transcript(
        from_child("m1"), from_child("m2"), notice(), notice(), ConsumedEntry(seqs=(3, 4, 5, 6))
    )
    only(judge(root, CLEAN_CHILD), "duplicated")


def test_a_message_in_doubt_may_land_once_or_not_at_all_but_never_twice() -> None:
    unanswered = child_transcript(delivered("c1", ROOT))  # c2's result was never recorded
    assert judge(CLEAN_ROOT, unanswered).clean
    without_m2 = root_transcript(from_child("m1"), notice(), ConsumedEntry(seqs=(3, 4)))
    assert judge(without_m2, unanswered).clean
    twice = root_transcript(
        from_child("m1"),
        from_child("m2"),
        from_child("m2"),
        notice(),
        ConsumedEntry(seqs=(3, 4, 5, 6)),
    )
    only(judge(twice, unanswered), "duplicated")


def test_messages_landing_out_of_send_order_are_an_order_violation() -> None:
    root = root_transcript(
        from_child("m2"), from_child("m1"), notice(), ConsumedEntry(seqs=(3, 4, 5))
    )
    only(judge(root, CLEAN_CHILD), "order_violations")


def test_a_notice_before_its_activations_message_is_a_notice_violation() -> None:
    root = root_transcript(
        from_child("m1"), notice(), from_child("m2"), ConsumedEntry(seqs=(3, 4, 5))
    )
    only(judge(root, CLEAN_CHILD), "notice_violations")


def test_a_notice_of_a_later_activation_is_not_held_to_an_earlier_ones_messages() -> None:
    root = root_transcript(
        from_child("m1"),
        notice(ActivationId("child-a0")),
        from_child("m2"),
        ConsumedEntry(seqs=(3, 4, 5)),
    )
    assert judge(root, CLEAN_CHILD).clean


def test_interleaved_writes_of_two_activations_are_overlapping() -> None:
    transcripts = {ROOT: CLEAN_ROOT, CHILD: CLEAN_CHILD}
    clean = history_of(transcripts, root=R1, child=A1)
    writes = [
        w
        if not (w.session == CHILD and w.seq == 2)
        else WriteEvent(**{**w.__dict__, "writer": "child-a2"})
        for w in clean.writes
    ]
    only(
        judge(CLEAN_ROOT, CLEAN_CHILD, history=NodeHistory(writes=tuple(writes))),
        "overlapping_activations",
    )


def test_activations_taking_turns_are_not_overlapping() -> None:
    transcripts = {ROOT: CLEAN_ROOT, CHILD: CLEAN_CHILD}
    clean = history_of(transcripts, root=R1, child=A1)
    writes = [
        w
        if not (w.session == CHILD and w.seq >= 3)
        else WriteEvent(**{**w.__dict__, "writer": "child-a2"})
        for w in clean.writes
    ]
    assert judge(CLEAN_ROOT, CLEAN_CHILD, history=NodeHistory(writes=tuple(writes))).clean


def test_one_seq_reported_by_two_activations_is_overlapping() -> None:
    transcripts = {ROOT: CLEAN_ROOT, CHILD: CLEAN_CHILD}
    clean = history_of(transcripts, root=R1, child=A1)
    twice = WriteEvent(
        node="node-b", time=0.0, session=CHILD, seq=4, writer="child-a2", entry="ToolResultEntry"
    )
    history = NodeHistory(writes=(*clean.writes, twice))
    only(judge(CLEAN_ROOT, CLEAN_CHILD, history=history), "overlapping_activations")


def test_a_write_reported_durable_but_missing_is_lost() -> None:
    transcripts = {ROOT: CLEAN_ROOT, CHILD: CLEAN_CHILD}
    clean = history_of(transcripts, root=R1, child=A1)
    ghost = WriteEvent(
        node="node-a", time=0.0, session=ROOT, seq=99, writer=R1, entry="AgentMessageEntry"
    )
    only(judge(CLEAN_ROOT, CLEAN_CHILD, history=NodeHistory(writes=(*clean.writes, ghost))), "lost")


def test_a_write_no_node_reported_is_counted_not_held_against_the_run() -> None:
    transcripts = {ROOT: CLEAN_ROOT, CHILD: CLEAN_CHILD}
    clean = history_of(transcripts, root=R1, child=A1)
    history = NodeHistory(writes=tuple(w for w in clean.writes if (w.session, w.seq) != (ROOT, 3)))
    verdict = judge(CLEAN_ROOT, CLEAN_CHILD, history=history)
    assert verdict.clean and verdict.unattributed_writes == 1


def test_a_refusal_with_a_reason_the_request_could_not_earn_is_wrong() -> None:
    child = child_transcript(delivered("c1", ROOT), refused("c2", RejectionReason.SIBLING_TARGET))
    root = root_transcript(from_child("m1"), notice(), ConsumedEntry(seqs=(3, 4)))
    only(judge(root, child), "wrong_reasons")


def test_a_refusal_with_an_allowed_reason_is_fine() -> None:
    probe = Send(
        sender=CHILD,
        target=SessionId("sibling"),
        content="hi",
        outcome=Outcome.REJECTED,
        reason=RejectionReason.SIBLING_TARGET,
        allowed=frozenset({RejectionReason.SIBLING_TARGET}),
    )
    assert judge(CLEAN_ROOT, CLEAN_CHILD, probe).clean


def test_a_message_no_one_sent_is_a_phantom() -> None:
    root = root_transcript(
        from_child("m1"),
        from_child("m2"),
        from_child("forged"),
        notice(),
        ConsumedEntry(seqs=(3, 4, 5, 6)),
    )
    only(judge(root, CLEAN_CHILD), "phantoms")


def test_node_history_files_are_read_back_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "node-a.jsonl"
    with HistoryLog(path, node="node-a") as log:
        log.event("activated", session="s", activation="a1")
        log.event("wrote", session="s", seq=1, writer="a1", entry="TaskEntry")
        log.event("fenced", session="s", writer="a0")
    with path.open("a") as handle:
        handle.write('{"op": "wrote", "session"')  # killed mid-line
    history = load_node_history([path, tmp_path / "never-written.jsonl"])
    assert history.activations == 1 and history.fenced_writes == 1
    assert [(w.session, w.seq, w.writer, w.node) for w in history.writes] == [
        ("s", 1, "a1", "node-a")
    ]


def test_two_prompts_in_flight_at_once_may_land_either_way_but_not_after_an_answer() -> None:
    def prompt(content: str, sent: float, answered: float) -> Send:
        return Send(
            sender=HUMAN,
            target=ROOT,
            content=content,
            outcome=Outcome.ACKED,
            position=sent,
            done=answered,
        )

    root = root_transcript(
        HumanPromptEntry(content="b"),
        HumanPromptEntry(content="a"),
        ConsumedEntry(seqs=(3, 4)),
        from_child("m1"),
        from_child("m2"),
        notice(),
        ConsumedEntry(seqs=(6, 7, 8)),
    )
    overlapping = (prompt("a", 1.0, 3.0), prompt("b", 2.0, 4.0))
    assert judge(root, CLEAN_CHILD, *overlapping).clean
    one_after_the_other = (prompt("a", 1.0, 1.5), prompt("b", 2.0, 4.0))
    only(judge(root, CLEAN_CHILD, *one_after_the_other), "order_violations")


def test_an_outage_refusal_that_may_have_landed_is_in_doubt_not_a_refusal() -> None:
    # Found by the fault runs: a write whose answer etcd lost was refused as
    # REGISTRY_UNAVAILABLE, yet it had landed; the tool now says so, and the checker reads it.
    landed = ToolResultEntry(
        call_id="c2",
        name="send_message",
        content=json.dumps(
            {"rejected": "REGISTRY_UNAVAILABLE", "detail": "etcd away", "may_have_landed": True}
        ),
        is_error=True,
    )
    child = child_transcript(delivered("c1", ROOT), landed)
    verdict = judge(CLEAN_ROOT, child)
    assert verdict.clean and verdict.unknown == 1, verdict.summary()
    # A plain refusal with that reason would have claimed that nothing was stored.
    refused_plainly = child_transcript(
        delivered("c1", ROOT), refused("c2", RejectionReason.REGISTRY_UNAVAILABLE)
    )
    assert judge(CLEAN_ROOT, refused_plainly).duplicated == 1


def test_a_call_left_without_a_result_once_the_session_went_on_is_unanswered() -> None:
    # The host died after the step; the next activation went on without answering c2.
    child = child_transcript(delivered("c1", ROOT), ConsumedEntry(seqs=()), step())
    verdict = judge(CLEAN_ROOT, child)
    assert verdict.unanswered_calls == 1 and "c2" in verdict.summary(), verdict.summary()


def test_a_call_with_two_results_is_unanswered_exactly_once() -> None:
    child = child_transcript(delivered("c1", ROOT), delivered("c2", ROOT), delivered("c2", ROOT))
    assert judge(CLEAN_ROOT, child).unanswered_calls == 1


def test_the_last_steps_open_calls_of_a_session_stopped_mid_step_are_not_held_against_it() -> None:
    # Only inbound entries follow the open step: nothing ran since; the next activation answers.
    child = child_transcript(delivered("c1", ROOT), TaskEntry(content="more"))
    assert calls_without_one_answer(child) == []


def test_a_message_sent_again_before_the_first_result_and_stored_twice_is_a_blind_resend() -> None:
    # m1's first call was never answered (its host died); the model sent m1 again blind.
    child = records(
        TaskEntry(content="work"),
        ConsumedEntry(seqs=(1,)),
        step(("c1", ROOT, "m1")),
        ConsumedEntry(seqs=()),
        step(("c2", ROOT, "m1"), ("c3", ROOT, "m2")),
        delivered("c2", ROOT),
        delivered("c3", ROOT),
    )
    root = root_transcript(
        from_child("m1"),
        from_child("m1"),
        from_child("m2"),
        notice(),
        ConsumedEntry(seqs=(3, 4, 5, 6)),
    )
    assert len(blind_resends({ROOT: root, CHILD: child})) == 1
    # The same two copies after the model saw the first result are the model's own choice.
    seen = records(
        TaskEntry(content="work"),
        ConsumedEntry(seqs=(1,)),
        step(("c1", ROOT, "m1")),
        delivered("c1", ROOT),
        step(("c2", ROOT, "m1"), ("c3", ROOT, "m2")),
        delivered("c2", ROOT),
        delivered("c3", ROOT),
    )
    assert blind_resends({ROOT: root, CHILD: seen}) == []


def test_a_boundary_that_leaves_a_message_durable_before_it_unread_is_untrue() -> None:
    root = root_transcript(
        from_child("m1"),
        from_child("m2"),
        ConsumedEntry(seqs=(4,)),
        notice(),
        ConsumedEntry(seqs=(3, 6)),
    )
    only(judge(root, CLEAN_CHILD), "untrue_boundaries")


def test_a_boundary_that_reads_out_of_seq_order_is_untrue() -> None:
    root = root_transcript(
        from_child("m1"), from_child("m2"), notice(), ConsumedEntry(seqs=(4, 3, 5))
    )
    only(judge(root, CLEAN_CHILD), "untrue_boundaries")


# -- probe tool executions -----------------------------------------------------------------------


def probe_transcript() -> list[Record]:
    """One step (seq 1) calling both probes; each answered as done."""
    return records(
        AssistantStepEntry(
            text="",
            tool_calls=(
                ToolCall(call_id="u", name="probe_unsafe", arguments_json="{}"),
                ToolCall(call_id="s", name="probe_safe", arguments_json="{}"),
            ),
            usage=Usage(),
        ),
        ToolResultEntry(call_id="u", name="probe_unsafe", content="ran"),
        ToolResultEntry(call_id="s", name="probe_safe", content="ran"),
    )


def run(tool: str, key: str, pid: int = 1) -> ProbeRun:
    return ProbeRun(tool=tool, session=CHILD, key=key, pid=pid)


def test_probe_runs_once_each_are_clean_and_a_safe_rerun_is_counted_not_held() -> None:
    verdict = check(
        [],
        {CHILD: probe_transcript()},
        NodeHistory(),
        [run("probe_unsafe", "1.0.u"), run("probe_safe", "1.1.s"), run("probe_safe", "1.1.s", 2)],
    )
    assert verdict.clean, verdict.violations
    assert verdict.tool_runs == 3 and verdict.safe_reruns == 1


def test_an_unsafe_probe_run_twice_is_a_violation() -> None:
    verdict = check(
        [],
        {CHILD: probe_transcript()},
        NodeHistory(),
        [run("probe_unsafe", "1.0.u"), run("probe_unsafe", "1.0.u", 2), run("probe_safe", "1.1.s")],
    )
    assert verdict.unsafe_duplicates == 1 and not verdict.clean


def test_a_run_without_a_recorded_call_and_a_result_without_a_run_are_violations() -> None:
    verdict = check(
        [],
        {CHILD: probe_transcript()},
        NodeHistory(),
        [run("probe_unsafe", "1.0.u"), run("probe_unsafe", "9.0.x")],
    )
    assert verdict.unrecorded_runs == 1
    assert verdict.untrue_results == 1  # the safe probe answered done, never ran
    assert "executions without a recorded call 1" in verdict.summary()


def compacted_child(compaction: CompactionEntry) -> list[Record]:
    """The clean child, compacted after its step's results (seq 5), then going on."""
    return child_transcript(
        delivered("c1", ROOT), delivered("c2", ROOT), compaction, TaskEntry(content="later")
    )


def test_a_compaction_that_keeps_what_the_contract_keeps_is_clean() -> None:
    kept = CompactionEntry(summary="sent m1, m2", from_seq=1, through_seq=5, task="work")
    verdict = judge(CLEAN_ROOT, compacted_child(kept))
    assert verdict.clean and verdict.compactions == 1, verdict.summary()


def test_a_compaction_that_summarised_away_a_call_without_its_result_is_untrue() -> None:
    # Its range ends after the step but before c2's result.
    early = CompactionEntry(summary="sent m1", from_seq=1, through_seq=4, task="work")
    child = child_transcript(delivered("c1", ROOT), early, delivered("c2", ROOT))
    assert compaction_violations(child) != []
    only(judge(CLEAN_ROOT, child), "untrue_compactions")


def test_a_compaction_that_summarised_away_an_unread_message_is_untrue() -> None:
    # A second task arrives (seq 6) and is unread when seq 6 is compacted without keeping it.
    child = child_transcript(
        delivered("c1", ROOT),
        delivered("c2", ROOT),
        TaskEntry(content="more"),
        CompactionEntry(summary="s", from_seq=1, through_seq=6, task="work"),
    )
    assert any("pending" in v for v in compaction_violations(child))
    kept = child_transcript(
        delivered("c1", ROOT),
        delivered("c2", ROOT),
        TaskEntry(content="more"),
        CompactionEntry(summary="s", from_seq=1, through_seq=6, task="work", pending=(6,)),
    )
    assert compaction_violations(kept) == []


def test_a_compaction_that_lost_the_task_or_skipped_a_range_is_untrue() -> None:
    lost_task = CompactionEntry(summary="s", from_seq=1, through_seq=5)
    assert any("task" in v for v in compaction_violations(compacted_child(lost_task)))
    skipped = CompactionEntry(summary="s", from_seq=3, through_seq=5, task="work")
    assert any("expected from 1" in v for v in compaction_violations(compacted_child(skipped)))


def test_a_compaction_that_summarised_a_read_no_step_showed_is_untrue() -> None:
    # The boundary at seq 7 read the second task, but the turn ended before a step showed it.
    child = child_transcript(
        delivered("c1", ROOT),
        delivered("c2", ROOT),
        TaskEntry(content="more"),
        ConsumedEntry(seqs=(6,)),
        CompactionEntry(summary="s", from_seq=1, through_seq=7, task="work", pending=(6,)),
    )
    assert any("no step showed" in v for v in compaction_violations(child))
    # Ending the range before that read, and keeping the task it read, is the true one.
    kept = child_transcript(
        delivered("c1", ROOT),
        delivered("c2", ROOT),
        TaskEntry(content="more"),
        ConsumedEntry(seqs=(6,)),
        CompactionEntry(summary="s", from_seq=1, through_seq=6, task="work", pending=(6,)),
    )
    assert compaction_violations(kept) == []


# -- the edge (issue 30): invalid text, huge outputs, an MCP server dying, nodes dying ----------


def edge_call(call_id: str, name: str, **arguments: object) -> ToolCall:
    return ToolCall(call_id=call_id, name=name, arguments_json=json.dumps(arguments))


def edge_transcript(*results: ToolResultEntry) -> list[Record]:
    """A leaf's step calling the edge tool three ways and the fault MCP server's three tools,
    then ``results``."""
    return records(
        TaskEntry(content="leaf"),
        ConsumedEntry(seqs=(1,)),
        AssistantStepEntry(
            text="",
            tool_calls=(
                edge_call("g", EDGE_TOOL, kind="garbled"),
                edge_call("h", EDGE_TOOL, kind="huge"),
                edge_call("p", EDGE_TOOL, kind="plain"),
                edge_call("e", MCP_ECHO, text="echo 1f2e"),
                edge_call("m", MCP_HUGE, size="large"),
                edge_call("d", MCP_DIE),
            ),
            usage=Usage(),
        ),
        *results,
    )


def mcp_cut(text: str) -> str:
    return text[:MCP_MAX_OUTPUT] + "\n[output cut: 520288 of 524288 characters cut]"


# What the mesh stores for each call: the lone surrogates replaced (the entry does it), the
# huge outputs cut at their limits with a note, the echo as it came, the death as an error.
TRUE_EDGE_RESULTS = (
    ToolResultEntry(call_id="g", name=EDGE_TOOL, content=GARBLED_TEXT),
    ToolResultEntry(
        call_id="h",
        name=EDGE_TOOL,
        content=cut(ToolOutput(content=HUGE_TEXT), EDGE_MAX_OUTPUT).content,
    ),
    ToolResultEntry(call_id="p", name=EDGE_TOOL, content=PLAIN_TEXT),
    ToolResultEntry(call_id="e", name=MCP_ECHO, content="echo 1f2e"),
    ToolResultEntry(call_id="m", name=MCP_HUGE, content=mcp_cut("m" * 524288)),
    ToolResultEntry(
        call_id="d",
        name=MCP_DIE,
        content="MCP server faults exited (3) during the call",
        is_error=True,
    ),
)


def test_edge_results_as_the_mesh_promises_are_clean_and_counted() -> None:
    transcript = edge_transcript(*TRUE_EDGE_RESULTS)
    assert "[dsh-mesh: 2 invalid characters were replaced with U+FFFD]" in str(transcript[3].entry)
    verdict = check([], {CHILD: transcript}, NodeHistory())
    assert verdict.clean, verdict.summary()
    edges = verdict.edges
    assert (edges.tool_calls, edges.replaced, edges.cut) == (6, 1, 2)
    assert (edges.mcp_calls, edges.mcp_errors) == (3, 1)
    assert "tool calls 6" in verdict.summary()


def test_edge_results_stored_other_than_promised_are_invalid_texts() -> None:
    wrong = (
        ToolResultEntry(call_id="g", name=EDGE_TOOL, content="caf\ufffd \ufffd end"),  # no note
        ToolResultEntry(call_id="h", name=EDGE_TOOL, content=HUGE_TEXT[:50_000]),  # not cut
        ToolResultEntry(call_id="p", name=EDGE_TOOL, content="something else"),
        ToolResultEntry(call_id="e", name=MCP_ECHO, content="echo 0000"),
        ToolResultEntry(call_id="m", name=MCP_HUGE, content="m" * 100_000),
        ToolResultEntry(call_id="d", name=MCP_DIE, content="done"),  # a dead server answered
    )
    for index, bad in enumerate(wrong):
        results = list(TRUE_EDGE_RESULTS)
        results[index] = bad
        verdict = check([], {CHILD: edge_transcript(*results)}, NodeHistory())
        assert verdict.invalid_texts == 1, (bad, verdict.summary())
        assert len(verdict.violations) == 1 and not verdict.clean
    # An error result (the call never ran, or its host died) is held to nothing but valid text.
    errors = [replace(r, content="not run: the turn ended", is_error=True) for r in wrong]
    assert check([], {CHILD: edge_transcript(*errors)}, NodeHistory()).clean


def test_stored_bytes_that_are_not_valid_utf8_or_hold_a_lone_surrogate_are_invalid_texts() -> None:
    good = StoredEntry(
        session="s", seq=1, data=json.dumps({"content": "caf\u00e9 \ufffd"}).encode()
    )
    escaped = StoredEntry(session="s", seq=2, data=b'{"content": "caf\\udce9"}')
    raw = StoredEntry(session="s", seq=3, data=b'{"content": "caf\xed\xb3\xa9"}')  # surrogatepass
    verdict = check([], {}, NodeHistory(), stored=[good, escaped, raw])
    assert verdict.invalid_texts == 2, verdict.summary()
    assert [v.split(":")[1].split()[:3] for v in verdict.violations] == [
        ["s", "seq", "2"],
        ["s", "seq", "3"],
    ]


def test_a_node_process_that_died_unbidden_is_a_violation() -> None:
    verdict = judge(CLEAN_ROOT, CLEAN_CHILD)
    assert verdict.unexpected_deaths == 0
    transcripts = {ROOT: CLEAN_ROOT, CHILD: CLEAN_CHILD}
    history = history_of(transcripts, root=R1, child=A1)
    sends = [PROMPT, *agent_sends(transcripts, writers_of(history))]
    deaths = ["node-b (pid 4242) exited with status 1: InsufficientPrivilegeError"]
    verdict = check(sends, transcripts, history, deaths=deaths)
    assert verdict.unexpected_deaths == 1 and not verdict.clean
    assert "node processes that died unbidden 1" in verdict.summary()
    assert "InsufficientPrivilegeError" in verdict.summary()
