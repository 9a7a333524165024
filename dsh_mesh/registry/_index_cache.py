"""The listing indexes' keys, held in key order in memory and followed by etcd watches (ADR
0046), as Kubernetes' API server keeps a watch cache to serve paged lists.

Why: etcd (3.4, and 3.5/3.6 alike) answers a range with a limit only after counting every key
from its start to its end, so the first page of an index of 100,000 sessions costs a walk of
all 100,000. A page read from here costs a bisection; what the cache may not hold yet (a key
put in the last milliseconds, at the end of the index) is read from etcd after the last key it
holds, a range as short as that lag (``RegistryReads``). Deleted keys it still holds are
harmless: a listing reads each listed session's header, and leaves out one that is gone.

The cache holds the keys of the indexes only (about 100 bytes a session per index); values
(headers) are read from etcd per page. It loads a snapshot, follows from its revision + 1, and
after a broken stream or a compaction marks itself unsynced (readers go to etcd alone) and
loads again.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Collection

import aetcd.exceptions

from dsh_mesh.core import MeshError
from dsh_mesh.registry._etcd import Etcd
from dsh_mesh.registry._keys import prefix_end

_log = logging.getLogger(__name__)
_RETRY_SECONDS = 0.5
_LOAD_PAGE = 10_000
"""Keys per range while loading (keys only: about 1 MB a page, under gRPC's 4 MiB)."""


class IndexCache:
    """The keys under each of ``prefixes``, in key order. Run :meth:`follow` in a task; it
    returns only when cancelled."""

    def __init__(self, etcd: Etcd, prefixes: Collection[bytes]) -> None:
        self._etcd = etcd
        self._keys: dict[bytes, list[bytes]] = {prefix: [] for prefix in prefixes}
        self._synced: set[bytes] = set()

    def after(self, prefix: bytes, start: bytes, limit: int) -> list[bytes] | None:
        """Up to ``limit`` keys under ``prefix`` (itself under a followed prefix) from
        ``start`` on (inclusive), in key order; ``None`` when no followed prefix covers it or
        its watch is not synced (read etcd instead)."""
        followed = self._covering(prefix)
        if followed is None or followed not in self._synced:
            return None
        held = self._keys[followed]
        at = bisect.bisect_left(held, max(start, prefix))
        end = prefix_end(prefix)
        found = held[at : at + limit]
        if found and found[-1] >= end:
            found = found[: bisect.bisect_left(found, end)]
        return found

    def count(self, prefix: bytes) -> int | None:
        """How many keys under ``prefix`` it holds; ``None`` as :meth:`after` would be."""
        followed = self._covering(prefix)
        if followed is None or followed not in self._synced:
            return None
        held = self._keys[followed]
        return bisect.bisect_left(held, prefix_end(prefix)) - bisect.bisect_left(held, prefix)

    def size(self) -> int:
        """Keys held, over every followed prefix."""
        return sum(len(held) for held in self._keys.values())

    def _covering(self, prefix: bytes) -> bytes | None:
        for followed in self._keys:
            if prefix.startswith(followed):
                return followed
        return None

    async def follow(self) -> None:
        """Load, then follow every prefix until cancelled; never raises otherwise."""
        async with asyncio.TaskGroup() as group:
            for prefix in self._keys:
                group.create_task(self._follow(prefix))

    async def _follow(self, prefix: bytes) -> None:
        while True:
            try:
                revision = await self._load(prefix)
                self._synced.add(prefix)
                held = self._keys[prefix]
                async for event in self._etcd.watch_prefix(prefix, start_revision=revision + 1):
                    key = bytes(event.kv.key)
                    at = bisect.bisect_left(held, key)
                    present = at < len(held) and held[at] == key
                    if event.kind == "DELETE":
                        if present:
                            del held[at]
                    elif not present:
                        held.insert(at, key)
            except aetcd.exceptions.RevisionCompactedError:
                _log.warning("index cache: revision compacted; reloading %r", prefix)
            except MeshError as error:
                _log.warning("index cache: watch on %r broke: %s", prefix, error)
            except Exception:  # a defect here must not end the node: listings read etcd
                _log.exception("index cache: following %r failed; loading it again", prefix)
            self._synced.discard(prefix)
            await asyncio.sleep(_RETRY_SECONDS)

    async def _load(self, prefix: bytes) -> int:
        """Read every key under ``prefix`` at one revision; returns that revision."""
        keys: list[bytes] = []
        start, revision = prefix, 0
        while True:
            response = await self._etcd.get_prefix(
                prefix, start=start, limit=_LOAD_PAGE, keys_only=True, revision=revision
            )
            revision = revision or int(response.header.revision)
            keys.extend(bytes(kv.key) for kv in response.kvs)
            if not response.more:
                break
            start = keys[-1] + b"\0"
        self._keys[prefix] = keys
        return revision
