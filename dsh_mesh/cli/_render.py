"""How the CLI shows things: one readable line per event or transcript entry (ANSI colours
only when asked), plain-JSON forms for ``--json``, and the one-line error message. Pure."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence

from dsh_mesh.client import (
    AgentMessage,
    AgentState,
    AgentSummary,
    AnswerRejected,
    ApprovalDecided,
    ApprovalRequest,
    AssistantStep,
    Compaction,
    Consumed,
    EntryBody,
    ForkPrefix,
    HumanPrompt,
    SessionEvent,
    SettlementNotice,
    Task,
    ToolOutputsCleared,
    ToolResult,
    TranscriptEntry,
    TurnEnded,
    TurnStarted,
    UnknownEntry,
    to_jsonable,
)
from dsh_mesh.core import MeshError, Rejected, Role, SettlementOutcome, TurnOutcome, Usage
from dsh_mesh.transport import RemoteError

DEFAULT_WIDTH = 160
"""Longest text part of a watch line; longer content is cut with ``...``."""

_RESET = "\x1b[0m"
_STYLE: Mapping[str, str] = {
    "dim": "\x1b[2m",
    "bold": "\x1b[1m",
    "red": "\x1b[31m",
    "green": "\x1b[32m",
    "yellow": "\x1b[33m",
    "blue": "\x1b[34m",
    "magenta": "\x1b[35m",
    "cyan": "\x1b[36m",
}
_LABEL_STYLE: Mapping[str, str] = {
    "task": "bold",
    "prompt": "bold",
    "message": "magenta",
    "settled": "yellow",
    "step": "cyan",
    "tool": "dim",
    "turn": "blue",
    "consumed": "dim",
    "compacted": "yellow",
    "cleared": "dim",
    "resident": "green",
    "absent": "dim",
    "entry": "dim",
}
_BAD_SETTLEMENTS = {SettlementOutcome.ERROR, SettlementOutcome.LOST, SettlementOutcome.CANCELLED}
_BAD_TURNS = {
    TurnOutcome.ERROR,
    TurnOutcome.CANCELLED,
    TurnOutcome.TOKEN_EXHAUSTION,
    TurnOutcome.LOST,
}
_SPACE = re.compile(r"[ \t]+")
_LABEL_WIDTH = 9


def paint(text: str, style: str | None, *, color: bool) -> str:
    """``text`` wrapped in the ANSI style named ``style`` when ``color``; unchanged otherwise."""
    if not color or style is None or style not in _STYLE:
        return text
    return f"{_STYLE[style]}{text}{_RESET}"


def one_line(text: str, width: int | None = DEFAULT_WIDTH) -> str:
    """``text`` on one line (newlines shown as ``\\n``, runs of blanks as one space), cut to
    ``width`` characters with ``...`` (no cut when ``width`` is ``None``)."""
    flat = _SPACE.sub(" ", text.strip()).replace("\r\n", "\n").replace("\n", "\\n")
    if width is not None and len(flat) > width:
        return flat[: max(width - 3, 0)] + "..."
    return flat


def _outcome(value: enum.Enum | None) -> str:
    return value.value if value is not None else "unknown"


def describe_body(body: EntryBody, *, width: int | None = DEFAULT_WIDTH) -> tuple[str, str, bool]:
    """``(label, text, bad)`` for one entry body: the label names the kind (``turn``, ``step``,
    ``message``, ``settled``...), ``bad`` marks a failure (shown red)."""
    if isinstance(body, Task):
        return "task", one_line(body.content, width), False
    if isinstance(body, HumanPrompt):
        return "prompt", one_line(body.content, width), False
    if isinstance(body, AgentMessage):
        how = f" ({body.delivery.value})" if body.delivery is not None else ""
        return "message", f"from {body.sender}{how}: {one_line(body.content, width)}", False
    if isinstance(body, SettlementNotice):
        text = f"{body.child_session} {_outcome(body.outcome)}"
        if body.detail:
            text += f" ({one_line(body.detail, width)})"
        if body.output_json:
            text += f": output {one_line(body.output_json, width)}"
        elif body.terminal_output:
            text += f": {one_line(body.terminal_output, width)}"
        return "settled", text, body.outcome in _BAD_SETTLEMENTS
    if isinstance(body, AssistantStep):
        parts = [one_line(body.text, width)] if body.text.strip() else []
        parts += [
            f"-> {call.name}({one_line(call.arguments_json, width)})" for call in body.tool_calls
        ]
        text = " ".join(parts) or "(no output)"
        tokens = step_usage(body.usage)
        return "step", f"{text} {tokens}" if tokens else text, False
    if isinstance(body, ToolResult):
        marker = "error: " if body.is_error else ""
        took = f" ({_duration(body.duration_ms)})" if body.duration_ms else ""
        text = f"{body.name}{took} -> {marker}{one_line(body.content, width)}"
        return "tool", text, body.is_error
    if isinstance(body, TurnStarted):
        where = ""
        if body.node_id is not None:
            where = f" on {body.node_id}"
            if body.activation_id is not None:
                where += f" ({body.activation_id})"
        return "turn", f"{body.turn_id} started{where}", False
    if isinstance(body, TurnEnded):
        text = f"{body.turn_id} ended {_outcome(body.outcome)}"
        if body.detail:
            text += f": {one_line(body.detail, width)}"
        if body.output_json:
            text += f", output {one_line(body.output_json, width)}"
        return "turn", text, body.outcome in _BAD_TURNS
    if isinstance(body, AnswerRejected):
        return "rejected", f"answer asked again: {one_line(body.reason, width)}", True
    if isinstance(body, Consumed):
        return "consumed", "seq " + ", ".join(str(seq) for seq in body.seqs), False
    if isinstance(body, Compaction):
        tokens = step_usage(body.usage)
        text = f"seq {body.from_seq}-{body.through_seq} summarised: {one_line(body.summary, width)}"
        if body.pending:
            text += " (kept unread: seq " + ", ".join(str(s) for s in body.pending) + ")"
        return "compacted", f"{text} {tokens}" if tokens else text, False
    if isinstance(body, ToolOutputsCleared):
        return "cleared", "tool outputs of seq " + ", ".join(map(str, body.seqs)), False
    if isinstance(body, ApprovalRequest):
        text = f"{body.tool}({one_line(body.arguments_json, width)}) call {body.call_id}"
        text += f" digest {body.request_digest}"
        if body.expires_at is not None:
            text += f", expires {body.expires_at.isoformat(timespec='seconds')}"
        return "approval?", text, False
    if isinstance(body, ApprovalDecided):
        verdict = "unknown" if body.decision is None else body.decision.value
        text = f"call {body.call_id} {verdict} by {body.by or 'unknown'}"
        if body.arguments_json:
            text += f" with {one_line(body.arguments_json, width)}"
        if body.reason:
            text += f": {one_line(body.reason, width)}"
        denied = body.decision is not None and body.decision.value == "deny"
        return "decided", text, denied
    if isinstance(body, ForkPrefix):
        text = f"{len(body.messages)} messages inherited from its parent"
        answers = [m.content for m in body.messages if m.role is Role.ASSISTANT and m.content]
        if answers:
            text += f"; its last answer: {one_line(answers[-1], width)}"
        return "inherited", text, False
    assert isinstance(body, UnknownEntry)
    return "entry", "(an entry kind this client does not know)", False


def _share(share: float) -> str:
    return f"{share:.0%}"


def step_usage(usage: Usage) -> str:
    """One model call's usage as a short suffix, ``[in 1,234 / cached 1,024 / out 56]``; ``""``
    when the provider reported none (every figure zero)."""
    if not (usage.input_tokens or usage.output_tokens or usage.cached_input_tokens):
        return ""
    return (
        f"[in {usage.input_tokens:,} / cached {usage.cached_input_tokens:,}"
        f" / out {usage.output_tokens:,}]"
    )


def _line(label: str, text: str, bad: bool, *, color: bool) -> str:
    style = "red" if bad else _LABEL_STYLE.get(label)
    return f"{paint(label.ljust(_LABEL_WIDTH), style, color=color)} {text}"


def format_entry(
    entry: TranscriptEntry, *, color: bool = False, width: int | None = DEFAULT_WIDTH
) -> str:
    """One transcript entry as one line: ``<seq> <label> <text>``."""
    label, text, bad = describe_body(entry.body, width=width)
    return f"{entry.seq:>5}  {_line(label, text, bad, color=color)}"


def format_event(
    event: SessionEvent, *, color: bool = False, width: int | None = DEFAULT_WIDTH
) -> str:
    """One watch event as one line: ``<event_seq> <session> #<seq> <label> <text>``.

    Labels: ``task``, ``prompt``, ``message``, ``settled``, ``step``, ``tool``, ``turn``,
    ``consumed`` for transcript entries; ``resident`` / ``absent`` for residency changes.
    ``event_seq`` comes first so a reader can resume with ``watch --from``."""
    head = f"{event.event_seq:>7}  {paint(event.session_id, 'dim', color=color)}"
    if event.entry is not None:
        label, text, bad = describe_body(event.entry.body, width=width)
        return f"{head}  #{event.entry.seq:<4} {_line(label, text, bad, color=color)}"
    if event.activated is not None:
        where = f"on {event.activated.node_id} ({event.activated.activation_id})"
        return f"{head}  {'-':<5} {_line('resident', where, False, color=color)}"
    if event.deactivated is not None:
        where = f"left {event.deactivated.node_id} ({event.deactivated.activation_id})"
        return f"{head}  {'-':<5} {_line('absent', where, False, color=color)}"
    return f"{head}  {'-':<5} {_line('entry', '(empty event)', False, color=color)}"


def summary_row(summary: AgentSummary, depth: int = 0) -> tuple[str, ...]:
    """The ``ls`` columns of one agent: session (indented by tree depth), kind, parent, preset,
    state (in the web view's words: :func:`state_word`), node."""
    info = summary.info
    return (
        "  " * depth + info.session_id,
        info.kind.value if info.kind is not None else "unknown",
        info.parent_session or "-",
        info.preset,
        state_word(summary),
        summary.activation.node_id if summary.activation is not None else "-",
    )


def state_word(summary: AgentSummary) -> str:
    """An agent's state as the web view names it: ``awaiting-approval`` while a call of it
    waits for a person, ``settled`` for a child whose run ended (it holds no activation), else
    the listing's own (``idle``, ``running``, ``absent``, ``resident``)."""
    if summary.awaiting_approval:
        return "awaiting-approval"
    if summary.state is AgentState.ABSENT and summary.info.parent_session is not None:
        return "settled"
    return summary.state.value if summary.state is not None else "unknown"


def column_widths(
    header: tuple[str, ...], rows: Sequence[tuple[str, ...]], at_least: Sequence[int] = ()
) -> list[int]:
    """The width of each column of ``rows`` under ``header``, at least ``at_least``'s (so a
    table printed page by page keeps its columns)."""
    floor = [*at_least, *[0] * len(header)]
    return [max(floor[i], *(len(row[i]) for row in [header, *rows])) for i in range(len(header))]


def table(
    header: tuple[str, ...],
    rows: Sequence[tuple[str, ...]],
    widths: Sequence[int] | None = None,
) -> list[str]:
    """Left-aligned columns, two spaces apart (as wide as ``widths`` when given)."""
    widths = widths or column_widths(header, rows)
    return [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in [header, *rows]
    ]


def dumps(value: object) -> str:
    """One compact JSON line for ``value`` (see :func:`to_jsonable`)."""
    return json.dumps(to_jsonable(value), ensure_ascii=False, separators=(",", ":"))


def error_line(error: MeshError) -> str:
    """The one line the CLI prints for a failed call: ``error: <REASON>: <detail>``.

    A rejection shows its ``RejectionReason`` name; a status that named no mesh reason shows
    its gRPC status code name (``UNIMPLEMENTED``...); anything else its class name."""
    if isinstance(error, Rejected):
        code, detail = error.reason.value, error.detail
    elif isinstance(error, RemoteError):
        code, detail = error.code.name, error.detail
    else:
        code, detail = type(error).__name__, str(error)
    detail = one_line(detail, None) or "(no detail)"
    return f"error: {code}: {detail}"


def _duration(milliseconds: int) -> str:
    """A call's duration as people read it: ``340 ms``, ``2.4 s``, ``3 min 5 s``."""
    if milliseconds < 1000:
        return f"{milliseconds} ms"
    seconds = milliseconds / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"
