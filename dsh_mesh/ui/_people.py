"""Who a web-view request acts for, and the browsers signed in to one view (ADR 0041).

A person signs in one of three ways:

- **the link** ``dsh-mesh ui`` prints, which carries the view's launch token (random, made at
  start, as Jupyter's): the person acts with the view's own credential, the one the CLI holds;
- **a team's token**, a client token of the cluster's namespaces file: the view forwards it
  on every call, so the node holds the person to that token's grant and records their
  decisions as that token's;
- **an authenticating proxy** in front of the view (off unless named): the proxy names the
  person in a header the view trusts from the proxy's addresses only; the view forwards the
  name, and decisions are recorded as ``<name> via <the view's credential>``.

A signed-in browser holds a random session id in an HttpOnly, SameSite=Strict cookie; the view
keeps at most :data:`MAX_SIGN_INS` of them in memory, each for :data:`IDLE_SIGN_IN` without a
request. A restart signs everyone out. Each person has a CSRF token, an HMAC of their session
(or proxy name) under a secret made at start, that every state-changing request must carry.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from dsh_mesh.client import MeshClient
from dsh_mesh.transport import token_identity

MAX_SIGN_INS = 10_000
"""Signed-in browsers one view remembers; past it the longest idle is signed out."""

IDLE_SIGN_IN = timedelta(hours=12)
"""How long a signed-in browser stays signed in without a request."""

MAX_SIGN_INS_PER_PERSON = 20
"""Sign-ins one person (one token, the launch link) holds at once; a new one past it signs out
that person's longest idle, so that no one token can sign everyone else out."""


class SignedInBy(StrEnum):
    """How a person signed in."""

    LINK = "link"
    TOKEN = "token"
    PROXY = "proxy"


@dataclass(frozen=True, kw_only=True)
class Person:
    """Who a request acts for. ``token`` is a team's client token (``TOKEN``), ``name`` the
    proxy's name for them (``PROXY``); a ``LINK`` person is the view's own credential."""

    by: SignedInBy
    name: str = ""
    token: str = ""

    def __repr__(self) -> str:  # never the token
        return f"Person(by={self.by.value}, name={self.name!r})"

    def client(self, view: MeshClient) -> MeshClient:
        """The view's client acting for this person (the node judges what they may do)."""
        if self.by is SignedInBy.LINK:
            return view
        return view.acting_for(person_token=self.token, person=self.name)

    def shown(self) -> dict[str, str]:
        """What the page shows of who is signed in (never the token itself)."""
        if self.by is SignedInBy.TOKEN:  # as the node records the person's decisions
            return {"by": self.by.value, "name": token_identity(self.token)}
        return {"by": self.by.value, "name": self.name or "the view's credential"}


class SignIns:
    """The browsers signed in to one view: a random session id (their cookie) to a
    :class:`Person`. Not shared between processes; bounded and expiring."""

    def __init__(
        self,
        *,
        launch_token: str | None = None,
        limit: int = MAX_SIGN_INS,
        per_person: int = MAX_SIGN_INS_PER_PERSON,
        idle: timedelta = IDLE_SIGN_IN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.launch_token = launch_token or secrets.token_urlsafe(32)
        self._secret = secrets.token_bytes(32)
        self._limit = limit
        self._per_person = per_person
        self._idle = idle.total_seconds()
        self._clock = clock
        self._people: OrderedDict[str, tuple[Person, float]] = OrderedDict()

    def launch_matches(self, presented: str) -> bool:
        """Whether ``presented`` is the launch token (constant time)."""
        return hmac.compare_digest(presented.encode(), self.launch_token.encode())

    def open(self, person: Person) -> str:
        """Sign ``person`` in; the session id their cookie carries."""
        now = self._clock()
        while self._people:  # the expired first (least recently used come first)
            oldest, (_, seen) = next(iter(self._people.items()))
            if now - seen <= self._idle:
                break
            del self._people[oldest]
        theirs = [key for key, (held, _) in self._people.items() if held == person]
        for key in theirs[: max(len(theirs) - self._per_person + 1, 0)]:
            del self._people[key]
        session = secrets.token_urlsafe(32)
        self._people[session] = (person, now)
        while len(self._people) > self._limit:
            self._people.popitem(last=False)
        return session

    def find(self, session: str) -> Person | None:
        """Who ``session`` is signed in as (its idle time starts again), or None."""
        found = self._people.get(session)
        if found is None:
            return None
        person, seen = found
        now = self._clock()
        if now - seen > self._idle:
            del self._people[session]
            return None
        self._people[session] = (person, now)
        self._people.move_to_end(session)
        return person

    def close(self, session: str) -> None:
        """Sign ``session`` out (nothing when it is not signed in)."""
        self._people.pop(session, None)

    def csrf_token(self, key: str) -> str:
        """The CSRF token of a signed-in browser (``key``: its session id, or ``proxy:`` and
        the proxy's name for the person)."""
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()

    def csrf_matches(self, key: str, presented: str) -> bool:
        """Whether ``presented`` is the CSRF token of ``key`` (constant time)."""
        return hmac.compare_digest(self.csrf_token(key).encode(), presented.encode())
