"""The edge of the fault runs' workload (issue 30): what comes into a transcript from a Python
tool and an MCP server that misbehave, and the rules the history checker holds it to.

Each leaf's answer step calls, besides its probes:

- the Python tool :data:`EDGE_TOOL` with a ``kind``: ``plain`` answers :data:`PLAIN_TEXT`;
  ``garbled`` answers :data:`~dsh_mesh.testing.probe_tools.GARBLED_TEXT` (lone surrogates, as
  a file name that is not UTF-8 comes back from ``os.listdir``), which the mesh stores with each
  one replaced by U+FFFD and a note of how many; ``huge`` answers :data:`HUGE_TEXT`, far past
  the tool's :data:`EDGE_MAX_OUTPUT`, which the mesh cuts with a note;
- one tool of the stdio MCP server :data:`MCP_SERVER`
  (:mod:`dsh_mesh.testing.fault_mcp_server`): ``echo`` (the text back, after a pause in which a
  kill lands mid-call), ``huge`` (kilobytes to megabytes, cut at :data:`MCP_MAX_OUTPUT` while
  it is read) or ``die`` (the server exits in the middle of the call; the fault driver also
  kills servers mid-call).

:func:`edge_violations` judges the results one transcript recorded for those calls;
:func:`stored_text_violations` judges the bytes the log store holds (whatever a reader makes of
them, they must be valid UTF-8 JSON whose strings hold no lone surrogate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from dsh_mesh.core import (
    AssistantStepEntry,
    Record,
    ToolResultEntry,
    is_valid_text,
    valid_prose,
)
from dsh_mesh.testing.probe_tools import GARBLED_TEXT

EDGE_TOOL = "soak_edge"
"""The Python tool whose answers are invalid text or far too long, by its ``kind`` argument."""
EDGE_KINDS = ("plain", "garbled", "huge")
EDGE_MAX_OUTPUT = 4_000
"""The edge tool's ``max_output_chars``."""
PLAIN_TEXT = "a plain answer"
HUGE_TEXT = "0123456789abcdef" * 100_000
"""What a ``huge`` call answers: 1.6 million characters, 400 times the tool's limit."""
CUT_NOTE = "[output cut:"
"""How every note of a cut output begins (a Python tool's and an MCP server's)."""
NOTE_ROOM = 400
"""Characters a note of a cut may add past the limit."""

MCP_SERVER = "faults"
"""The name the workload's nodes give the fault MCP server (its tools are ``faults__<tool>``)."""
MCP_ECHO = f"{MCP_SERVER}__echo"
MCP_HUGE = f"{MCP_SERVER}__huge"
MCP_DIE = f"{MCP_SERVER}__die"
MCP_TOOLS = frozenset({MCP_ECHO, MCP_HUGE, MCP_DIE})
MCP_MAX_OUTPUT = 4_000
"""The fault MCP server's ``max_output_chars``."""


def edge_text(kind: str) -> str:
    """What the edge tool answers for ``kind`` (before the mesh replaces or cuts anything)."""
    if kind == "garbled":
        return GARBLED_TEXT
    if kind == "huge":
        return HUGE_TEXT
    return PLAIN_TEXT


@dataclass
class EdgeTally:
    """What the edge calls of a run came to."""

    tool_calls: int = 0
    """Every tool call of every step."""
    replaced: int = 0
    """Results stored with invalid characters replaced (and the note saying so)."""
    cut: int = 0
    """Results stored cut at their tool's limit (Python and MCP)."""
    mcp_calls: int = 0
    mcp_errors: int = 0
    """MCP calls answered with an error result (the server died mid-call, was starting again,
    or a host death left the call open)."""

    def add(self, other: EdgeTally) -> None:
        self.tool_calls += other.tool_calls
        self.replaced += other.replaced
        self.cut += other.cut
        self.mcp_calls += other.mcp_calls
        self.mcp_errors += other.mcp_errors


def edge_violations(records: Sequence[Record]) -> tuple[EdgeTally, list[str]]:
    """The edge calls' results in ``records`` (one transcript) that break the promise, one line
    each, and the tally. A result answers the latest step that asked for its call id. An error
    result (the call was not run, or a host death left it in doubt) is held to nothing but valid
    text; a result that is no error must be what the tool answered, made valid (``garbled``:
    each invalid character replaced and the note), cut at the limit with the note (``huge``),
    or the echoed text; the server's ``die`` never answers, so a ``die`` call answered as done
    is untrue."""
    tally = EdgeTally()
    violations: list[str] = []
    asked: dict[str, tuple[str, dict[str, object]]] = {}
    for record in records:
        entry = record.entry
        if isinstance(entry, AssistantStepEntry):
            for call in entry.tool_calls:
                tally.tool_calls += 1
                if call.name == EDGE_TOOL or call.name in MCP_TOOLS:
                    try:
                        arguments = json.loads(call.arguments_json or "{}")
                    except json.JSONDecodeError:
                        arguments = {}
                    asked[call.call_id] = (
                        call.name,
                        arguments if isinstance(arguments, dict) else {},
                    )
        elif isinstance(entry, ToolResultEntry):
            where = f"seq {record.seq} ({entry.name} {entry.call_id})"
            if not is_valid_text(entry.content):
                violations.append(f"{where} holds invalid text")
            if entry.call_id not in asked:
                continue
            name, arguments = asked.pop(entry.call_id)
            if name in MCP_TOOLS:
                tally.mcp_calls += 1
                tally.mcp_errors += entry.is_error
            if entry.is_error:
                continue
            problem = _untrue(name, arguments, entry.content, tally)
            if problem:
                violations.append(f"{where}: {problem}")
    return tally, violations


def _untrue(name: str, arguments: dict[str, object], content: str, tally: EdgeTally) -> str:
    """What is wrong with ``content`` as the answer to a call of ``name`` ("": nothing)."""
    if name == EDGE_TOOL:
        kind = str(arguments.get("kind", ""))
        if kind == "garbled":
            tally.replaced += 1
            expected = valid_prose(GARBLED_TEXT)
            return "" if content == expected else f"garbled answer stored as {content[:80]!r}"
        if kind == "huge":
            return _cut(content, HUGE_TEXT[:EDGE_MAX_OUTPUT], EDGE_MAX_OUTPUT, tally)
        return "" if content == edge_text(kind) else f"answer stored as {content[:80]!r}"
    if name == MCP_ECHO:
        text = str(arguments.get("text", ""))
        return "" if content == text else f"echo of {text!r} stored as {content[:80]!r}"
    if name == MCP_HUGE:
        return _cut(content, "", MCP_MAX_OUTPUT, tally)
    return "the server exits mid-call, yet the call was answered as done"  # MCP_DIE


def _cut(content: str, start: str, limit: int, tally: EdgeTally) -> str:
    tally.cut += 1
    if CUT_NOTE not in content or len(content) > limit + NOTE_ROOM:
        return f"{len(content):,} characters stored, not cut at {limit:,} with a note"
    if not content.startswith(start):
        return "the cut answer does not keep the answer's start"
    return ""


@dataclass(frozen=True, kw_only=True)
class StoredEntry:
    """One entry as the log store holds it: its bytes, not what a reader makes of them."""

    session: str
    seq: int
    data: bytes


async def stored_entries(log_store: str) -> list[StoredEntry]:
    """Every entry ``log_store`` (a node's ``log_store`` setting: a PostgreSQL DSN or
    ``sqlite:PATH``) holds, as bytes, read straight from its table: no decoder stands between
    them and the checker, since the decoders make whatever they read valid."""
    scheme, _, rest = log_store.partition(":")
    if scheme == "sqlite":
        path = unquote(urlsplit(log_store).path) if rest.startswith("//") else rest
        return await asyncio.to_thread(_sqlite_entries, path)
    import asyncpg

    connection = await asyncpg.connect(log_store, timeout=10)
    try:
        rows = await connection.fetch("SELECT session, seq, data FROM entries", timeout=120)
    finally:
        await connection.close(timeout=10)
    return [StoredEntry(session=r["session"], seq=r["seq"], data=bytes(r["data"])) for r in rows]


def _sqlite_entries(path: str) -> list[StoredEntry]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT session, seq, data FROM entries").fetchall()
    return [StoredEntry(session=session, seq=seq, data=bytes(data)) for session, seq, data in rows]


def stored_text_violations(stored: Iterable[StoredEntry]) -> list[str]:
    """The stored entries that are not valid UTF-8 JSON whose every string is valid Unicode
    (a ``"\\ud800"`` escape decodes to a lone surrogate), one line each."""
    violations: list[str] = []
    for entry in stored:
        where = f"{entry.session} seq {entry.seq}"
        try:
            parsed = json.loads(entry.data.decode("utf-8"))
        except UnicodeDecodeError as error:
            violations.append(f"{where} is stored as invalid UTF-8 ({error.reason})")
            continue
        except json.JSONDecodeError as error:
            violations.append(f"{where} is stored as no JSON ({error.msg})")
            continue
        invalid = [text for text in _strings(parsed) if not is_valid_text(text)]
        if invalid:
            shown = invalid[0].encode("utf-8", "backslashreplace").decode()[:80]
            violations.append(
                f"{where} stores {len(invalid)} strings with lone surrogates: {shown!r}"
            )
    return violations


def _strings(value: object) -> Iterable[str]:
    """Every string of a parsed JSON value, keys included."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
