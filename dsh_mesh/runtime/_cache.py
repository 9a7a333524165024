"""Caches of a node keyed by session: least recently used entries go first, past a size."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

HEADER_CACHE_SIZE = 4096
"""Session headers (and their roots) a node's store keeps (ADR 0044). A header never changes,
so a cached one is always right; past this many, the least recently read is read again from
etcd when next needed. A header is about 1 KiB, more with many tool descriptors: a few MiB
at most, whatever the number of sessions the node has hosted."""

ANCESTRY_CACHE_SIZE = 4096
"""Sessions whose depth (tree limits) or chain of ancestors (tree stops) a node keeps."""


class LruCache(Generic[K, V]):
    """A mapping of at most ``max_entries`` entries: writing one more drops the least recently
    read or written. For values that never change (a header, a depth): a dropped entry is
    read again, never wrong. Not thread-safe (one event loop)."""

    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def setdefault(self, key: K, value: V) -> V:
        """The value of ``key`` if cached, else ``value``, cached."""
        known = self.get(key)
        if known is not None:
            return known
        self[key] = value
        return value

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove ``key`` and return its value (``default`` when absent)."""
        return self._entries.pop(key, default)
