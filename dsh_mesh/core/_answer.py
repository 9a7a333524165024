"""Structured answers: a JSON schema a session's final answer must match (ADR 0052).

A preset or a root names the schema; the session's spec keeps it, as canonical JSON, for
every activation of the session wherever it runs. A turn's final answer (a step with no tool
call, nothing left to read) is parsed and checked here. An answer that does not match is
answered with a correction (:func:`frame_answer_rejected`) and asked again; the one that
matches is the turn's ``output_json``, kept in its :class:`~dsh_mesh.core.TurnEndedEntry`
and carried by its settlement notice.

Pure: no I/O. :func:`answer_value` may take long on a hostile schema (a ``pattern`` that
backtracks), so its caller runs it off the event loop under a deadline.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final

import jsonschema
import jsonschema.exceptions
import referencing
import referencing.exceptions

from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._header import canonical_json
from dsh_mesh.core._json import parse_bounded, utf8_size

MAX_OUTPUT_SCHEMA_BYTES: Final = 64 * 1024
"""The largest output schema a preset or a root may name (its canonical JSON, UTF-8)."""

MAX_OUTPUT_SCHEMA_DEPTH: Final = 32
"""The deepest nesting of objects and arrays an output schema may have."""

MAX_OUTPUT_SCHEMA_OBJECTS: Final = 1_000
"""The most JSON objects (subschemas, roughly) an output schema may hold: checking a schema
against its meta-schema costs about 0.2 ms for each, so one is checked in a fifth of a
second at most."""

MAX_ANSWER_BYTES: Final = 512 * 1024
"""The longest answer (UTF-8) checked against a schema; a longer one does not match."""

MAX_OUTPUT_BYTES: Final = 256 * 1024
"""The largest value (its canonical JSON, UTF-8) an answer may have: with the answer's text
it fits a settlement notice."""

MAX_REJECTION_CHARS: Final = 1_000
"""The longest reason a rejected answer's correction quotes."""

ANSWER_RETRIES: Final = 2
"""How many times a turn whose answer does not match its schema is asked again before it ends
with outcome ``error``."""


class AnswerInvalid(Exception):
    """A final answer that is not a JSON value matching its schema; ``str()`` says why."""


def check_output_schema(schema: object) -> str:
    """The canonical JSON of ``schema``, a JSON schema given as a parsed value (a ``dict``):
    a non-empty object of at most :data:`MAX_OUTPUT_SCHEMA_BYTES`,
    :data:`MAX_OUTPUT_SCHEMA_DEPTH` deep and :data:`MAX_OUTPUT_SCHEMA_OBJECTS` objects, that
    refers only within itself, that its own meta-schema accepts (the draft its
    ``$schema`` names, else 2020-12). Raises :class:`InvalidArgument` saying what is wrong."""
    if not isinstance(schema, dict) or not schema:
        raise InvalidArgument("an output schema must be a non-empty JSON object")
    if _objects(schema, 0) > MAX_OUTPUT_SCHEMA_OBJECTS:
        raise InvalidArgument(
            f"an output schema may hold at most {MAX_OUTPUT_SCHEMA_OBJECTS:,} JSON objects"
        )
    _check_references(schema)
    try:
        text = canonical_json(schema)
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as error:
        raise InvalidArgument(
            "an output schema must be valid Unicode (a lone surrogate?)"
        ) from error
    except (TypeError, ValueError) as error:
        raise InvalidArgument(f"an output schema must be JSON: {error}") from error
    if size > MAX_OUTPUT_SCHEMA_BYTES:
        raise InvalidArgument(
            f"an output schema may have at most {MAX_OUTPUT_SCHEMA_BYTES:,} bytes of JSON"
        )
    try:
        _validator_class(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as error:
        raise InvalidArgument(f"not a valid JSON schema: {_bounded(error.message)}") from error
    except jsonschema.exceptions.UnknownType as error:  # pragma: no cover - draft-dependent
        raise InvalidArgument(f"not a valid JSON schema: {_bounded(str(error))}") from error
    return text


def parse_output_schema(text: str) -> str:
    """:func:`check_output_schema` of the JSON ``text`` (a wire field, a file); ``""`` for
    ``""`` (no schema). Its size and depth are bounded before it is parsed
    (:func:`~dsh_mesh.core.parse_bounded`)."""
    if not text:
        return ""
    value = parse_bounded(
        text, max_depth=MAX_OUTPUT_SCHEMA_DEPTH, max_bytes=MAX_OUTPUT_SCHEMA_BYTES
    )
    return check_output_schema(value)


def answer_value(text: str, schema_json: str) -> str:
    """The canonical JSON of the value the answer ``text`` holds, when it matches the schema
    ``schema_json`` (as :func:`check_output_schema` made it). The answer is JSON, alone or in
    one fenced code block (```` ```json ````), around which whitespace is ignored. Raises
    :class:`AnswerInvalid` saying why it does not match."""
    if utf8_size(text) > MAX_ANSWER_BYTES:
        raise AnswerInvalid(f"the answer is longer than {MAX_ANSWER_BYTES:,} bytes")
    body = _unfenced(text.strip())
    if not body:
        raise AnswerInvalid("the answer is empty; it must be a JSON value")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise AnswerInvalid(f"the answer is not JSON: {_bounded(str(error))}") from error
    schema = json.loads(schema_json)
    # An empty registry: a reference is resolved within the schema, never retrieved.
    validator = _validator_class(schema)(schema, registry=referencing.Registry())
    try:
        failure = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except referencing.exceptions.Unresolvable as unresolvable:
        reason = f"the schema has a reference it cannot resolve: {unresolvable}"
        raise AnswerInvalid(reason) from None
    except RecursionError:
        raise AnswerInvalid("the answer nests too deep to check") from None
    if failure is not None:
        where = "".join(f"[{json.dumps(part)}]" for part in failure.absolute_path)
        at = f" at {where}" if where else ""
        raise AnswerInvalid(
            f"the answer does not match the schema{at}: {_bounded(failure.message)}"
        )
    output = canonical_json(value)
    try:
        size = len(output.encode("utf-8"))
    except UnicodeEncodeError:
        raise AnswerInvalid("the answer holds text that is not valid Unicode") from None
    if size > MAX_OUTPUT_BYTES:
        raise AnswerInvalid(f"its value has {size:,} bytes of JSON; at most {MAX_OUTPUT_BYTES:,}")
    return output


def output_instruction(schema_json: str) -> str:
    """What a task that names an output schema ends with: the schema, and to answer with a
    JSON value matching it. Appended to the task, never to the system prompt, so the request
    head stays the preset's (and a fork's stays its parent's)."""
    return (
        "When you finish, your final answer must be only a JSON value that matches this JSON"
        f" schema:\n{schema_json}"
    )


def with_output_instruction(task: str, schema_json: str) -> str:
    """``task``, ended with :func:`output_instruction` when the session names an output schema
    (an empty task stays empty: the session waits for a prompt)."""
    if not task or not schema_json:
        return task
    return f"{task}\n\n{output_instruction(schema_json)}"


def frame_answer_rejected(reason: str, schema_json: str) -> str:
    """The model-visible correction after a final answer that did not match: why, and the
    schema again."""
    return (
        f"Your answer cannot be accepted: {reason}\n"
        "Answer again with only a JSON value that matches this JSON schema:\n"
        f"{schema_json}"
    )


def _unfenced(text: str) -> str:
    if not text.startswith("```") or not text.endswith("```") or len(text) < 6:
        return text
    inner = text[3:-3]
    first, newline, rest = inner.partition("\n")
    if newline and (not first.strip() or first.strip().isalnum()):
        return rest.strip()  # ```json\n...\n``` or ```\n...\n```
    return inner.strip()


def _validator_class(schema: dict[str, Any]) -> Any:
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


_REFERENCES: Final = ("$ref", "$dynamicRef", "$recursiveRef")
_DATA: Final = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are data, not schemas: a ``$ref`` in them refers to nothing."""


def _check_references(value: object) -> None:
    """Refuse a reference out of the schema (a URL, another file): the node never fetches
    anything because of a schema. (A ``$ref`` whose value is not text is a property's name,
    and data keywords hold no references.)"""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in _REFERENCES and isinstance(item, str) and not item.startswith("#"):
                raise InvalidArgument(
                    f"an output schema may only refer within itself ({key} starts with #),"
                    f" not to {item[:200]!r}"
                )
            if key not in _DATA:
                _check_references(item)
    elif isinstance(value, list):
        for item in value:
            _check_references(item)


def _objects(value: object, depth: int) -> int:
    """How many JSON objects ``value`` holds (itself included); :class:`InvalidArgument` when
    it nests deeper than :data:`MAX_OUTPUT_SCHEMA_DEPTH`. Stops counting past the limit."""
    if depth > MAX_OUTPUT_SCHEMA_DEPTH:
        raise InvalidArgument(
            f"an output schema may nest at most {MAX_OUTPUT_SCHEMA_DEPTH} levels deep"
        )
    count = 0
    if isinstance(value, dict):
        count = 1
        items: Iterable[object] = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return 0
    for item in items:
        count += _objects(item, depth + 1)
        if count > MAX_OUTPUT_SCHEMA_OBJECTS:
            break
    return count


def _bounded(text: str) -> str:
    if len(text) <= MAX_REJECTION_CHARS:
        return text
    return text[:MAX_REJECTION_CHARS] + "…"
