"""How big an agent's context is, and how to make room in it (docs/context.md).

Pure functions over a session's records and the request rendered from them: how many tokens
the next request holds, which old tool outputs may be cleared, and the request that asks the
model for a summary. The agent loop (:mod:`dsh_mesh.agent._agent`) decides when to use them
and writes what they produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsh_mesh.agent._render import cleared_stub
from dsh_mesh.core import (
    AssistantStepEntry,
    ChatMessage,
    CompactionEntry,
    Record,
    Role,
    ToolDescriptor,
    ToolOutputsClearedEntry,
    ToolResultEntry,
)
from dsh_mesh.tools import ContextPolicy

CHARS_PER_TOKEN = 4
"""The estimate of text per token where a provider reports none (English prose and code run
at about four characters a token with the common tokenizers)."""

SUMMARY_INSTRUCTION = (
    "Your context is nearly full, so this conversation is about to be replaced by a summary"
    " that you write now. Write it for yourself: the task and who gave it, every decision and"
    " finding so far, the facts, names, files and agent ids you still need (ids exactly as"
    " written), what you were doing when this summary was asked for and what you planned next,"
    " and any questions still open. Messages you have not read yet are kept as they are: do"
    " not guess at them. Call no tools; answer with the summary only, in at most {words}"
    " words."
)
"""The last message of a summary request, after the conversation it summarises (``{words}``:
the summary's length, from the policy's ``summary_max_tokens``)."""


def estimate_tokens(text_length: int) -> int:
    """Tokens of ``text_length`` characters, by :data:`CHARS_PER_TOKEN` (rounded up)."""
    return -(-text_length // CHARS_PER_TOKEN)


def message_length(message: ChatMessage) -> int:
    """The characters of one message as a model reads it: content and tool calls."""
    calls = sum(len(c.name) + len(c.arguments_json) + len(c.call_id) for c in message.tool_calls)
    return len(message.content) + calls


def head_length(system_prompt: str, tools: Sequence[ToolDescriptor]) -> int:
    """The characters of a request head: the system prompt and the tool list."""
    described = sum(len(t.name) + len(t.description) + len(t.input_schema_json) for t in tools)
    return len(system_prompt) + described


@dataclass(frozen=True, kw_only=True)
class ContextSize:
    """How many tokens the next request holds, and whether a provider reported the bulk of it
    (else it is all an estimate)."""

    tokens: int
    reported: bool


def context_size(
    records: Sequence[Record], messages: Sequence[ChatMessage], head: int
) -> ContextSize:
    """The size of the request of ``messages`` (rendered from ``records``) with a head of
    ``head`` characters. When the last model call since the context last changed shape (its
    latest compaction or clearing) reported its prompt tokens, that call's prompt plus its
    output, plus an estimate of the messages after it; else an estimate of everything."""
    for record in reversed(records):
        entry = record.entry
        if isinstance(entry, CompactionEntry | ToolOutputsClearedEntry):
            break
        if isinstance(entry, AssistantStepEntry):
            if entry.usage.input_tokens <= 0:
                break
            after = _after_last_assistant(messages)
            since = estimate_tokens(sum(message_length(m) for m in after))
            return ContextSize(
                tokens=entry.usage.input_tokens + entry.usage.output_tokens + since,
                reported=True,
            )
    length = head + sum(message_length(m) for m in messages)
    return ContextSize(tokens=estimate_tokens(length), reported=False)


def _after_last_assistant(messages: Sequence[ChatMessage]) -> Sequence[ChatMessage]:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role is Role.ASSISTANT:
            return messages[index + 1 :]
    return messages


@dataclass(frozen=True, kw_only=True)
class Clearing:
    """Old tool outputs to clear: their seqs, and the tokens that frees (an estimate)."""

    seqs: tuple[int, ...]
    frees: int


def clearing(records: Sequence[Record], policy: ContextPolicy) -> Clearing:
    """The tool outputs in ``records`` after their latest compaction, not cleared yet, but for
    the newest ``policy.keep_tool_outputs``, whose stub is shorter than they are."""
    cleared: set[int] = set()
    results: list[Record] = []
    for record in records:
        entry = record.entry
        if isinstance(entry, CompactionEntry):
            results.clear()
        elif isinstance(entry, ToolOutputsClearedEntry):
            cleared.update(entry.seqs)
        elif isinstance(entry, ToolResultEntry):
            results.append(record)
    keep = policy.keep_tool_outputs
    older = results[: len(results) - keep] if keep else results
    seqs: list[int] = []
    freed = 0
    for record in older:
        assert isinstance(record.entry, ToolResultEntry)
        saved = len(record.entry.content) - len(cleared_stub(record.entry))
        if record.seq not in cleared and saved > 0:
            seqs.append(record.seq)
            freed += saved
    return Clearing(seqs=tuple(seqs), frees=freed // CHARS_PER_TOKEN)


def summary_messages(
    conversation: Sequence[ChatMessage], max_tokens: int
) -> tuple[ChatMessage, ...]:
    """The messages of a summary request: the conversation as the model sees it now (so the
    provider's cache of it serves), then :data:`SUMMARY_INSTRUCTION`, asking for at most about
    ``max_tokens`` (three words to four tokens). The limit is asked for, not sent as the call's
    ``max_tokens``: that field comes before the conversation in the body, and the summary
    request must share the step's bytes through the conversation."""
    instruction = SUMMARY_INSTRUCTION.format(words=max(12, max_tokens * 3 // 4))
    return (*conversation, ChatMessage(role=Role.USER, content=instruction))
