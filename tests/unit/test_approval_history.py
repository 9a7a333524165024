"""The history checker's approval checks (``dsh_mesh.testing._approval_history``): a gated call
that ran had a decision allowing it, each request is decided at most once, and a turn going on
from a waiting call reads its decision without that read being held to a step boundary's rule.
Each test builds one tiny transcript by hand and breaks exactly one promise."""

from __future__ import annotations

from dsh_mesh.core import (
    MESH_DECIDER,
    ActivationId,
    AgentMessageEntry,
    AgentMessageSource,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    ConsumedEntry,
    Entry,
    NodeId,
    Record,
    SessionId,
    TaskEntry,
    ToolCall,
    ToolResultEntry,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    Usage,
)
from dsh_mesh.testing import NodeHistory, boundary_violations, check, open_requests
from dsh_mesh.testing.probe_tools import ProbeRun

LEAF = SessionId("leaf")
PARENT = SessionId("worker")
GATED = frozenset({"probe_unsafe"})
REQUEST = ApprovalRequestEntry(
    call_id="u", step_seq=3, tool="probe_unsafe", arguments_json="{}", descriptor_digest="d" * 64
)
STEP = AssistantStepEntry(
    text="",
    tool_calls=(ToolCall(call_id="u", name="probe_unsafe", arguments_json="{}"),),
    usage=Usage(),
)
"""The step calling the gated probe."""
KEY = "3.0.u"
"""The call's idempotency key: its step's seq, its index, its id."""


def records(*entries: Entry) -> list[Record]:
    return [Record(seq=i, entry=e) for i, e in enumerate(entries, start=1)]


def decided(kind: ApprovalDecision, by: str = "client:soak-driver") -> ApprovalDecisionEntry:
    return ApprovalDecisionEntry(
        call_id="u", decision=kind, request_digest=REQUEST.digest, by=by, reason="no"
    )


def leaf(*after_the_request: Entry) -> list[Record]:
    """Task; read; the step calling the gated probe (seq 3); the request (seq 4); the wait's end
    (seq 5); then ``after_the_request``."""
    return records(
        TaskEntry(content="answer"),
        ConsumedEntry(seqs=(1,)),
        STEP,
        REQUEST,
        TurnEndedEntry(turn_id=TurnId("t-1"), outcome=TurnOutcome.AWAITING_APPROVAL),
        *after_the_request,
    )


def result(*, is_error: bool = False) -> ToolResultEntry:
    return ToolResultEntry(call_id="u", name="probe_unsafe", content="r", is_error=is_error)


def judge(transcript: list[Record], *runs: str) -> tuple[int, int, list[str]]:
    verdict = check(
        [],
        {LEAF: transcript},
        NodeHistory(),
        [ProbeRun(tool="probe_unsafe", session=LEAF, key=key, pid=1) for key in runs],
        gated=GATED,
    )
    return verdict.unapproved_runs, verdict.untrue_decisions, verdict.violations


def test_an_allowed_call_that_ran_once_is_clean_and_counted() -> None:
    transcript = leaf(decided(ApprovalDecision.ALLOW), ConsumedEntry(seqs=(6,)), result())
    verdict = check([], {LEAF: transcript}, NodeHistory(), [], gated=GATED)
    assert (verdict.approvals.requests, verdict.approvals.allowed) == (1, 1)
    assert judge(transcript, KEY) == (0, 0, [])


def test_a_gated_call_that_ran_with_no_decision_ran_unapproved() -> None:
    unapproved, untrue, _ = judge(leaf(result()), KEY)
    assert (unapproved, untrue) == (1, 0)


def test_a_gated_call_that_ran_although_denied_ran_unapproved() -> None:
    for by in ("client:soak-driver", MESH_DECIDER):
        transcript = leaf(
            decided(ApprovalDecision.DENY, by), ConsumedEntry(seqs=(6,)), result(is_error=True)
        )
        assert judge(transcript) == (0, 0, [])  # denied and never run: clean
        unapproved, untrue, violations = judge(transcript, KEY)
        assert (unapproved, untrue) == (1, 0), violations


def test_a_gated_call_with_no_request_that_ran_ran_unapproved() -> None:
    transcript = records(
        TaskEntry(content="answer"),
        ConsumedEntry(seqs=(1,)),
        STEP,
        result(),
    )
    assert judge(transcript, KEY)[0] == 1
    ran = [ProbeRun(tool="probe_unsafe", session=LEAF, key=KEY, pid=1)]
    assert check([], {LEAF: transcript}, NodeHistory(), ran).clean  # not gated: fine


def test_a_request_decided_twice_or_a_decision_on_no_request_is_untrue() -> None:
    twice = leaf(decided(ApprovalDecision.ALLOW), decided(ApprovalDecision.DENY, MESH_DECIDER))
    assert judge(twice)[1] == 1
    stray = ApprovalDecisionEntry(
        call_id="u", decision=ApprovalDecision.ALLOW, request_digest="0" * 64, by="client:x"
    )
    assert judge(leaf(stray))[1] == 1


def test_the_tally_tells_a_persons_denial_from_the_meshs() -> None:
    verdict = check(
        [],
        {
            LEAF: leaf(decided(ApprovalDecision.DENY)),
            PARENT: leaf(decided(ApprovalDecision.DENY, MESH_DECIDER)),
        },
        NodeHistory(),
        [],
        gated=GATED,
    )
    assert (verdict.approvals.denied, verdict.approvals.by_mesh) == (1, 1)
    assert "denied 1, denied by the mesh 1" in verdict.summary()


def test_a_turns_first_read_of_the_decision_alone_is_no_boundary_but_the_next_one_is() -> None:
    message = AgentMessageEntry(source=AgentMessageSource(sender_session_id=PARENT), content="hi")
    started = TurnStartedEntry(
        turn_id=TurnId("t-2"), node_id=NodeId("node-b"), activation_id=ActivationId("a-2")
    )
    # 6 the message, 7 the decision, 8 the turn going on, 9 its read of the decision, 10 result
    going_on = leaf(message, decided(ApprovalDecision.ALLOW), started, ConsumedEntry(seqs=(7,)))
    going_on.append(Record(seq=10, entry=result()))
    assert boundary_violations(going_on) == []  # the message waits for the call's result
    read_later = [*going_on, Record(seq=11, entry=ConsumedEntry(seqs=(6,)))]
    assert boundary_violations(read_later) == []
    skipped = [
        *going_on,
        Record(seq=11, entry=AgentMessageEntry(source=message.source, content="again")),
        Record(seq=12, entry=ConsumedEntry(seqs=(11,))),
    ]
    assert boundary_violations(skipped) == ["seq 12 leaves [6], durable before it, unread"]
    # A read of decisions alone anywhere else is a boundary like any other.
    late = leaf(message, decided(ApprovalDecision.ALLOW), result(), ConsumedEntry(seqs=(7,)))
    assert boundary_violations(late) == ["seq 9 leaves [6], durable before it, unread"]


def test_a_call_that_ran_before_its_allowance_was_read_ran_unapproved() -> None:
    # Allowed, never read, run: the agent runs a call only after a turn read its decision.
    unread = leaf(decided(ApprovalDecision.ALLOW), result())
    assert judge(unread, KEY)[:2] == (1, 0)
    # Allowed after the call was answered: the run came first, and the decision is untrue.
    after = leaf(result(), decided(ApprovalDecision.ALLOW), ConsumedEntry(seqs=(7,)))
    assert judge(after, KEY)[:2] == (1, 1)
    # Allowed, read, then answered: clean.
    read_first = leaf(decided(ApprovalDecision.ALLOW), ConsumedEntry(seqs=(6,)), result())
    assert judge(read_first, KEY) == (0, 0, [])


def test_a_call_waits_until_its_result_whatever_was_decided() -> None:
    assert open_requests(leaf()) == ["u"]
    assert open_requests(leaf(decided(ApprovalDecision.ALLOW))) == ["u"]
    assert open_requests(leaf(decided(ApprovalDecision.DENY), result(is_error=True))) == []
