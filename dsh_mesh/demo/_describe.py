"""Readable transcripts and token usage for the demos."""

from __future__ import annotations

import json

from dsh_mesh.core import (
    AgentMessageEntry,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    ForkPrefixEntry,
    HumanPromptEntry,
    Record,
    SettlementNoticeEntry,
    TaskEntry,
    ToolOutputsClearedEntry,
    ToolResultEntry,
    TurnEndedEntry,
    TurnStartedEntry,
)


def describe(record: Record) -> str:
    """One readable line (or a few) for a transcript record."""
    entry = record.entry
    prefix = f"  #{record.seq:<3}"
    if isinstance(entry, TaskEntry):
        return f"{prefix} task           {_short(entry.content)}"
    if isinstance(entry, HumanPromptEntry):
        return f"{prefix} human prompt   {_short(entry.content)}"
    if isinstance(entry, AgentMessageEntry):
        source = json.dumps(
            {
                "kind": entry.source.kind,
                "form": entry.source.form,
                "sender_session_id": entry.source.sender_session_id,
            }
        )
        return f"{prefix} agent message  source={source}\n        {_short(entry.content)}"
    if isinstance(entry, SettlementNoticeEntry):
        return (
            f"{prefix} subagent-settled {entry.child_session} ({entry.child_kind.value}) "
            f"outcome={entry.outcome.value}\n"
            f"        terminal output: {_short(entry.terminal_output)}"
        )
    if isinstance(entry, ForkPrefixEntry):
        return f"{prefix} fork prefix    {len(entry.messages)} inherited messages"
    if isinstance(entry, TurnStartedEntry):
        return f"{prefix} -- turn {entry.turn_id} started"
    if isinstance(entry, TurnEndedEntry):
        return f"{prefix} -- turn {entry.turn_id} ended: {entry.outcome.value} {entry.detail}"
    if isinstance(entry, CompactionEntry):
        kept = f", kept unread #{', #'.join(map(str, entry.pending))}" if entry.pending else ""
        return (
            f"{prefix} compaction     #{entry.from_seq}-#{entry.through_seq} summarised{kept}\n"
            f"        summary: {_short(entry.summary)}"
        )
    if isinstance(entry, ApprovalRequestEntry):
        return (
            f"{prefix} needs approval {entry.tool}({_short(entry.arguments_json)})"
            f" call {entry.call_id}"
        )
    if isinstance(entry, ApprovalDecisionEntry):
        why = f": {_short(entry.reason)}" if entry.reason else ""
        return f"{prefix} decision       {entry.decision.value} by {entry.by}{why}"
    if isinstance(entry, ToolOutputsClearedEntry):
        return f"{prefix} cleared        tool outputs of #{', #'.join(map(str, entry.seqs))}"
    if isinstance(entry, ConsumedEntry):
        return f"{prefix} step boundary  model now reads #{', #'.join(map(str, entry.seqs))}"
    if isinstance(entry, AssistantStepEntry):
        calls = "; ".join(f"{c.name}({c.arguments_json})" for c in entry.tool_calls)
        said = f"says {_short(entry.text)!r}" if entry.text else ""
        return f"{prefix} model          {said}{' calls ' + _short(calls) if calls else ''}"
    if isinstance(entry, ToolResultEntry):
        flag = "ERROR " if entry.is_error else ""
        took = f" ({entry.duration_ms} ms)" if entry.duration_ms else ""
        return f"{prefix} tool result    {entry.name}{took}: {flag}{_short(entry.content)}"
    return f"{prefix} {entry!r}"


def _short(text: str, limit: int = 150) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
