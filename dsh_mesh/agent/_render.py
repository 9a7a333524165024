"""Turning a transcript into the messages a model sees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dsh_mesh.core import (
    INBOUND_TYPES,
    AgentMessageEntry,
    AnswerRejectedEntry,
    ApprovalDecisionEntry,
    AssistantStepEntry,
    ChatMessage,
    CompactionEntry,
    ConsumedEntry,
    ForkPrefixEntry,
    HumanPromptEntry,
    InboundEntry,
    Record,
    Role,
    SettlementNoticeEntry,
    TaskEntry,
    ToolOutputsClearedEntry,
    ToolResultEntry,
    TurnEndedEntry,
    frame_agent_message,
    frame_answer_rejected,
    frame_settlement_notice,
)


def render_inbound(entry: InboundEntry) -> ChatMessage:
    """The model-visible user message for one consumed inbound entry: agent messages carry the
    `Agent <sender-id> sent a message:` frame, settlement notices their own attribution."""

    if isinstance(entry, AgentMessageEntry):
        return ChatMessage(role=Role.USER, content=frame_agent_message(entry.source, entry.content))
    if isinstance(entry, SettlementNoticeEntry):
        text = frame_settlement_notice(
            entry.child_session, entry.outcome, entry.terminal_output, entry.detail
        )
        return ChatMessage(role=Role.USER, content=text)
    if isinstance(entry, TaskEntry | HumanPromptEntry):
        return ChatMessage(role=Role.USER, content=entry.content)
    raise TypeError(f"not an inbound entry: {entry!r}")


SUMMARY_FRAME = "This conversation was compacted to save context. A summary of it so far:"
"""The first line of the message that shows a compaction's summary to the model."""


def frame_summary(summary: str) -> str:
    """The model-visible text of a compaction's summary."""
    return f"{SUMMARY_FRAME}\n\n{summary}"


def cleared_stub(entry: ToolResultEntry) -> str:
    """What the model sees in place of a cleared tool output: what it was, and how to get it
    again."""
    return (
        f"[The output of this {entry.name} call ({len(entry.content):,} characters) was cleared"
        " from your context to save space; the session's transcript keeps it. If you need it,"
        " make the call again (only if the tool is safe to repeat).]"
    )


Shown = dict[int, tuple[Record, bool, ChatMessage]]
"""What :func:`render` made of each step and tool result it showed: by seq, the record, whether
it showed as cleared, and its message. A caller that renders the same growing transcript again
(a turn's steps) passes the same one, and each message is made once."""


def render(
    records: Sequence[Record],
    *,
    upto: int | None = None,
    clear_all: bool = False,
    made: Shown | None = None,
) -> tuple[ChatMessage, ...]:
    """The conversation of a transcript, or of its context (:func:`~dsh_mesh.core.context_of`),
    which renders the same. Inbound entries appear where they were consumed, so a message
    accepted mid-step follows that step's tool results; unconsumed ones do not appear.

    A :class:`CompactionEntry` replaces what the records of its range show with the kept task
    and the summary. A tool output cleared by a :class:`ToolOutputsClearedEntry` anywhere in
    ``records`` shows as a stub (every one, with ``clear_all``). With ``upto`` only the
    messages of records up to that seq are rendered, exactly as they start the rendering of
    all ``records``: that is what makes a fork child's inherited history byte-identical to
    what its parent sends. ``made`` keeps the messages made for a later call (see
    :data:`Shown`); what it renders is the same with it or without.
    """
    cleared = {
        seq
        for record in records
        if isinstance(record.entry, ToolOutputsClearedEntry)
        for seq in record.entry.seqs
    }
    inbound: dict[int, InboundEntry] = {}
    messages: list[tuple[int, ChatMessage]] = []
    """Each message with the seq of the record that shows it."""
    for record in records:
        if upto is not None and record.seq > upto:
            break
        entry, seq = record.entry, record.seq
        if isinstance(entry, INBOUND_TYPES):
            inbound[seq] = entry
        elif isinstance(entry, ConsumedEntry):
            # A decision on an approval request shows only through its call's result.
            shown = [
                inbound[s] for s in entry.seqs if not isinstance(inbound[s], ApprovalDecisionEntry)
            ]
            messages.extend((seq, render_inbound(e)) for e in shown)
        elif isinstance(entry, ForkPrefixEntry):
            messages.extend((seq, m) for m in entry.messages)
        elif isinstance(entry, AssistantStepEntry):
            messages.append((seq, _once(made, record, False, _step_message)))
        elif isinstance(entry, ToolResultEntry):
            stub = clear_all or seq in cleared
            messages.append((seq, _once(made, record, stub, _result_message)))
        elif isinstance(entry, AnswerRejectedEntry):
            text = frame_answer_rejected(entry.reason, entry.schema)
            messages.append((seq, ChatMessage(role=Role.USER, content=text)))
        elif isinstance(entry, CompactionEntry):
            # What records after its range show (a read the compaction left for the next step)
            # stays, after the kept task and the summary.
            head = [ChatMessage(role=Role.USER, content=entry.task)] if entry.task else []
            head.append(ChatMessage(role=Role.USER, content=frame_summary(entry.summary)))
            after = [(s, m) for s, m in messages if s > entry.through_seq]
            messages = [(0, m) for m in head] + after
    return tuple(m for _, m in messages)


def _step_message(entry: AssistantStepEntry, _: bool) -> ChatMessage:
    return ChatMessage(role=Role.ASSISTANT, content=entry.text, tool_calls=entry.tool_calls)


def _result_message(entry: ToolResultEntry, stub: bool) -> ChatMessage:
    content = cleared_stub(entry) if stub else entry.content
    return ChatMessage(role=Role.TOOL, content=content, tool_call_id=entry.call_id)


def _once(
    shown: Shown | None, record: Record, stub: bool, make: Callable[[Any, bool], ChatMessage]
) -> ChatMessage:
    """The message of ``record`` (``stub``: its output cleared), made by ``make`` unless
    ``shown`` has it from this very record."""
    if shown is not None:
        kept = shown.get(record.seq)
        if kept is not None and kept[0] is record and kept[1] == stub:
            return kept[2]
    message = make(record.entry, stub)
    if shown is not None:
        shown[record.seq] = (record, stub, message)
    return message


def completed_turn_prefix(records: Sequence[Record]) -> tuple[int, tuple[ChatMessage, ...]]:
    """What a fork child inherits of ``records`` (a session's transcript or context): the
    rendering up to its last ended turn, or up to its latest compaction when that came later
    (mid-turn: the summary stands for everything it covers), as it starts the rendering the
    parent sends; with the seq it ends at (0 if there is none). A turn that stopped at a call
    waiting for approval did not complete: its end is no such point."""
    # An end after which the last step still has calls without a result is no such point: a
    # turn that stopped at a call waiting for approval (or was lost there) goes on after it.
    open_calls: set[str] = set()
    last = None
    for index, record in enumerate(records):
        entry = record.entry
        if isinstance(entry, AssistantStepEntry):
            open_calls = {call.call_id for call in entry.tool_calls}
        elif isinstance(entry, ToolResultEntry):
            open_calls.discard(entry.call_id)
        elif isinstance(entry, TurnEndedEntry | CompactionEntry) and not open_calls:
            last = index
    if last is not None:
        return records[last].seq, render(records, upto=records[last].seq)
    return 0, render([r for r in records if isinstance(r.entry, ForkPrefixEntry)])
