"""Limits on trees: how deep a tree may grow, how many of its children may be live at once,
and how fast it may spawn (ADR 0030).

A spawn is judged before anything is written, from durable state every node shares: the
parent's depth (its chain of headers, which never change), and a census of the tree in etcd
(its live members, kept with their activations, and its members created in the last minute,
from the tree index). Limits are per tree, so one runaway tree cannot starve the others; they
are checked by the node that decides the spawn, whichever hosts the child.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from dsh_mesh import telemetry
from dsh_mesh.core import RateLimited, SessionHeader, SessionId, SessionUnknown, TreeLimitReached
from dsh_mesh.runtime._store import SessionStore

SPAWN_WINDOW = timedelta(minutes=1)
"""The sliding window ``max_tree_spawns_per_minute`` counts over."""


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


class SpawnGuard:
    """Judges each spawn against :class:`TreeLimits`. Owns a cache of session depths (a
    header never changes, so neither does a depth). Safe to call concurrently; the census a
    decision reads may miss spawns decided at the same moment, so a limit may be passed by at
    most the spawns of one tree in flight at once."""

    def __init__(self, store: SessionStore, limits: TreeLimits) -> None:
        self._store = store
        self._limits = limits
        self._depths: dict[SessionId, int] = {}

    @property
    def limits(self) -> TreeLimits:
        """The limits this guard judges by."""
        return self._limits

    async def check(self, parent: SessionHeader) -> None:
        """Raise :class:`TreeLimitReached` or :class:`RateLimited` when a new child of
        ``parent`` would pass a limit of its tree; return when it may be created."""
        limits = self._limits
        depth = await self.depth(parent) + 1
        if depth > limits.max_depth:
            self._refuse("depth")
            raise TreeLimitReached(
                f"a child of {parent.session_id} would be at depth {depth}; this cluster's"
                f" trees stop at depth {limits.max_depth}: do the work without a new child",
                metadata={"limit": "depth", "max": str(limits.max_depth)},
            )
        census = await self._store.tree_census(
            parent.session_id, since=datetime.now(UTC) - SPAWN_WINDOW
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
            wait = math.ceil(
                SPAWN_WINDOW / timedelta(milliseconds=1) / limits.max_spawns_per_minute
            )
            raise RateLimited(
                f"the tree of {census.root} created {census.created_since} sessions in the last"
                f" minute, its limit: wait before spawning again",
                metadata={
                    "limit": "spawns_per_minute",
                    "max": str(limits.max_spawns_per_minute),
                    "root": census.root,
                    "retry_after_ms": str(wait),
                },
            )

    async def depth(self, header: SessionHeader) -> int:
        """Edges from ``header``'s root to it (0 for a root), walked up its parents once and
        then remembered. A walk stops counting past the depth limit: deeper is refused
        anyway."""
        chain: list[SessionId] = []
        current = header
        while current.parent_session is not None and current.session_id not in self._depths:
            chain.append(current.session_id)
            if len(chain) > self._limits.max_depth:
                return len(chain)  # at least this deep: past the limit, not remembered
            parent = await self._store.get_header(current.parent_session)
            if parent is None:
                raise SessionUnknown(current.parent_session)
            current = parent
        depth = self._depths.get(current.session_id, 0)
        for session in reversed(chain):
            depth += 1
            self._depths[session] = depth
        return depth

    @staticmethod
    def _refuse(limit: str) -> None:
        telemetry.spawn_refused(limit)
