"""What a model returns, as a step records it (docs/adr/0038-what-a-model-returns.md).

A model (or the endpoint in front of it) may send anything: two calls of one step under the
same id, an empty id, an id of a megabyte, arguments nested 100,000 deep or larger than the
log store takes, a million calls. :func:`recorded_step` is the one place that turns such an
answer into the :class:`~dsh_mesh.core.AssistantStepEntry` that is stored, so that everything
after it (results, approvals, the checker, the provider shown the conversation again) binds
each call by an id that is its own, and the step always fits one entry:

- every call id is unique in its step and well formed (1 to :data:`MAX_CALL_ID_CHARS`
  characters of ``A-Z a-z 0-9 _ . : -``). An id the model gave that is so, and is the first of
  its step to be so, is kept; any other is replaced (``c-1`` given twice: the second becomes
  ``c-1_2``; an empty or malformed id at place ``i``: ``call_i``), avoiding every id kept, and
  the call records the id it was given (``given_id``, its first characters when long). The
  choice depends only on the step's calls, in order: any node makes the same one;
- a step keeps at most :data:`MAX_CALLS_PER_STEP` calls; its text says how many more there
  were (they never run and get no result);
- a tool name is at most :data:`MAX_TOOL_NAME_CHARS` characters (a longer one names no tool);
- a call whose arguments nest deeper than :data:`MAX_ARGUMENTS_DEPTH`, or would take the
  step past :data:`MAX_STEP_BYTES`, is recorded with ``"{}"`` in their place and a ``refused``
  reason, which is its result: it never runs and is never asked for approval;
- the text is cut, with a note, to what the step has left of :data:`MAX_STEP_BYTES`.

Sizes are counted as stored: the UTF-8 of the JSON string the codec writes (escapes included),
so :data:`MAX_STEP_BYTES` plus the entry's own fields stays inside the log store's entry limit.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Final

from dsh_mesh.core._chat import ToolCall, Usage
from dsh_mesh.core._json import MAX_JSON_DEPTH, json_depth
from dsh_mesh.core._transcript import AssistantStepEntry

MAX_CALL_ID_CHARS: Final = 64
"""The longest call id a step records (OpenAI refuses longer ones sent back, some of its
deployments anything past 40: the ids this module makes are shorter)."""

MAX_TOOL_NAME_CHARS: Final = 128
"""The longest tool name a step records; a longer one is cut (and names no tool)."""

MAX_CALLS_PER_STEP: Final = 64
"""The most tool calls one step records; the model is told of the rest in its step's text."""

MAX_ARGUMENTS_DEPTH: Final = MAX_JSON_DEPTH
"""The deepest nesting of a call's arguments a step records (64)."""

MAX_STEP_BYTES: Final = 1024 * 1024
"""The most a step's text and calls take as stored (1 MiB): the log store's entry limit is
64 KiB more, for the entry's other fields."""

_WELL_FORMED_ID: Final = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_CALL_ID_CHARS}}}")
_CALL_FRAME: Final = 512
"""What a call takes as stored besides its id, name, given id and arguments: field names,
punctuation and a refusal (every refusal text here is shorter)."""


def stored_size(text: str) -> int:
    """How many bytes ``text`` takes in a stored entry: the UTF-8 of its JSON string."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return len(text) + 2
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def recorded_step(text: str, calls: Sequence[ToolCall], usage: Usage) -> AssistantStepEntry:
    """The step a model's answer (``text`` and ``calls``, as the provider gave them) is
    recorded as: see the module's docstring. Pure and deterministic; applying it to a step it
    made returns an equal step."""
    kept = list(calls[:MAX_CALLS_PER_STEP])
    notes: list[str] = []
    if len(calls) > len(kept):
        notes.append(
            f"[dsh-mesh: this step asked for {len(calls) - len(kept)} more tool calls than the"
            f" {MAX_CALLS_PER_STEP} a step may make; they were not recorded and did not run]"
        )
    named = [_bounded_name(call) for call in _unique_ids(kept)]
    budget = MAX_STEP_BYTES - sum(_frame(call) for call in named)
    budget -= sum(stored_size(note) + 1 for note in notes)
    recorded: list[ToolCall] = []
    for call in named:
        call, used = _bounded_arguments(call, budget)
        budget -= used
        recorded.append(call)
    body = _cut(text, budget)
    return AssistantStepEntry(
        text="\n".join([body, *notes]) if notes else body,
        tool_calls=tuple(recorded),
        usage=usage,
    )


def _unique_ids(calls: Sequence[ToolCall]) -> list[ToolCall]:
    keeps: list[bool] = []
    taken: set[str] = set()
    for call in calls:
        keep = bool(_WELL_FORMED_ID.fullmatch(call.call_id)) and call.call_id not in taken
        keeps.append(keep)
        if keep:
            taken.add(call.call_id)
    unique: list[ToolCall] = []
    for index, (call, keep) in enumerate(zip(calls, keeps, strict=True)):
        if keep:
            unique.append(call)
            continue
        own = call.call_id
        base = own if _WELL_FORMED_ID.fullmatch(own) else f"call_{index}"
        new = _free(base, taken)
        taken.add(new)
        given = _given(own) if call.given_id is None else call.given_id
        unique.append(dataclasses.replace(call, call_id=new, given_id=given))
    return unique


def _free(base: str, taken: set[str]) -> str:
    """``base``, or ``base_2``, ``base_3``... (``base`` cut to fit): the first not taken."""
    if base not in taken:
        return base
    number = 2
    while True:
        suffix = f"_{number}"
        candidate = base[: MAX_CALL_ID_CHARS - len(suffix)] + suffix
        if candidate not in taken:
            return candidate
        number += 1


def _given(given: str) -> str:
    """What a call records of the id it was given: all of it, or its first characters."""
    if len(given) <= MAX_CALL_ID_CHARS:
        return given
    return f"{given[:MAX_CALL_ID_CHARS]}... ({len(given) - MAX_CALL_ID_CHARS} more characters)"


def _bounded_name(call: ToolCall) -> ToolCall:
    if len(call.name) <= MAX_TOOL_NAME_CHARS:
        return call
    return dataclasses.replace(call, name=call.name[:MAX_TOOL_NAME_CHARS])


def _frame(call: ToolCall) -> int:
    return (
        stored_size(call.call_id)
        + stored_size(call.name)
        + stored_size(call.given_id or "")
        + _CALL_FRAME
    )


def _bounded_arguments(call: ToolCall, budget: int) -> tuple[ToolCall, int]:
    """``call`` as recorded within ``budget`` bytes of arguments, and the bytes it used."""
    if call.refused:
        return call, 0
    size = stored_size(call.arguments_json)
    if size > budget:
        if size > MAX_STEP_BYTES:
            why = f"its arguments are larger than {MAX_STEP_BYTES} bytes ({size} bytes as stored)"
        else:
            why = (
                f"this step's arguments together are larger than {MAX_STEP_BYTES} bytes (this"
                f" call's take {size})"
            )
        return _refuse(call, why), 0
    if json_depth(call.arguments_json) > MAX_ARGUMENTS_DEPTH:
        return _refuse(call, f"its arguments are nested deeper than {MAX_ARGUMENTS_DEPTH}"), 0
    return call, size


def _refuse(call: ToolCall, why: str) -> ToolCall:
    refused = f"not run: {why}; they were not recorded. Send smaller arguments."
    return dataclasses.replace(call, arguments_json="{}", refused=refused)


def _cut(text: str, budget: int) -> str:
    """``text``, or its longest prefix that fits ``budget`` stored bytes with a note of what
    was cut."""
    if stored_size(text) <= budget:
        return text
    note_room = 200
    low, high = 0, len(text)
    while low < high:  # the longest prefix that fits
        middle = (low + high + 1) // 2
        if stored_size(text[:middle]) <= budget - note_room:
            low = middle
        else:
            high = middle - 1
    cut = len(text) - low
    return (
        f"{text[:low]}\n[dsh-mesh: {cut} more characters of this step's text were cut: a step"
        f" is recorded in at most {MAX_STEP_BYTES} bytes]"
    )
