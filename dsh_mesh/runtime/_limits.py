"""Limits on trees (ADR 0030) and quotas of namespaces (ADR 0033): how deep a tree may grow,
how many of its children may be live at once and how fast it may spawn; how many sessions of
a namespace may be live at once and how fast roots may be created in it.

A creation is judged before anything is written, from durable state every node shares: the
parent's depth (its chain of headers, which never change), and censuses in etcd (live
members of the tree and of the namespace, kept with their activations; members of the tree
and roots of the namespace created in the last minute, from their indexes). Tree limits are
per tree, so one runaway tree cannot starve the others; quotas are per namespace, so one team
cannot starve another. Both are checked by the node that decides the creation, whichever
hosts the new session.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from dsh_mesh import telemetry
from dsh_mesh.core import (
    QuotaExceeded,
    RateLimited,
    SessionHeader,
    SessionId,
    SessionUnknown,
    TreeLimitReached,
)
from dsh_mesh.runtime._cache import ANCESTRY_CACHE_SIZE, LruCache
from dsh_mesh.runtime._store import SessionStore
from dsh_mesh.tools import TurnLimits

DEFAULT_TURN_LIMITS = TurnLimits(max_model_calls=300, turn_token_budget=20_000_000)
"""What one turn may spend unless its preset or its namespace says otherwise (ADR 0037): 300
model calls, well above the anchors' step limits (OpenAI Agents SDK ``max_turns`` 10,
LangGraph ``recursion_limit`` 25) so a coding agent's turn of a few hundred steps runs, and
20 million prompt plus completion tokens, which 300 calls over a context of about 64,000
tokens stay under. A model stuck in a loop stops there, with the typed outcome
``token-exhaustion``."""

SPAWN_WINDOW = timedelta(minutes=1)
"""The sliding window ``max_tree_spawns_per_minute`` and ``max_roots_per_minute`` count
over."""


@dataclass(frozen=True, kw_only=True)
class TreeLimits:
    """How far one tree may grow. The defaults stop a runaway tree (every child spawning a
    child) within seconds while leaving room for any tree a team builds on purpose."""

    max_depth: int = 32
    """Edges from the root to the deepest session: a root's children are at depth 1. A spawn
    whose child would be deeper is refused with TREE_LIMIT (``limit`` ``depth``)."""
    max_live_descendants: int = 1_000
    """Sessions of one tree, its root not counted, that may hold an activation at once; a
    spawn past it is refused with TREE_LIMIT (``limit`` ``live_descendants``)."""
    max_spawns_per_minute: int = 300
    """Sessions created in one tree in any 60 s, its root counted; a spawn past it is refused
    with RATE_LIMITED (``limit`` ``spawns_per_minute``), retryable."""

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_live_descendants", "max_spawns_per_minute"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, kw_only=True)
class NamespaceLimits:
    """The quotas of one namespace (ADR 0033). The defaults bound what one credential can make
    a cluster hold while leaving room for any team's work."""

    max_live_sessions: int = 10_000
    """Sessions of the namespace (roots and children) that may hold an activation at once; a
    root's creation or a spawn past it is refused with QUOTA_EXCEEDED (``limit``
    ``live_sessions``), retryable once some end."""
    max_roots_per_minute: int = 1_200
    """Roots created in the namespace in any 60 s; one more is refused with RATE_LIMITED
    (``limit`` ``roots_per_minute``), retryable after its ``retry_after_ms``."""
    tree: TreeLimits | None = None
    """The namespace's own tree limits; None: the node's."""
    turn: TurnLimits = DEFAULT_TURN_LIMITS
    """What one turn of a session of the namespace may spend (a preset's own setting wins):
    its model calls and tokens. Unset fields here mean no limit of the mesh's own."""

    def __post_init__(self) -> None:
        for name in ("max_live_sessions", "max_roots_per_minute"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Every limit a node judges creations by: the tree limits and namespace quotas that hold
    for any namespace, and the namespaces that have their own."""

    tree: TreeLimits = field(default_factory=TreeLimits)
    namespace: NamespaceLimits = field(default_factory=NamespaceLimits)
    namespaces: Mapping[str, NamespaceLimits] = field(default_factory=dict)

    def of(self, namespace: str) -> tuple[NamespaceLimits, TreeLimits]:
        """The quotas of ``namespace`` and the tree limits its trees grow under."""
        own = self.namespaces.get(namespace, self.namespace)
        return own, own.tree or self.tree


class CreationGuard:
    """Judges each creation: a spawn against its tree's :class:`TreeLimits` and its
    namespace's :class:`NamespaceLimits`, a root against its namespace's. Owns a cache of
    session depths (a header never changes, so neither does a depth). Safe to call
    concurrently; the censuses a decision reads may miss creations decided at the same
    moment, so a limit may be passed by at most the creations in flight at once. It keeps
    the depths of the last ``cached`` sessions it walked (an LRU, ADR 0044)."""

    def __init__(
        self, store: SessionStore, limits: Limits, *, cached: int = ANCESTRY_CACHE_SIZE
    ) -> None:
        self._store = store
        self._limits = limits
        self._depths: LruCache[SessionId, int] = LruCache(cached)

    @property
    def limits(self) -> Limits:
        """The limits this guard judges by."""
        return self._limits

    async def check_root(self, namespace: str) -> None:
        """Raise :class:`QuotaExceeded` or :class:`RateLimited` when a new root in
        ``namespace`` would pass one of its quotas; return when it may be created."""
        quota, _ = self._limits.of(namespace)
        census = await self._store.namespace_census(
            namespace, since=datetime.now(UTC) - SPAWN_WINDOW
        )
        self._check_live(namespace, quota, census.live_sessions)
        if census.roots_since >= quota.max_roots_per_minute:
            telemetry.creation_refused("roots_per_minute", namespace)
            raise RateLimited(
                f"namespace {namespace!r} created {census.roots_since} roots in the last"
                " minute, its limit: wait before creating another",
                metadata={
                    "limit": "roots_per_minute",
                    "max": str(quota.max_roots_per_minute),
                    "namespace": namespace,
                    "retry_after_ms": str(_spacing(quota.max_roots_per_minute)),
                },
            )

    async def check_spawn(self, parent: SessionHeader) -> None:
        """Raise :class:`TreeLimitReached`, :class:`RateLimited` or :class:`QuotaExceeded`
        when a new child of ``parent`` would pass a limit of its tree or a quota of its
        namespace; return when it may be created."""
        quota, limits = self._limits.of(parent.namespace)
        depth = await self.depth(parent, limit=limits.max_depth) + 1
        if depth > limits.max_depth:
            self._refuse("depth")
            raise TreeLimitReached(
                f"a child of {parent.session_id} would be at depth {depth}; this cluster's"
                f" trees stop at depth {limits.max_depth}: do the work without a new child",
                metadata={"limit": "depth", "max": str(limits.max_depth)},
            )
        since = datetime.now(UTC) - SPAWN_WINDOW
        census, namespace = await asyncio.gather(
            self._store.tree_census(parent.session_id, since=since),
            self._store.namespace_census(parent.namespace, since=since),
        )
        if census.live_descendants >= limits.max_live_descendants:
            self._refuse("live_descendants")
            raise TreeLimitReached(
                f"the tree of {census.root} has {census.live_descendants} live sessions below"
                f" its root, its limit: let some finish, or do the work without a new child",
                metadata={
                    "limit": "live_descendants",
                    "max": str(limits.max_live_descendants),
                    "root": census.root,
                },
            )
        if census.created_since >= limits.max_spawns_per_minute:
            self._refuse("spawns_per_minute")
            raise RateLimited(
                f"the tree of {census.root} created {census.created_since} sessions in the last"
                f" minute, its limit: wait before spawning again",
                metadata={
                    "limit": "spawns_per_minute",
                    "max": str(limits.max_spawns_per_minute),
                    "root": census.root,
                    "retry_after_ms": str(_spacing(limits.max_spawns_per_minute)),
                },
            )
        self._check_live(parent.namespace, quota, namespace.live_sessions)

    async def depth(self, header: SessionHeader, *, limit: int) -> int:
        """Edges from ``header``'s root to it (0 for a root), walked up its parents once and
        then remembered. A walk stops counting past ``limit``: deeper is refused anyway."""
        chain: list[SessionId] = []
        current = header
        while current.parent_session is not None and current.session_id not in self._depths:
            chain.append(current.session_id)
            if len(chain) > limit:
                return len(chain)  # at least this deep: past the limit, not remembered
            parent = await self._store.get_header(current.parent_session)
            if parent is None:
                raise SessionUnknown(current.parent_session)
            current = parent
        depth = self._depths.get(current.session_id) or 0
        for session in reversed(chain):
            depth += 1
            self._depths[session] = depth
        return depth

    @staticmethod
    def _check_live(namespace: str, quota: NamespaceLimits, live: int) -> None:
        if live >= quota.max_live_sessions:
            telemetry.creation_refused("live_sessions", namespace)
            raise QuotaExceeded(
                f"namespace {namespace!r} has {live} live sessions, its quota: let some"
                " finish before creating another",
                metadata={
                    "limit": "live_sessions",
                    "max": str(quota.max_live_sessions),
                    "namespace": namespace,
                },
            )

    @staticmethod
    def _refuse(limit: str) -> None:
        telemetry.spawn_refused(limit)


def _spacing(per_minute: int) -> int:
    """Milliseconds between creations at ``per_minute``: when a full window has room again."""
    return math.ceil(SPAWN_WINDOW / timedelta(milliseconds=1) / per_minute)
