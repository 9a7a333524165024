"""The history checker's liveness counts (issue 33, point 6), on hand-built end states.

A fault run stops every outside nudge, waits a stated bound after its faults, then reads the
mesh's end state: each transcript, each session's parent and which activation holds which
session. Each test builds a small tree that finished its round (every count 0), then breaks one
promise and checks that the count it breaks goes to 1.
"""

from __future__ import annotations

import dataclasses
import json

from dsh_mesh.core import (
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    ApprovalRequestEntry,
    AssistantStepEntry,
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
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    Usage,
)
from dsh_mesh.testing import HUMAN, EndState, NodeHistory, Outcome, Send, Verdict, agent_sends
from dsh_mesh.testing import check as check_history
from dsh_mesh.testing._liveness import unfinished_trees

ROOT = SessionId("root")
CHILD = SessionId("child")
R1 = ActivationId("root-a1")
A1 = ActivationId("child-a1")
A2 = ActivationId("child-a2")
PARENTS: dict[SessionId, SessionId | None] = {ROOT: None, CHILD: ROOT}
IDLE_ROOT = {ROOT: R1}
"""At the end an idle root still holds its activation; a settled child holds none."""


def records(*entries: Entry) -> list[Record]:
    return [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]


def started(activation: ActivationId, turn: str) -> TurnStartedEntry:
    return TurnStartedEntry(turn_id=TurnId(turn), activation_id=activation)


def ended(turn: str) -> TurnEndedEntry:
    return TurnEndedEntry(turn_id=TurnId(turn), outcome=TurnOutcome.COMPLETED)


def send_step(call_id: str, message: str) -> AssistantStepEntry:
    return AssistantStepEntry(
        text="",
        tool_calls=(
            ToolCall(
                call_id=call_id,
                name="send_message",
                arguments_json=json.dumps({"agent_id": ROOT, "message": message}),
            ),
        ),
        usage=Usage(),
    )


def reply() -> AssistantStepEntry:
    return AssistantStepEntry(text="Noted.", tool_calls=(), usage=Usage())


def delivered(call_id: str) -> ToolResultEntry:
    return ToolResultEntry(
        call_id=call_id,
        name="send_message",
        content=json.dumps({"delivered": "steer-running", "agent_id": ROOT}),
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


def child_turn(activation: ActivationId, turn: str, *middle: Entry) -> tuple[Entry, ...]:
    """One whole turn of the child: started by ``activation``, ``middle``, ended."""
    return (started(activation, turn), *middle, ended(turn))


CHILD_SENDS_M1 = (ConsumedEntry(seqs=(1,)), send_step("c1", "m1"), delivered("c1"))
GOOD_CHILD = records(TaskEntry(content="work"), *child_turn(A1, "t1", *CHILD_SENDS_M1))
"""The child: its task read, m1 sent to the root, its turn ended (seqs 1..6)."""


def root_with(*after: Entry) -> list[Record]:
    """The root: a prompt read in a turn of its own (seqs 1..5), then ``after``."""
    return records(
        HumanPromptEntry(content="go"),
        started(R1, "r1"),
        ConsumedEntry(seqs=(1,)),
        reply(),
        ended("r1"),
        *after,
    )


def root_reads(*inbound: Entry) -> list[Record]:
    """The root with ``inbound`` arrived (from seq 6) and read in one more turn."""
    first = 6
    return root_with(
        *inbound,
        started(R1, "r2"),
        ConsumedEntry(seqs=tuple(range(first, first + len(inbound)))),
        reply(),
        ended("r2"),
    )


GOOD_ROOT = root_reads(from_child("m1"), notice())


def judge(
    root: list[Record],
    child: list[Record],
    *,
    held: dict[SessionId, ActivationId] | None = None,
) -> Verdict:
    transcripts = {ROOT: root, CHILD: child}
    prompt = Send(sender=HUMAN, target=ROOT, content="go", outcome=Outcome.ACKED)
    sends = [prompt, *agent_sends(transcripts, allowed=frozenset(RejectionReason))]
    end = EndState(parents=PARENTS, held=IDLE_ROOT if held is None else held, bound=6.5)
    return check_history(sends, transcripts, NodeHistory(), end=end)


LIVENESS = ("unnoticed_activations", "stalled_trees", "unread_sessions", "rebound_replies_lost")


def counts(verdict: Verdict) -> dict[str, int]:
    return {name: getattr(verdict, name) for name in LIVENESS}


def test_a_tree_that_finished_its_round_counts_zero_on_every_liveness_check() -> None:
    verdict = judge(GOOD_ROOT, GOOD_CHILD)
    assert counts(verdict) == dict.fromkeys(LIVENESS, 0), verdict.summary()
    assert verdict.clean, verdict.summary()
    summary = verdict.summary()
    assert "within 6.5 s of the faults' end" in summary
    assert "activations without exactly one notice 0" in summary
    assert "stalled trees 0" in summary
    assert "sessions left with unread entries 0" in summary
    assert "replies refused PARENT_REBOUND that never landed 0" in summary


def test_a_child_activation_that_ran_a_turn_and_got_no_notice_is_counted() -> None:
    root = root_reads(from_child("m1"))
    verdict = judge(root, GOOD_CHILD)
    assert verdict.unnoticed_activations == 1, verdict.summary()
    assert not verdict.clean
    assert any("child-a1" in v for v in verdict.violations), verdict.summary()


def test_a_child_activation_with_two_notices_is_counted() -> None:
    root = root_reads(from_child("m1"), notice(), notice())
    assert judge(root, GOOD_CHILD).unnoticed_activations == 1


def test_one_notice_per_activation_not_per_turn_and_each_activation_its_own() -> None:
    # A1 ran two turns (one notice owed); A2 ran one (its own notice owed).
    child = records(
        TaskEntry(content="work"),
        *child_turn(A1, "t1", *CHILD_SENDS_M1),
        *child_turn(A1, "t2"),
        *child_turn(A2, "t3"),
    )
    both = judge(root_reads(from_child("m1"), notice(A1), notice(A2)), child)
    assert both.unnoticed_activations == 0, both.summary()
    only_first = judge(root_reads(from_child("m1"), notice(A1)), child)
    assert only_first.unnoticed_activations == 1, only_first.summary()


def test_an_activation_that_still_holds_its_child_owes_no_notice_yet() -> None:
    root = root_reads(from_child("m1"))
    verdict = judge(root, GOOD_CHILD, held={ROOT: R1, CHILD: A1})
    assert verdict.unnoticed_activations == 0, verdict.summary()


def test_an_absent_session_holding_an_entry_no_turn_read_is_counted() -> None:
    root = root_with(from_child("m1"), notice())  # arrived, never read
    verdict = judge(root, GOOD_CHILD, held={})
    assert verdict.unread_sessions == 1, verdict.summary()
    assert not verdict.clean
    # The same entries at a session an activation holds: it is still reading them.
    assert judge(root, GOOD_CHILD, held={ROOT: R1}).unread_sessions == 0


def test_a_tree_whose_round_did_not_finish_is_stalled() -> None:
    # The child's host died mid-turn and nobody resumed it: its turn never ended.
    child = records(TaskEntry(content="work"), started(A1, "t1"), *CHILD_SENDS_M1)
    verdict = judge(root_reads(from_child("m1"), notice()), child)
    assert verdict.stalled_trees == 1, verdict.summary()
    assert not verdict.clean
    assert unfinished_trees({ROOT: GOOD_ROOT, CHILD: child}, PARENTS, IDLE_ROOT).keys() == {ROOT}
    assert unfinished_trees({ROOT: GOOD_ROOT, CHILD: GOOD_CHILD}, PARENTS, IDLE_ROOT) == {}


def test_a_call_still_waiting_for_a_decision_leaves_the_tree_stalled() -> None:
    asking = AssistantStepEntry(
        text="",
        tool_calls=(ToolCall(call_id="p1", name="probe_unsafe", arguments_json="{}"),),
        usage=Usage(),
    )
    request = ApprovalRequestEntry(
        call_id="p1",
        tool="probe_unsafe",
        arguments_json="{}",
        descriptor_digest="d",
        step_seq=7,
    )
    awaiting = TurnEndedEntry(turn_id=TurnId("t1"), outcome=TurnOutcome.AWAITING_APPROVAL)
    child = records(
        TaskEntry(content="work"), started(A1, "t1"), *CHILD_SENDS_M1, asking, request, awaiting
    )
    verdict = judge(root_reads(from_child("m1"), notice()), child)
    assert verdict.stalled_trees == 1, verdict.summary()


def test_a_reply_refused_parent_rebound_that_never_landed_is_counted() -> None:
    child = records(
        TaskEntry(content="work"),
        *child_turn(
            A1,
            "t1",
            ConsumedEntry(seqs=(1,)),
            send_step("c1", "m1"),
            refused("c1", RejectionReason.PARENT_REBOUND),
        ),
    )
    verdict = judge(root_reads(notice()), child)
    assert verdict.rebound_replies_lost == 1, verdict.summary()
    assert not verdict.clean


def lost_notice() -> SettlementNoticeEntry:
    return dataclasses.replace(notice(), outcome=SettlementOutcome.LOST, terminal_output="")


def lost(turn: str) -> TurnEndedEntry:
    return TurnEndedEntry(turn_id=TurnId(turn), outcome=TurnOutcome.LOST, detail="host went away")


def refused_then_lost(*after_refusal: Entry) -> list[Record]:
    """The child: its reply refused PARENT_REBOUND, ``after_refusal``, then its turn lost."""
    return records(
        TaskEntry(content="work"),
        started(A1, "t1"),
        ConsumedEntry(seqs=(1,)),
        send_step("c1", "m1"),
        refused("c1", RejectionReason.PARENT_REBOUND),
        *after_refusal,
        lost("t1"),
    )


def test_a_reply_refused_parent_rebound_as_its_host_died_is_the_lost_runs_not_counted() -> None:
    # From the 30-minute soak: the refusal was the last thing the turn saw; its host was
    # killed before the model's resend; the next activation closed the turn lost.
    verdict = judge(root_reads(lost_notice()), refused_then_lost())
    assert verdict.rebound_replies_lost == 0, verdict.summary()
    assert verdict.clean, verdict.summary()
    assert (verdict.rebound_refusals, verdict.rebound_replies_lost_with_their_run) == (1, 1)
    assert "(of 1 refused; lost with their run, told by its lost notice: 1)" in verdict.summary()


def test_a_reply_refused_parent_rebound_then_dropped_by_its_model_is_counted_even_if_lost() -> None:
    # The model stepped again after the refusal and did not send it.
    verdict = judge(root_reads(lost_notice()), refused_then_lost(reply()))
    assert verdict.rebound_replies_lost == 1, verdict.summary()


def sent_again(answer: ToolResultEntry, *after: Entry) -> list[Record]:
    """The child: its reply refused PARENT_REBOUND, sent again and answered ``answer`` (call
    ``c2``), then ``after``, in one turn."""
    return records(
        TaskEntry(content="work"),
        *child_turn(
            A1,
            "t1",
            ConsumedEntry(seqs=(1,)),
            send_step("c1", "m1"),
            refused("c1", RejectionReason.PARENT_REBOUND),
            send_step("c2", "m1"),
            answer,
            *after,
        ),
    )


def refused_then_gone() -> list[Record]:
    """Sent again and refused PARENT_NOT_LIVE (the parent gone again), then a final answer."""
    return sent_again(refused("c2", RejectionReason.PARENT_NOT_LIVE), reply())


def test_a_lost_reply_names_what_its_sender_did_after_the_refusal() -> None:
    # From stop 43's CI run: two refusals, then nothing said why the words never landed.
    child = refused_then_gone()
    verdict = judge(root_reads(notice()), child)
    assert verdict.rebound_replies_lost == 1, verdict.summary()
    assert (
        'then result \'{"rejected": "PARENT_REBOUND", "detail": "no"}\'; step send_message;'
        ' result \'{"rejected": "PARENT_NOT_LIVE", "detail": "no"}\'; answer \'Noted.\';'
        " turn ended completed"
    ) in verdict.summary()


def test_a_reply_refused_parent_rebound_that_its_final_answer_carried_is_fine() -> None:
    # Sent again, refused PARENT_NOT_LIVE (the parent gone again): the child's final answer
    # carries the words, and the parent reads them in the settlement notice.
    child = refused_then_gone()
    carried = dataclasses.replace(notice(), terminal_output="Noted.\nNot delivered before: m1")
    verdict = judge(root_reads(carried), child)
    assert verdict.rebound_replies_lost == 0, verdict.summary()
    assert verdict.clean, verdict.summary()
    # Another child's answer carrying the same words is not this one's.
    stranger = dataclasses.replace(carried, child_session=SessionId("other"))
    assert judge(root_reads(notice(), stranger), child).rebound_replies_lost == 1


def test_a_reply_refused_parent_rebound_and_sent_again_until_it_landed_is_fine() -> None:
    child = sent_again(delivered("c2"))
    verdict = judge(GOOD_ROOT, child)
    assert verdict.rebound_replies_lost == 0, verdict.summary()
    assert verdict.clean, verdict.summary()


def test_without_an_end_state_the_liveness_checks_are_not_run() -> None:
    verdict = check_history([], {ROOT: root_with(from_child("m1"))}, NodeHistory())
    assert counts(verdict) == dict.fromkeys(LIVENESS, 0)
    assert "stalled trees" not in verdict.summary()
