"""Turning a transcript into the messages a model sees."""

from __future__ import annotations

from collections.abc import Sequence

from dsh_mesh.core import (
    INBOUND_TYPES,
    AgentMessageEntry,
    AssistantStepEntry,
    ChatMessage,
    ConsumedEntry,
    ForkPrefixEntry,
    HumanPromptEntry,
    InboundEntry,
    Record,
    Role,
    SettlementNoticeEntry,
    TaskEntry,
    ToolResultEntry,
    TurnEndedEntry,
    frame_agent_message,
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


def render(records: Sequence[Record]) -> tuple[ChatMessage, ...]:
    """The conversation of a transcript. Inbound entries appear where they were consumed, so a
    message accepted mid-step follows that step's tool results; unconsumed ones do not appear.

    Rendering a prefix of a transcript yields a prefix of the full rendering, which is what makes
    a fork child's inherited history byte-identical to its parent's.
    """
    inbound: dict[int, InboundEntry] = {}
    messages: list[ChatMessage] = []
    for record in records:
        entry = record.entry
        if isinstance(entry, INBOUND_TYPES):
            inbound[record.seq] = entry
        elif isinstance(entry, ConsumedEntry):
            messages.extend(render_inbound(inbound[seq]) for seq in entry.seqs)
        elif isinstance(entry, ForkPrefixEntry):
            messages.extend(entry.messages)
        elif isinstance(entry, AssistantStepEntry):
            messages.append(
                ChatMessage(role=Role.ASSISTANT, content=entry.text, tool_calls=entry.tool_calls)
            )
        elif isinstance(entry, ToolResultEntry):
            messages.append(
                ChatMessage(role=Role.TOOL, content=entry.content, tool_call_id=entry.call_id)
            )
    return tuple(messages)


def completed_turn_prefix(records: Sequence[Record]) -> tuple[int, tuple[ChatMessage, ...]]:
    """The records up to the last ended turn: its last seq (0 if none) and their rendering."""
    for index in range(len(records) - 1, -1, -1):
        if isinstance(records[index].entry, TurnEndedEntry):
            return records[index].seq, render(records[: index + 1])
    return 0, render([r for r in records if isinstance(r.entry, ForkPrefixEntry)])
