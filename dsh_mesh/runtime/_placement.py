"""Where a session lives and how work reaches it: one mechanism for agent messages, human
prompts, interrupts, root creation, notices and remote spawns.

:class:`LocalPlacement` is a manager alone: every session lives here. :class:`ClusterForwarder`
is a node of a cluster: it asks the registry where a session is resident, places absent ones
by the node's policy, and hands requests to the node that hosts them (through the
:class:`Router`), following a node that lost a race and re-routing when a node went away
mid-call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from dsh_mesh.core import (
    Activation,
    Delivery,
    NodeId,
    PeerUnavailable,
    SessionId,
    TargetElsewhere,
    TurnId,
)
from dsh_mesh.runtime._departure import unless_departed
from dsh_mesh.runtime._router import MAX_HOPS, Router
from dsh_mesh.runtime._store import SessionStore

T = TypeVar("T")
HandOff = Callable[[NodeId], Awaitable[T]]
"""A request handed to the node named: the same request each time it is called."""


class Placement(Protocol):
    """Where sessions live, as one manager sees it."""

    @property
    def router(self) -> Router:
        """The way to other nodes (alone: one that reaches none)."""
        ...

    def place(self, session: SessionId) -> NodeId:
        """The node that should host ``session`` next (a new child, or an absent one)."""
        ...

    async def elsewhere(
        self, session: SessionId, *, place: bool, fresh: bool = False
    ) -> TargetElsewhere | None:
        """The redirect to the node where ``session`` lives (or, when ``place`` and it is
        absent, should live next) if that is another node; None when this node should handle
        it. ``fresh`` reads etcd itself, not a cache."""
        ...

    async def follow(
        self, session: SessionId, elsewhere: TargetElsewhere, hand_off: HandOff[T], *, keyed: bool
    ) -> T:
        """Hand a request to the node ``elsewhere`` names, and on to the node that one names
        if it lost a race (at most :data:`MAX_HOPS` hand-offs). A ``keyed`` request (one that
        may land twice harmlessly) raises :class:`~dsh_mesh.runtime.Departed` when its node
        lost ``session`` mid-call: the caller routes it again."""
        ...


class LocalPlacement:
    """A manager alone: every session lives on ``node``; nothing is ever handed on."""

    def __init__(self, node: NodeId) -> None:
        self._node = node

    @property
    def router(self) -> Router:
        """A router that reaches no other node."""
        return _NO_PEERS

    def place(self, session: SessionId) -> NodeId:
        """This node."""
        return self._node

    async def elsewhere(
        self, session: SessionId, *, place: bool, fresh: bool = False
    ) -> TargetElsewhere | None:
        """None: every session lives here."""
        return None

    async def follow(
        self, session: SessionId, elsewhere: TargetElsewhere, hand_off: HandOff[T], *, keyed: bool
    ) -> T:
        """Never reached alone: nothing is elsewhere. Raises the redirect as it is."""
        raise elsewhere


class _NoPeers:
    """The router of a manager alone: there is no other node to reach."""

    def place(self, session: SessionId) -> NodeId:
        raise PeerUnavailable("this manager has no other nodes")

    def is_live(self, node: NodeId) -> bool:
        return False

    async def hand_on_message(self, node: NodeId, *_: object, **__: object) -> Delivery:
        raise PeerUnavailable(f"node {node} is not reachable from a manager alone")

    async def submit_prompt(self, node: NodeId, *_: object, **__: object) -> Delivery:
        raise PeerUnavailable(f"node {node} is not reachable from a manager alone")

    async def interrupt(self, node: NodeId, session: SessionId) -> TurnId | None:
        raise PeerUnavailable(f"node {node} is not reachable from a manager alone")

    async def resolve_approval(self, node: NodeId, *_: object) -> Delivery:
        raise PeerUnavailable(f"node {node} is not reachable from a manager alone")

    async def create_root(self, node: NodeId, **_: str) -> Activation:
        raise PeerUnavailable(f"node {node} is not reachable from a manager alone")

    async def activate(self, node: NodeId, *_: object) -> Activation:
        raise PeerUnavailable(f"node {node} is not reachable from a manager alone")

    async def deliver_notice(self, node: NodeId, *_: object) -> None:
        raise PeerUnavailable(f"node {node} is not reachable from a manager alone")


_NO_PEERS: Router = _NoPeers()


class ClusterForwarder:
    """A node of a cluster: residency from the registry, placement and hand-offs by the
    ``router``."""

    def __init__(self, *, node: NodeId, router: Router, store: SessionStore) -> None:
        self._node = node
        self._router = router
        self._store = store

    @property
    def router(self) -> Router:
        """The way to the other nodes."""
        return self._router

    def place(self, session: SessionId) -> NodeId:
        """The node the router's placement policy picks."""
        return self._router.place(session)

    async def elsewhere(
        self, session: SessionId, *, place: bool, fresh: bool = False
    ) -> TargetElsewhere | None:
        """The redirect to ``session``'s holder (or its placement), unless that is here."""
        current = await self._store.current_activation(session, fresh=fresh)
        if current is not None:
            if current.node_id == self._node:
                return None
            return TargetElsewhere.held_by(session, current.node_id, current.activation_id)
        if not place:
            return None
        home = self._router.place(session)
        return None if home == self._node else TargetElsewhere.held_by(session, home, "")

    async def follow(
        self, session: SessionId, elsewhere: TargetElsewhere, hand_off: HandOff[T], *, keyed: bool
    ) -> T:
        """Hand the request on while its node still holds ``session`` (or, for a placement,
        is still registered): a node cut off or frozen mid-call would hold the call to its
        deadline, but its lease lapses within one TTL and then the request is routed again. A
        keyless request is not routed twice: it could land twice."""
        node = NodeId(elsewhere.node_id)
        activation = elsewhere.activation_id

        async def still_there() -> bool:
            if not activation:
                return self._router.is_live(node)
            current = await self._store.current_activation(session)
            return current is not None and current.activation_id == activation

        if not keyed:
            return await self._hand_on(session, node, hand_off)
        return await unless_departed(
            self._hand_on(session, node, hand_off), still_there, what=f"node {node}"
        )

    async def _hand_on(self, session: SessionId, node: NodeId, hand_off: HandOff[T]) -> T:
        for _ in range(MAX_HOPS):
            try:
                return await hand_off(node)
            except TargetElsewhere as moved:
                node = NodeId(moved.node_id)
        raise PeerUnavailable(f"{session} kept moving between nodes; retry")
