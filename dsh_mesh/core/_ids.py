"""Identifiers of the mesh: sessions, activations, nodes, turns.

A session id is what a model names as ``agent_id``. Ids are opaque strings; the mesh never routes
by splitting them.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Iterator
from typing import NewType, Protocol

from dsh_mesh.core._errors import InvalidArgument

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
        raise InvalidArgument(f"agent_id {text!r} is not a valid session id")
    return SessionId(text)


class IdFactory(Protocol):
    """Mints fresh ids. Implementations must never return the same id twice in a process."""

    def session_id(self) -> SessionId: ...

    def activation_id(self) -> ActivationId: ...

    def turn_id(self) -> TurnId: ...


class RandomIds:
    """Unguessable ids for production: ``s-``/``a-``/``t-`` followed by 96 random bits."""

    def session_id(self) -> SessionId:
        return SessionId(f"s-{secrets.token_hex(12)}")

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

    def _next(self, kind: str) -> str:
        counter = self._counters.setdefault(kind, itertools.count(1))
        return f"{self._prefix}{kind}-{next(counter)}"

    def session_id(self) -> SessionId:
        return SessionId(self._next("s"))

    def activation_id(self) -> ActivationId:
        return ActivationId(self._next("a"))

    def turn_id(self) -> TurnId:
        return TurnId(self._next("t"))
