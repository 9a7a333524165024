"""The settlement notice of an activation, as its child's durable transcript tells it
(ADR 0043): whoever writes it, the settling node or any other, writes the same notice."""

from __future__ import annotations

from collections.abc import Sequence

from dsh_mesh.agent import settlement_outcome
from dsh_mesh.core import (
    Activation,
    AssistantStepEntry,
    Record,
    SessionHeader,
    SettlementNoticeEntry,
    SettlementOutcome,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
)


def derived_notice(
    child: SessionHeader, activation: Activation, records: Sequence[Record]
) -> SettlementNoticeEntry | None:
    """The notice of ``activation`` from ``records`` (the child's transcript from that
    activation's last turn on, at least): its last turn's outcome with the last assistant text
    up to its end, or ``lost`` when that turn never ended (its host went away mid-turn; the
    detail then names the calls its last step left open, which it carries out when it resumes,
    after this notice). None when the activation ran no turn: such a run reports nothing."""
    started = None
    for index in range(len(records) - 1, -1, -1):
        entry = records[index].entry
        if isinstance(entry, TurnStartedEntry) and entry.activation_id == activation.activation_id:
            started = index
            break
    if started is None:
        return None
    turn = records[started].entry
    assert isinstance(turn, TurnStartedEntry)
    ended: TurnEndedEntry | None = None
    output = ""
    open_calls: dict[str, str] = {}
    for record in records[started:]:
        entry = record.entry
        if isinstance(entry, TurnStartedEntry) and record is not records[started]:
            break  # a later activation's turn: this one's ended before it
        if isinstance(entry, AssistantStepEntry):
            output = entry.text or output
            open_calls = {call.call_id: call.name for call in entry.tool_calls}
        elif isinstance(entry, ToolResultEntry):
            open_calls.pop(entry.call_id, None)
        elif isinstance(entry, TurnEndedEntry) and entry.turn_id == turn.turn_id:
            ended = entry
            break
    if not output:
        output = last_output(records[:started])
    if ended is None or ended.outcome in (TurnOutcome.LOST, TurnOutcome.AWAITING_APPROVAL):
        outcome, detail = SettlementOutcome.LOST, f"host {activation.node_id} went away"
        if ended is not None and ended.outcome is TurnOutcome.AWAITING_APPROVAL:
            detail += " while a call waited for a person's decision; it goes on once decided"
        elif open_calls:
            names = ", ".join(sorted(set(open_calls.values())))
            detail += (
                f"; its last step left {len(open_calls)} call(s) open ({names}): it carries"
                " them out when it resumes, so what they send reaches you after this notice"
            )
    else:
        outcome, detail = settlement_outcome(ended.outcome), ended.detail
    return SettlementNoticeEntry(
        child_session=child.session_id,
        child_activation=activation.activation_id,
        child_kind=child.kind,
        outcome=outcome,
        terminal_output=output,
        detail=detail,
        trace=turn.trace,
        output_json=ended.output_json
        if ended is not None and outcome is SettlementOutcome.COMPLETED
        else "",
    )


def last_output(records: Sequence[Record]) -> str:
    """The last assistant text among ``records``: a lost child's terminal output."""
    for record in reversed(records):
        if isinstance(record.entry, AssistantStepEntry) and record.entry.text:
            return record.entry.text
    return ""
