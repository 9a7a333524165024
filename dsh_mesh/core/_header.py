"""Durable, write-once descriptions of sessions."""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from datetime import datetime

from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._ids import SessionId
from dsh_mesh.core._text import ValidText, bounded_quote


class SessionKind(enum.Enum):
    """What a session is in its tree. Only a continuable child can be messaged by its parent."""

    ROOT = "root"
    CONTINUABLE_CHILD = "continuable-child"
    ONE_SHOT_CHILD = "one-shot-child"


@dataclass(frozen=True, kw_only=True)
class ToolDescriptor(ValidText):
    """What a provider is told about one tool: name, description and JSON input schema.

    ``input_schema_json`` is canonical JSON (sorted keys, no spaces) so two descriptors of the same
    tool serialise byte-identically, which is what provider prompt caches compare.
    """

    _PROSE = frozenset({"description"})

    name: str
    description: str
    input_schema_json: str

    @staticmethod
    def of(name: str, description: str, input_schema: dict[str, object]) -> ToolDescriptor:
        return ToolDescriptor(
            name=name, description=description, input_schema_json=canonical_json(input_schema)
        )


@dataclass(frozen=True, kw_only=True)
class SessionSpec(ValidText):
    """How a session's agent is built: preset (system prompt + tool selection), model, tools.

    ``tools`` is the descriptor list fixed when the session was created; a resume may filter it
    but never adds to it.
    """

    preset: str
    model: str
    tools: tuple[ToolDescriptor, ...] = ()
    output_schema: str = ""
    """The JSON schema the session's answers must match, as canonical JSON; ``""``: none
    (ADR 0052)."""


@dataclass(frozen=True, kw_only=True)
class ForkOrigin:
    """A fork child inherits its parent's completed turns up to ``prefix_seq`` (inclusive)."""

    parent_session: SessionId
    prefix_seq: int


DEFAULT_NAMESPACE = "default"
"""The namespace of a root created without one, and of every session stored before sessions
had namespaces."""

_NAMESPACE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def check_namespace(name: str) -> str:
    """``name`` if it is a namespace name (a DNS label: 1 to 63 lowercase letters, digits and
    inner hyphens); :class:`InvalidArgument` otherwise."""
    if not _NAMESPACE.fullmatch(name):
        raise InvalidArgument(
            f"namespace {bounded_quote(name)} is not a name: 1 to 63 lowercase letters, digits and"
            " inner hyphens (a DNS label)"
        )
    return name


@dataclass(frozen=True, kw_only=True)
class SessionHeader:
    """The durable, create-only record of a session.

    ``parent_session`` is the authority for parent -> child messages: a parent may message a
    continuable child only if the child's header names it here. It is ``None`` exactly for roots.

    ``created_at`` is when the store wrote the header (UTC, by the writing node's clock); the
    store sets it on creation, and it is ``None`` on a header not written yet and on one
    written before the field existed. It is not part of the header's identity: two headers
    that differ only in it are equal.
    """

    session_id: SessionId
    kind: SessionKind
    parent_session: SessionId | None
    spec: SessionSpec
    fork_origin: ForkOrigin | None = field(default=None)
    namespace: str = DEFAULT_NAMESPACE
    """The namespace the session's whole tree belongs to: a root's is chosen at its creation,
    and every child has its parent's (a tree never crosses a namespace)."""
    created_at: datetime | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if (self.kind is SessionKind.ROOT) != (self.parent_session is None):
            raise InvalidArgument("a root has no parent_session and every child has one")
        if self.parent_session == self.session_id:
            raise InvalidArgument("a session cannot be its own parent")
        if self.fork_origin is not None and self.fork_origin.parent_session != self.parent_session:
            raise InvalidArgument("a fork inherits from its own parent only")
        check_namespace(self.namespace)


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no insignificant whitespace: equal values, equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
