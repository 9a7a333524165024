"""The deltas of one ``WatchSession`` with ``deltas`` (ADR 0053): each watched session's model
text, from wherever it runs, into one bounded queue the watch reads.

A :class:`DeltaRelay` follows the residency events the watch already yields: a session resident
on this node is followed in the node's :class:`~dsh_mesh.runtime.DeltaHub`; one resident on
another node is relayed from there over ``MeshPeer.WatchDeltas`` (at most ``max_remote`` at
once); a session that moves is followed to its new node. Deltas are best effort: a peer that
fails or goes away ends the deltas of its sessions, never the watch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Protocol, Self

from dsh_mesh._proto.dsh.mesh.v1 import mesh_pb2
from dsh_mesh.core import MAX_ID_CHARS, Activation, MeshError, NodeId, SessionId, TurnId
from dsh_mesh.runtime import Delta, DeltaHub

MAX_REMOTE_SESSIONS = 32
"""The most sessions one watch relays from other nodes at once; past it, a session resident
elsewhere waits (in the order its residency was told) until another's relay ends or stops."""

_MAX_DROPPED = 2**32 - 1
"""``TextDelta.dropped`` is a uint32: a larger count is told as this."""

_log = logging.getLogger(__name__)


def delta_to_wire(delta: Delta) -> mesh_pb2.TextDelta:
    """``delta`` as ``SessionEvent.delta`` (and ``WatchDeltasResponse.delta``) carry it."""
    return mesh_pb2.TextDelta(
        turn_id=delta.turn_id, text=delta.text, dropped=min(delta.dropped, _MAX_DROPPED)
    )


def delta_from_wire(session: SessionId, wire: mesh_pb2.TextDelta) -> Delta:
    """A relayed delta of ``session``. A longer text than a delta carries is split by the
    subscription that queues it (:meth:`~dsh_mesh.runtime.DeltaSubscription.offer`), as any
    is; the peer's message size bounds it before that."""
    return Delta(
        session_id=session,
        turn_id=TurnId(wire.turn_id[:MAX_ID_CHARS]),
        text=wire.text,
        dropped=wire.dropped,
    )


class DeltaSource(Protocol):
    """A session's deltas on another node (``PeerPool.watch_deltas``)."""

    def watch_deltas(self, node: NodeId, session: SessionId) -> AsyncIterator[Delta]: ...


class DeltaRelay:
    """The deltas of one watch (see the module's docstring). Use ``async with``: leaving it
    ends every relay from another node (cancelled and awaited) and the hub subscription.
    Raises :class:`~dsh_mesh.core.NodeOverloaded` when made while the hub serves too many
    subscriptions already.

    Not a task group: it lives in a watch's body, an async generator that suspends at each
    event, and a generator closed there must end quietly (as ``RegistryReads.follow``'s
    residency follower does). Its relays are its own, each cancelled and awaited on the way
    out."""

    def __init__(
        self,
        *,
        hub: DeltaHub,
        node_id: NodeId,
        peers: DeltaSource,
        max_remote: int = MAX_REMOTE_SESSIONS,
    ) -> None:
        self._node_id = node_id
        self._peers = peers
        self._max_remote = max_remote
        self._subscription = hub.subscribe()
        self._remote: dict[SessionId, tuple[NodeId, asyncio.Task[None]]] = {}
        self._waiting: dict[SessionId, NodeId] = {}
        """Sessions resident on another node not relayed for want of room, in the order told,
        each with its node: at most one entry per session the watch carries."""
        self._ending: set[asyncio.Task[None]] = set()
        """Relays cancelled and not yet awaited."""
        self._closing = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, *_: type[BaseException] | BaseException | TracebackType | None
    ) -> None:
        self._closing = True
        self._waiting.clear()
        try:
            for session in list(self._remote):
                self._stop_remote(session)
            if self._ending:
                await asyncio.wait(self._ending)
        finally:
            self._subscription.close()

    @property
    def remote(self) -> dict[SessionId, NodeId]:
        """The sessions relayed from another node now, and from which."""
        return {session: node for session, (node, _task) in self._remote.items()}

    @property
    def waiting(self) -> dict[SessionId, NodeId]:
        """The sessions waiting for room to be relayed from another node, and from which."""
        return dict(self._waiting)

    def residency(
        self,
        session: SessionId,
        *,
        activated: Activation | None = None,
        deactivated: Activation | None = None,
    ) -> None:
        """Follow a residency event of the watch: ``session`` is now hosted where ``activated``
        says, or (``deactivated``) no longer where it was."""
        if activated is not None:
            self._follow(session, activated.node_id)
        elif deactivated is not None:
            self._leave(session, deactivated.node_id)

    async def get(self) -> Delta:
        """The next delta of any watched session, once there is one."""
        return await self._subscription.get()

    def _follow(self, session: SessionId, node: NodeId) -> None:
        self._waiting.pop(session, None)
        if node == self._node_id:
            self._stop_remote(session)
            self._subscription.follow(session)
            return
        self._subscription.unfollow(session)
        held = self._remote.get(session)
        if held is not None and held[0] == node:
            return
        self._stop_remote(session, refill=False)  # a session that moves keeps its room
        if len(self._remote) >= self._max_remote:
            _log.debug("deltas of %s wait: %d relayed already", session, self._max_remote)
            self._waiting[session] = node
            return
        self._start_remote(session, node)

    def _leave(self, session: SessionId, node: NodeId) -> None:
        if node == self._node_id:
            self._subscription.unfollow(session)
        if self._waiting.get(session) == node:
            del self._waiting[session]
        held = self._remote.get(session)
        if held is not None and held[0] == node:
            self._stop_remote(session)

    def _start_remote(self, session: SessionId, node: NodeId) -> None:
        task = asyncio.create_task(self._relay(session, node), name=f"deltas {session}")
        self._remote[session] = (node, task)
        task.add_done_callback(self._ended)

    def _stop_remote(self, session: SessionId, *, refill: bool = True) -> None:
        held = self._remote.pop(session, None)
        if held is not None:
            held[1].cancel()
            self._ending.add(held[1])
            self._subscription.forget(session)
            if refill:
                self._refill()

    def _refill(self) -> None:
        """Start the relays that wait, in order, while there is room."""
        while self._waiting and not self._closing and len(self._remote) < self._max_remote:
            session = next(iter(self._waiting))
            self._start_remote(session, self._waiting.pop(session))

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._ending.discard(task)
        for session, (_node, held) in list(self._remote.items()):
            if held is task:
                del self._remote[session]
                self._subscription.forget(session)
                self._refill()
        if not task.cancelled() and (error := task.exception()) is not None:
            _log.error("a relay of deltas failed", exc_info=error)

    async def _relay(self, session: SessionId, node: NodeId) -> None:
        try:
            async for delta in self._peers.watch_deltas(node, session):
                self._subscription.offer(delta)
        except MeshError as failed:
            # Best effort: the watch goes on; this session's deltas end with this relay.
            _log.debug("deltas of %s from %s ended: %s", session, node, failed)
