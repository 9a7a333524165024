"""Identifiers of the mesh: sessions, activations, nodes, turns.

A session id is what a model names as ``agent_id``. Ids are opaque strings; the mesh never routes
by splitting them.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import secrets
from collections.abc import Iterator
from typing import NewType, Protocol

from dsh_mesh.core._errors import InvalidArgument
from dsh_mesh.core._text import bounded_quote

SessionId = NewType("SessionId", str)
ActivationId = NewType("ActivationId", str)
NodeId = NewType("NodeId", str)
TurnId = NewType("TurnId", str)

_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def parse_session_id(text: str) -> SessionId:
    """Validate a session id supplied from outside (a model's ``agent_id``, a wire field).

    Raises :class:`InvalidArgument` for an empty, over-long or malformed id; never returns a
    value that could alias another session after normalisation (no trimming is done).
    """
    if not isinstance(text, str) or not _ID_PATTERN.fullmatch(text):
        shown = bounded_quote(text) if isinstance(text, str) else type(text).__name__
        raise InvalidArgument(f"agent_id {shown} is not a valid session id")
    return SessionId(text)


class IdFactory(Protocol):
    """Mints fresh ids. Implementations must never return the same id twice in a process."""

    def session_id(self) -> SessionId: ...

    def child_session_id(self, parent: SessionId, call_key: str) -> SessionId:
        """The id of the child that the spawn call ``call_key`` of ``parent`` creates: the same
        id every time it is asked for that call, so one call can never create two children
        (a call repeated after its host stopped finds the child the first try made)."""
        ...

    def activation_id(self) -> ActivationId: ...

    def turn_id(self) -> TurnId: ...


class RandomIds:
    """Unguessable ids for production: ``s-``/``a-``/``t-`` followed by 96 random bits."""

    def session_id(self) -> SessionId:
        return SessionId(f"s-{secrets.token_hex(12)}")

    def child_session_id(self, parent: SessionId, call_key: str) -> SessionId:
        """Derived from the parent's (random) id and the call: any node, any process, gets the
        same id for the same call; nobody who does not know the parent's id can guess it."""
        digest = hashlib.sha256(f"{parent}\0{call_key}".encode()).hexdigest()
        return SessionId(f"s-{digest[:24]}")

    def activation_id(self) -> ActivationId:
        return ActivationId(f"a-{secrets.token_hex(12)}")

    def turn_id(self) -> TurnId:
        return TurnId(f"t-{secrets.token_hex(8)}")


class SequentialIds:
    """Readable, deterministic ids for tests and the demo (``s-1``, ``a-1``, ``t-1``...).

    Only unique within one factory: never share a registry between two of them.
    """

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._counters: dict[str, Iterator[int]] = {}
        self._children: dict[tuple[SessionId, str], SessionId] = {}

    def _next(self, kind: str) -> str:
        counter = self._counters.setdefault(kind, itertools.count(1))
        return f"{self._prefix}{kind}-{next(counter)}"

    def session_id(self) -> SessionId:
        return SessionId(self._next("s"))

    def child_session_id(self, parent: SessionId, call_key: str) -> SessionId:
        """The next readable id the first time a call asks, the same one after (for this
        factory's life: enough for one process with an in-memory store)."""
        known = self._children.get((parent, call_key))
        if known is None:
            known = self._children[parent, call_key] = self.session_id()
        return known

    def activation_id(self) -> ActivationId:
        return ActivationId(self._next("a"))

    def turn_id(self) -> TurnId:
        return TurnId(self._next("t"))
