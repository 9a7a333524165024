"""The one place where domain values become the bytes stored in etcd, and back.

Format (version 10). Every stored value is one JSON object: UTF-8, compact (no insignificant
whitespace), keys sorted, non-ASCII written as itself, so equal values are equal bytes. Wrapped
here; ``tests/unit/test_codec.py`` pins the exact bytes of every kind::

    header      {"created_at":"2025-01-02T03:04:05.000006+00:00","fork_origin":null,
                 "kind":"root","namespace":"default","parent_session":null,"session_id":"s-1",
                 "spec":{"model":"m","preset":"lead","tools":[]},"v":6}
    activation  {"activation_id":"a-1","node_id":"n-1","parent_activation":null,
                 "session_id":"s-1","v":6}
    entry       {"at":"2025-01-02T03:04:05.000006+00:00","content":"hello",
                 "idempotency_key":"k-1","type":"human_prompt","v":6}
    acceptance  {"fingerprint":"f","kind":"steered","seq":3,"target":"s-2",
                 "target_activation":"a-2","v":6}

- ``"v"`` is the format version; only the outermost object carries it.
- ``"type"`` tags a transcript entry with a stable name (see ``ENTRY_TAGS``), never a Python
  class name, so classes may be renamed freely.
- ``"at"`` (entries only, from version 4) is when the record was written, the
  ``Record.recorded_at`` of the entry (see :func:`decode_record`), or ``null`` when the writer
  gave none.
- A ``datetime`` is an ISO 8601 string in UTC with microseconds and ``+00:00``, exactly as
  ``datetime.isoformat(timespec="microseconds")`` writes it; a naive one cannot be stored.
- Every other key is a dataclass field name, and every field is written, defaults included.
  Nested dataclasses are plain objects, tuples are arrays, ``None`` is ``null``, enums are their
  ``.value`` and ids are strings.
- Every value is valid UTF-8. A ``str`` holding lone surrogates (no valid UTF-8 can, a Python
  ``str`` can: think of tool output decoded with ``surrogateescape``) never gets here from an
  entry, which makes its text valid when it is built (``core/_text.py``); any other value has
  them replaced with U+FFFD on the way out. Values that code before that boundary stored with
  ``surrogatepass`` still decode: the entry built from them makes its text valid, so such a
  transcript reads again.

Decoding is strict: the exact set of fields the value's version stores, exact JSON types
(``true`` is not an int), no duplicate keys, a known tag and version; anything else raises
:class:`CodecError`.

Changing any of this changes what is already stored: renaming or adding a field of a stored
dataclass (even one with a default), renaming a tag, or changing an enum's value. Such a change
needs a bump of ``FORMAT_VERSION`` together with a decoder that still reads every older version.

Version history (encoders write only the newest; decoders read every one in
``READABLE_VERSIONS``):

1. The first format.
2. ``agent_message`` and ``settlement_notice`` entries gain ``"trace"``, a W3C ``traceparent``
   or ``""``. A version-1 value of either lacks the field, which then decodes as ``""``; a
   version-1 value that has it is rejected like any other unexpected field. Every other kind is
   stored exactly as in version 1 apart from ``"v"``.
3. ``agent_message`` entries gain ``"delivery"``: how the message was delivered when accepted,
   a ``DeliveryKind`` value (``"steered"``, ``"started-turn"``, ``"cold-resumed"``) or ``null``.
   A version-1 or version-2 value lacks the field, which then decodes as ``None``; one that has
   it is rejected like any other unexpected field. Every other kind is stored exactly as in
   version 2 apart from ``"v"``.

4. Every entry gains the envelope key ``"at"`` (above); a header gains ``"created_at"`` (a
   datetime or ``null``); ``agent_message`` and ``human_prompt`` entries gain
   ``"idempotency_key"`` (the key the sender or the human gave, ``""`` for none);
   ``turn_started`` entries gain ``"node_id"`` and ``"activation_id"`` (where the turn ran).
   An older value lacks them all: ``"at"`` and ``"created_at"`` decode as ``None``, the
   strings as ``""``; an older value that has one is rejected like any other unexpected field.
   Activations and acceptances are stored exactly as in version 3 apart from ``"v"``.
5. ``tool_result`` entries gain ``"duration_ms"`` (how long the call ran on its node; 0 when
   it did not run there). An older value lacks it and decodes as 0. Everything else is stored
   exactly as in version 4 apart from ``"v"``.

6. A header gains ``"namespace"`` (the session's tree's namespace). An older header lacks it and
   decodes as ``"default"``. Everything else is stored exactly as in version 5 apart from
   ``"v"``.

7. Two entry kinds are new: ``compaction`` (a :class:`CompactionEntry`: the summary, its range,
   the task and pending seqs it keeps, the turn open when it was written, the summary call's
   model and usage) and ``tool_outputs_cleared`` (a :class:`ToolOutputsClearedEntry`). No
   older value has them. Everything else is stored exactly as in version 6 apart from ``"v"``.
8. Two entry kinds are new: ``approval_request`` (an :class:`ApprovalRequestEntry`: the call,
   its tool and arguments, the tool's descriptor digest, when it expires) and
   ``approval_decision`` (an :class:`ApprovalDecisionEntry`). No older value has them.
   ``turn_started`` entries (and a compaction's ``open_turn``) gain ``"trace"``, the turn
   span's ``traceparent`` or ``""``; an older value lacks it and decodes as ``""``. Everything
   else is stored exactly as in version 7 apart from ``"v"``.

9. A tool call (in an ``assistant_step`` entry, and in a ``fork_prefix`` entry's messages)
   gains ``"given_id"`` (the id the model gave when the step records the call under another,
   or ``null``) and ``"refused"`` (why the call is never run, or ``""``): ADR 0038. An older
   value lacks them and decodes as ``null`` and ``""``. Everything else is stored exactly as
   in version 8 apart from ``"v"``.

10. A session's spec gains ``"output_schema"`` (the JSON schema its answers must match, as
    canonical JSON, or ``""``); a ``turn_ended`` entry and a ``settlement_notice`` gain
    ``"output_json"`` (the answer's JSON value, or ``""``); and there is a new
    ``answer_rejected`` entry (ADR 0052). An older value lacks the fields and decodes as
    ``""``. Everything else is stored exactly as in version 9 apart from ``"v"``.

``_ADDED_IN`` is the table of fields added after version 1.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Final, Literal, NewType, TypeVar, Union

from dsh_mesh.core import (
    Activation,
    AgentMessageEntry,
    AnswerRejectedEntry,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    Entry,
    ForkPrefixEntry,
    HumanPromptEntry,
    MeshError,
    Record,
    SessionHeader,
    SessionSpec,
    SettlementNoticeEntry,
    TaskEntry,
    ToolCall,
    ToolOutputsClearedEntry,
    ToolResultEntry,
    TreeStop,
    TurnEndedEntry,
    TurnStartedEntry,
    valid_text,
)
from dsh_mesh.runtime import Acceptance

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")

FORMAT_VERSION: Final = 10
"""The version every encoder writes (see the module docstring for the history)."""

READABLE_VERSIONS: Final = frozenset(range(1, FORMAT_VERSION + 1))
"""Every version the decoders accept: the current one and each older one still in etcd."""

ENTRY_TAGS: Final[Mapping[str, type[Entry]]] = types.MappingProxyType(
    {
        "task": TaskEntry,
        "human_prompt": HumanPromptEntry,
        "agent_message": AgentMessageEntry,
        "settlement_notice": SettlementNoticeEntry,
        "fork_prefix": ForkPrefixEntry,
        "turn_started": TurnStartedEntry,
        "consumed": ConsumedEntry,
        "assistant_step": AssistantStepEntry,
        "tool_result": ToolResultEntry,
        "turn_ended": TurnEndedEntry,
        "compaction": CompactionEntry,
        "tool_outputs_cleared": ToolOutputsClearedEntry,
        "approval_request": ApprovalRequestEntry,
        "approval_decision": ApprovalDecisionEntry,
        "answer_rejected": AnswerRejectedEntry,
    }
)
"""The stored ``"type"`` tag of each transcript entry class. Tags are part of the format."""

_TAG_ADDED_IN: Final[Mapping[str, int]] = types.MappingProxyType(
    {
        "compaction": 7,
        "tool_outputs_cleared": 7,
        "approval_request": 8,
        "approval_decision": 8,
        "answer_rejected": 10,
    }
)
"""The version that added each entry kind after version 1: an older value cannot have it."""

_TAG_OF: Final[Mapping[type[Entry], str]] = {cls: tag for tag, cls in ENTRY_TAGS.items()}

_ADDED_IN: Final[Mapping[type, Mapping[str, int]]] = types.MappingProxyType(
    {
        AgentMessageEntry: {"trace": 2, "delivery": 3, "idempotency_key": 4},
        SettlementNoticeEntry: {"trace": 2, "output_json": 10},
        HumanPromptEntry: {"idempotency_key": 4},
        TurnStartedEntry: {"node_id": 4, "activation_id": 4, "trace": 8},
        SessionHeader: {"created_at": 4, "namespace": 6},
        ToolResultEntry: {"duration_ms": 5},
        ToolCall: {"given_id": 9, "refused": 9},
        SessionSpec: {"output_schema": 10},
        TurnEndedEntry: {"output_json": 10},
    }
)
"""Fields of a stored dataclass that older versions lack, with the version that added each.
Decoding an older value leaves them out, so each must have a default, which it then takes."""

_VERSION_KEY: Final = "v"
_TAG_KEY: Final = "type"
_AT_KEY: Final = "at"
_AT_ADDED_IN: Final = 4


class CodecError(MeshError):
    """Stored bytes are not a value of the expected kind in a format version this code reads.

    Raised by every ``decode_*`` function (from the underlying error, when there is one); the
    message names the offending path, e.g. ``entry(assistant_step).usage.input_tokens``.
    Retrying cannot help: the stored value is corrupt or was written by an incompatible version.
    """


# -- public API -------------------------------------------------------------------------------


def encode_header(header: SessionHeader) -> bytes:
    """The stored form of a session header. Pure and deterministic: equal headers, equal bytes."""
    return _encode(header, tag=None)


def decode_header(data: bytes) -> SessionHeader:
    """The header ``encode_header`` stored as ``data``; raises :class:`CodecError` otherwise
    (including a header that breaks :class:`SessionHeader`'s own invariants)."""
    return _decode(SessionHeader, *_open(data, "header", tagged=False), "header")


def encode_activation(activation: Activation) -> bytes:
    """The stored form of an activation. Pure and deterministic: equal values, equal bytes."""
    return _encode(activation, tag=None)


def decode_activation(data: bytes) -> Activation:
    """The activation ``encode_activation`` stored as ``data``; raises :class:`CodecError`
    otherwise."""
    return _decode(Activation, *_open(data, "activation", tagged=False), "activation")


def encode_stop(stop: TreeStop) -> bytes:
    """The stored form of a subtree's stop. Pure and deterministic: equal values, equal bytes."""
    return _encode(stop, tag=None)


def decode_stop(data: bytes) -> TreeStop:
    """The stop ``encode_stop`` stored as ``data``; raises :class:`CodecError` otherwise."""
    return _decode(TreeStop, *_open(data, "stop", tagged=False), "stop")


def encode_entry(entry: Entry, *, recorded_at: datetime | None = None) -> bytes:
    """The stored form of a transcript entry, tagged with its ``ENTRY_TAGS`` name, with
    ``recorded_at`` (when it is written) as ``"at"``. Pure and deterministic: equal arguments,
    equal bytes. Raises ``TypeError`` for a non-entry or a naive ``recorded_at``."""
    tag = _TAG_OF.get(type(entry))
    if tag is None:
        raise TypeError(f"{type(entry).__name__} is not a transcript entry")
    return _encode(entry, tag=tag, at=recorded_at)


def decode_entry(data: bytes) -> Entry:
    """The entry ``encode_entry`` stored as ``data``, of the class its tag names; raises
    :class:`CodecError` otherwise (including an unknown tag)."""
    return decode_record(0, data).entry


def decode_record(seq: int, data: bytes) -> Record:
    """The record at ``seq`` whose entry ``encode_entry`` stored as ``data``: the entry and
    when it was written (``recorded_at``, ``None`` for a value older than version 4 or
    written without one); raises :class:`CodecError` like :func:`decode_entry`."""
    fields, version = _open(data, "entry", tagged=True)
    tag = fields.pop(_TAG_KEY)
    cls = ENTRY_TAGS.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise CodecError(f"entry: unknown type tag {tag!r}")
    if version < _TAG_ADDED_IN.get(str(tag), 1):
        raise CodecError(f"entry: no {tag!r} entry exists in format version {version}")
    at: datetime | None = None
    if version >= _AT_ADDED_IN:
        if _AT_KEY not in fields:
            raise CodecError(
                f"entry({tag}): missing fields ['{_AT_KEY}'] (format version {version})"
            )
        stored = fields.pop(_AT_KEY)
        at = None if stored is None else _datetime(stored, f"entry({tag}).{_AT_KEY}")
    entry = _decode(cls, fields, version, f"entry({tag})")
    return Record(seq=seq, entry=entry, recorded_at=at)


def encode_acceptance(acceptance: Acceptance) -> bytes:
    """The stored form of an idempotency record. Pure and deterministic: equal values, equal
    bytes."""
    return _encode(acceptance, tag=None)


def decode_acceptance(data: bytes) -> Acceptance:
    """The acceptance ``encode_acceptance`` stored as ``data``; raises :class:`CodecError`
    otherwise."""
    return _decode(Acceptance, *_open(data, "acceptance", tagged=False), "acceptance")


# -- encoding ---------------------------------------------------------------------------------


def _encode(value: DataclassInstance, *, tag: str | None, at: datetime | None = None) -> bytes:
    fields = _fields_to_json(value)
    envelope: dict[str, object] = {_VERSION_KEY: FORMAT_VERSION}
    if tag is not None:
        envelope[_TAG_KEY] = tag
        envelope[_AT_KEY] = _to_json(at)
    if clash := envelope.keys() & fields.keys():
        # A field named like an envelope key would be silently overwritten on the way out.
        raise TypeError(f"{type(value).__name__} has fields reserved by the codec: {clash}")
    text = json.dumps(
        fields | envelope,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return text.encode("utf-8")


def _fields_to_json(value: DataclassInstance) -> dict[str, object]:
    return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}


def _to_json(value: object) -> object:
    if isinstance(value, str):
        return valid_text(value)[0]
    if value is None or isinstance(value, int):  # bool is an int
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        if value.utcoffset() is None:
            raise TypeError("the codec cannot store a naive datetime")
        return value.astimezone(UTC).isoformat(timespec="microseconds")
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields_to_json(value)
    raise TypeError(f"the codec cannot store a {type(value).__name__}")


# -- decoding ---------------------------------------------------------------------------------


def _open(data: bytes, what: str, *, tagged: bool) -> tuple[dict[str, object], int]:
    """Parse ``data`` into its top-level object and its format version, stripping the version
    from the object (the tag stays in for the caller when ``tagged``)."""
    try:
        parsed = json.loads(
            data.decode("utf-8", "surrogatepass"),
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
        )
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise CodecError(f"{what}: not a JSON document: {exc}") from exc
    if not isinstance(parsed, dict):
        raise CodecError(f"{what}: expected a JSON object, got {_json_kind(parsed)}")
    fields: dict[str, object] = parsed
    version = fields.pop(_VERSION_KEY, None)
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise CodecError(f"{what}: unsupported format version {version!r}")
    if tagged and _TAG_KEY not in fields:
        raise CodecError(f"{what}: missing type tag")
    return fields, version


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return result


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _decode(cls: type[_D], data: object, version: int, path: str) -> _D:
    """Build the dataclass ``cls`` from a JSON object holding exactly the fields ``version``
    stores of it; a field added after ``version`` takes its default."""
    if not isinstance(data, dict):
        raise CodecError(f"{path}: expected an object, got {_json_kind(data)}")
    hints = _field_types(cls, version)
    missing = sorted(hints.keys() - data.keys())
    extra = sorted(data.keys() - hints.keys())
    if missing or extra:
        raise CodecError(
            f"{path}: missing fields {missing}, unexpected fields {extra}"
            f" (format version {version})"
        )
    kwargs = {
        name: _from_json(tp, data[name], version, f"{path}.{name}") for name, tp in hints.items()
    }
    try:
        return cls(**kwargs)
    except (MeshError, TypeError, ValueError) as exc:  # a __post_init__ invariant
        raise CodecError(f"{path}: {exc}") from exc


@functools.cache
def _field_types(cls: type[DataclassInstance], version: int) -> dict[str, object]:
    """The annotation of each field ``version`` stores of ``cls``."""
    hints = typing.get_type_hints(cls)
    added = _ADDED_IN.get(cls, {})
    stored: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if added.get(f.name, 0) <= version:
            stored[f.name] = hints[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            # A bug in _ADDED_IN, not in the stored bytes: an older value cannot be built.
            raise TypeError(
                f"{cls.__name__}.{f.name} was added in a later version but has no default"
            )
    return stored


def _from_json(tp: object, data: object, version: int, path: str) -> object:
    """Check ``data`` against the annotation ``tp`` and build the value it stands for.

    Only the shapes stored values use are supported; any other annotation is a bug here, hence
    ``TypeError`` rather than :class:`CodecError`.
    """
    if isinstance(tp, NewType):
        return _from_json(tp.__supertype__, data, version, path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if any(type(data) is type(arg) and data == arg for arg in args):
            return data
        raise CodecError(f"{path}: expected one of {list(args)}, got {data!r}")
    if origin is types.UnionType or origin is Union:
        if data is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # only ``X | None`` is stored
            return _from_json(options[0], data, version, path)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(data, list):
            raise CodecError(f"{path}: expected an array, got {_json_kind(data)}")
        return tuple(
            _from_json(args[0], item, version, f"{path}[{i}]") for i, item in enumerate(data)
        )
    if tp in (str, int, bool):
        if type(data) is not tp:  # exact: a JSON true is not an int, a float is not an int
            raise CodecError(f"{path}: expected {_JSON_KINDS[tp]}, got {_json_kind(data)}")
        return data
    if tp is datetime:
        return _datetime(data, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if type(member.value) is type(data) and member.value == data:
                return member
        raise CodecError(f"{path}: {data!r} is not a {tp.__name__}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode(tp, data, version, path)
    raise TypeError(f"{path}: the codec has no rule for {tp!r}")


def _datetime(data: object, path: str) -> datetime:
    """The UTC datetime ``data`` stores, which must be written exactly as ``_to_json`` writes
    it (so equal values stay equal bytes)."""
    if not isinstance(data, str):
        raise CodecError(f"{path}: expected a string, got {_json_kind(data)}")
    try:
        value = datetime.fromisoformat(data)
    except ValueError as exc:
        raise CodecError(f"{path}: {data!r} is not an ISO 8601 time") from exc
    if value.utcoffset() != timedelta(0) or _to_json(value) != data:
        raise CodecError(f"{path}: {data!r} is not a UTC time with microseconds")
    return value


_JSON_KINDS: Final[Mapping[type, str]] = {
    type(None): "null",
    bool: "a boolean",
    str: "a string",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
}


def _json_kind(data: object) -> str:
    """How a parsed JSON value reads in an error message (parsing yields exact types)."""
    return _JSON_KINDS.get(type(data), type(data).__name__)
