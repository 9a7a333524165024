"""``TreeProgress``: the fold that says whether a tree has settled, fact by fact and over core
records (the SDK's ``run`` and the fault run's liveness count both ask it)."""

from __future__ import annotations

from dsh_mesh.core import (
    ActivationId,
    ApprovalRequestEntry,
    ConsumedEntry,
    Entry,
    Record,
    SessionId,
    SessionKind,
    SettlementNoticeEntry,
    SettlementOutcome,
    TaskEntry,
    ToolResultEntry,
    TreeProgress,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
)

ROOT = SessionId("root")
CHILD = SessionId("child")
A1 = ActivationId("child-a1")
A2 = ActivationId("child-a2")


def fed(session: SessionId, *entries: Entry, progress: TreeProgress | None = None) -> TreeProgress:
    progress = progress or TreeProgress()
    for seq, entry in enumerate(entries, start=1):
        progress.read(session, Record(seq=seq, entry=entry))
    return progress


def turn(activation: ActivationId | None, outcome: TurnOutcome | None) -> list[Entry]:
    """A task read by one turn of ``activation`` that ends ``outcome`` (``None``: still open)."""
    entries: list[Entry] = [
        TaskEntry(content="Work."),
        TurnStartedEntry(turn_id=TurnId("t1"), activation_id=activation or ActivationId("")),
        ConsumedEntry(seqs=(1,)),
    ]
    if outcome is not None:
        entries.append(TurnEndedEntry(turn_id=TurnId("t1"), outcome=outcome))
    return entries


def notice(activation: ActivationId) -> SettlementNoticeEntry:
    return SettlementNoticeEntry(
        child_session=CHILD,
        child_activation=activation,
        child_kind=SessionKind.CONTINUABLE_CHILD,
        outcome=SettlementOutcome.COMPLETED,
        terminal_output="Done.",
    )


def test_a_root_whose_turn_read_its_task_and_ended_has_settled() -> None:
    progress = fed(ROOT, *turn(None, TurnOutcome.COMPLETED))
    assert progress.tree_waits(ROOT) == []


def test_an_unread_task_an_open_turn_and_an_undecided_call_each_hold_the_tree() -> None:
    assert fed(ROOT, TaskEntry(content="Work.")).tree_waits(ROOT) == ["root has 1 entries unread"]
    assert fed(ROOT, *turn(None, None)).tree_waits(ROOT) == ["root has turn t1 open"]
    asking = fed(
        ROOT,
        *turn(None, TurnOutcome.AWAITING_APPROVAL)[:3],
        ApprovalRequestEntry(
            call_id="c1", step_seq=3, tool="deploy", arguments_json="{}", descriptor_digest="d"
        ),
        TurnEndedEntry(turn_id=TurnId("t1"), outcome=TurnOutcome.AWAITING_APPROVAL),
    )
    assert asking.tree_waits(ROOT) == ["root has calls ['c1'] waiting for a decision"]
    asking.read(ROOT, Record(seq=6, entry=ToolResultEntry(call_id="c1", name="deploy", content="")))
    assert asking.tree_waits(ROOT) == []


def test_a_child_activation_that_ran_a_turn_holds_the_tree_until_its_notice_lands() -> None:
    progress = fed(CHILD, *turn(A1, TurnOutcome.COMPLETED))
    progress.session(ROOT)
    assert progress.tree_waits(ROOT) == ["no notice yet for child activation child-a1"]
    # ... but not while it holds its session still, when the caller says so (the fault run's
    # end state: the activation still holding its session owes its notice only when it ends)
    assert progress.waits(CHILD, is_child=True, held={CHILD: A1}) == []
    fed(ROOT, notice(A1), progress=progress)
    assert progress.tree_waits(ROOT) == ["root has 1 entries unread"]
    progress.consumed(ROOT, (1,))
    assert progress.tree_waits(ROOT) == []


def test_each_activation_owes_its_own_notice_and_the_root_owes_none() -> None:
    progress = fed(CHILD, *turn(A1, TurnOutcome.COMPLETED))
    progress.turn_started(CHILD, "t2", A2)
    progress.turn_ended(CHILD, TurnOutcome.COMPLETED)
    progress.noticed(CHILD, A1)
    assert progress.owed(CHILD) == [A2]
    assert progress.waits(CHILD, is_child=False) == []
