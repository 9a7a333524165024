"""The deltas of one node: its agents' model text as it is generated, handed to whoever
watches it right now (ADR 0053).

A :class:`DeltaHub` is in memory and per node; nothing in it is stored or replayed. An agent
publishes synchronously, and a publish for a session nobody watches is one dict lookup. Each
:class:`DeltaSubscription` has a bounded queue: a subscriber that falls behind loses deltas
(counted per session and told with the next delta of that session it gets), never slows the
agent, and never holds more than ``capacity`` deltas of at most :data:`MAX_DELTA_CHARS`
characters each.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Self

from dsh_mesh.core import NodeOverloaded, SessionId, TurnId

MAX_DELTA_CHARS = 2048
"""The most characters one delta carries: a longer piece of text is cut into several."""
DEFAULT_CAPACITY = 64
"""The most deltas one subscriber holds unread (so at most 64 x 2048 characters)."""
MAX_SUBSCRIPTIONS = 1024
"""The most subscriptions one node's hub serves at once (watches and peers' relays)."""
PEER_RESERVE = 256
"""Of :data:`MAX_SUBSCRIPTIONS`, how many only peers' relays may take: the watches served here
(whose callers are clients) may hold at most the rest, so that clients filling a node's hub
never keep it from relaying deltas to the watches other nodes serve."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Delta:
    """A piece of a session's model text while a step of ``turn_id`` is being written.
    ``dropped``: how many deltas of this session the subscriber lost right before this one."""

    session_id: SessionId
    turn_id: TurnId
    text: str
    dropped: int = 0


class DeltaSubscription:
    """One subscriber's deltas, of the sessions it follows (:meth:`follow`), in one bounded
    queue. Read with :meth:`get`; end with :meth:`close` (idempotent) or ``with``. Not
    thread-safe: the event loop's only."""

    __slots__ = ("_capacity", "_closed", "_dropped", "_hub", "_queue", "_ready", "_sessions")

    def __init__(self, hub: DeltaHub, capacity: int) -> None:
        self._hub = hub
        self._capacity = capacity
        self._queue: deque[Delta] = deque()
        self._ready = asyncio.Event()
        self._sessions: set[SessionId] = set()
        self._dropped: dict[SessionId, int] = {}
        """Per session: deltas lost since the last one this subscriber was given."""
        self._closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    @property
    def sessions(self) -> frozenset[SessionId]:
        """The sessions whose deltas this subscriber gets."""
        return frozenset(self._sessions)

    def follow(self, session: SessionId) -> None:
        """Get ``session``'s deltas from now on (idempotent)."""
        if self._closed or session in self._sessions:
            return
        self._sessions.add(session)
        self._hub._add(session, self)

    def unfollow(self, session: SessionId) -> None:
        """Get no more of ``session``'s deltas (idempotent). Those queued stay."""
        if session in self._sessions:
            self._sessions.discard(session)
            self._dropped.pop(session, None)
            self._hub._remove(session, self)

    def forget(self, session: SessionId) -> None:
        """Forget the losses counted for ``session`` unless it is followed here: whoever
        :meth:`offer` s deltas of a session this subscription does not follow (a relay from
        another node) calls it when it stops, so that counts are kept per relayed session only
        while it is relayed."""
        if session not in self._sessions:
            self._dropped.pop(session, None)

    @property
    def lost(self) -> dict[SessionId, int]:
        """Per session: the deltas lost and not yet told (with the next delta of it)."""
        return dict(self._dropped)

    def offer(self, delta: Delta) -> None:
        """Queue ``delta`` (cut into pieces of at most :data:`MAX_DELTA_CHARS`) if there is
        room; else count what did not fit as dropped. Never blocks, never raises."""
        if self._closed or not delta.text:
            return
        text, session = delta.text, delta.session_id
        if (
            len(text) <= MAX_DELTA_CHARS
            and not delta.dropped
            and len(self._queue) < self._capacity
            and session not in self._dropped
        ):  # the common case: one piece, nothing lost, room for it
            self._queue.append(delta)
            self._ready.set()
            return
        lost = self._dropped.pop(session, 0) + delta.dropped
        for at in range(0, len(text), MAX_DELTA_CHARS):
            if len(self._queue) >= self._capacity:
                lost += -(-(len(text) - at) // MAX_DELTA_CHARS)  # the pieces left, rounded up
                break
            self._queue.append(replace(delta, text=text[at : at + MAX_DELTA_CHARS], dropped=lost))
            lost = 0
        if lost:
            self._dropped[session] = lost
        self._ready.set()

    async def get(self) -> Delta:
        """The next delta, once there is one."""
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()

    def close(self) -> None:
        """Follow nothing more and drop what is queued. Idempotent."""
        if self._closed:
            return
        for session in list(self._sessions):
            self.unfollow(session)
        self._closed = True
        self._queue.clear()
        self._hub._closed(self)


class DeltaHub:
    """The deltas of one node's agents, to their subscribers (see the module's docstring).

    :meth:`publish` is called by the agents' host, on the event loop; :meth:`subscribe` by
    whoever relays deltas (a watch, a peer's relay). Nothing here outlives the process."""

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        max_subscriptions: int = MAX_SUBSCRIPTIONS,
        peer_reserve: int | None = None,
    ) -> None:
        """``peer_reserve``: the subscriptions only peers' relays may take (see
        :data:`PEER_RESERVE`); by default :data:`PEER_RESERVE`, at most a quarter of
        ``max_subscriptions``."""
        if capacity < 1 or max_subscriptions < 1:
            raise ValueError("capacity and max_subscriptions must be at least 1")
        if peer_reserve is None:
            peer_reserve = min(PEER_RESERVE, max_subscriptions // 4)
        if not 0 <= peer_reserve < max_subscriptions:
            raise ValueError("peer_reserve must be at least 0 and below max_subscriptions")
        self._capacity = capacity
        self._max_subscriptions = max_subscriptions
        self._peer_reserve = peer_reserve
        self._by_session: dict[SessionId, list[DeltaSubscription]] = {}
        self._count = 0

    def publish(self, session: SessionId, turn_id: TurnId, text: str) -> None:
        """Hand ``text`` of ``session``'s step being written in ``turn_id`` to its
        subscribers. Synchronous and never blocking; nothing is kept when nobody watches."""
        subscribers = self._by_session.get(session)
        if subscribers is None or not text:
            return
        delta = Delta(session_id=session, turn_id=turn_id, text=text)
        for subscriber in subscribers:
            subscriber.offer(delta)

    def subscribe(
        self, sessions: Iterable[SessionId] = (), *, peer: bool = False
    ) -> DeltaSubscription:
        """A new subscription following ``sessions`` (more can be followed later); ``peer``
        for another node's relay, which may take the reserve. Raises :class:`NodeOverloaded`
        when the hub already serves ``max_subscriptions`` (less the peer reserve for a watch
        served here)."""
        limit = self._max_subscriptions - (0 if peer else self._peer_reserve)
        if self._count >= limit:
            raise NodeOverloaded(
                f"this node relays deltas to {self._count} subscribers already",
                metadata={"limit": "delta_subscriptions"},
            )
        self._count += 1
        subscription = DeltaSubscription(self, self._capacity)
        for session in sessions:
            subscription.follow(session)
        return subscription

    def watched(self, session: SessionId) -> bool:
        """Whether anybody subscribes to ``session``'s deltas now."""
        return session in self._by_session

    @property
    def subscriptions(self) -> int:
        """How many subscriptions are open."""
        return self._count

    def _add(self, session: SessionId, subscription: DeltaSubscription) -> None:
        self._by_session.setdefault(session, []).append(subscription)

    def _remove(self, session: SessionId, subscription: DeltaSubscription) -> None:
        subscribers = self._by_session.get(session)
        if subscribers is None:
            return
        subscribers.remove(subscription)
        if not subscribers:
            del self._by_session[session]

    def _closed(self, _subscription: DeltaSubscription) -> None:
        self._count -= 1
