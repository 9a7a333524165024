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

It also counts (a namespace's live sessions and recent roots, for its quotas, without etcd's
walk of every key counted). A count sees this node's own writes at once: the cache is told of
every transaction its etcd client makes (:meth:`Etcd.observe_writes`) and counts a write its
watch has not brought yet as made (under load a watch lags by tens of milliseconds, and waiting
for it would send counts back to etcd). Other nodes' writes it counts once its watch brings
them, as a census read of etcd would a moment later: quotas counted across nodes were never
exact for creations racing each other.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Collection, Sequence
from typing import Any

import aetcd.exceptions

from dsh_mesh.core import MeshError
from dsh_mesh.registry._etcd import Etcd, written_key
from dsh_mesh.registry._keys import prefix_end
from dsh_mesh.registry._outage import Outage

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
        self._pending: dict[bytes, dict[bytes, tuple[int, bool]]] = {p: {} for p in self._keys}
        """This client's own writes under each followed prefix that its watch has not brought
        yet: key -> (revision, whether the key exists after it)."""
        etcd.observe_writes(self._note_written)

    def _note_written(self, revision: int, ops: Sequence[Any]) -> None:
        for op in ops:
            key = written_key(op)
            followed = None if key is None else self._covering(key)
            if key is not None and followed is not None:
                self._pending[followed][key] = (revision, op.HasField("request_put"))

    def _brought(self, prefix: bytes, key: bytes, revision: int) -> None:
        """The watch brought ``key``'s change at ``revision``: its own write up to then is
        held now, and so is every one before ``revision`` (a watch brings changes in revision
        order; a delete of a key that did not exist brings none, and is dropped here)."""
        pending = self._pending[prefix]
        written = pending.get(key)
        if written is not None and written[0] <= revision:
            del pending[key]
        if pending:
            for stale in [k for k, (at, _) in pending.items() if at < revision]:
                del pending[stale]

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

    def count(self, prefix: bytes, *, start: bytes = b"") -> int | None:
        """How many keys under ``prefix`` exist (from ``start`` on, inclusive, when given): the
        keys it holds, with this client's own writes counted at once; ``None`` as
        :meth:`after` would be."""
        followed = self._covering(prefix)
        if followed is None or followed not in self._synced:
            return None
        held = self._keys[followed]
        low, high = max(start, prefix), prefix_end(prefix)
        counted = bisect.bisect_left(held, high) - bisect.bisect_left(held, low)
        for key, (_, exists) in self._pending[followed].items():
            if low <= key < high:
                at = bisect.bisect_left(held, key)
                holds = at < len(held) and held[at] == key
                counted += int(exists and not holds) - int(holds and not exists)
        return max(0, counted)

    def pending(self) -> int:
        """This client's own writes it counts that its watch has not brought yet."""
        return sum(len(pending) for pending in self._pending.values())

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
        outage = Outage(_log, f"index cache: watch on {prefix!r}", first_delay=_RETRY_SECONDS)
        while True:
            delay = _RETRY_SECONDS
            try:
                revision = await self._load(prefix)
                outage.ended()
                pending = self._pending[prefix]
                for key in [k for k, (at, _) in pending.items() if at <= revision]:
                    del pending[key]  # the load read it
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
                    self._brought(prefix, key, int(event.kv.mod_revision))
            except aetcd.exceptions.RevisionCompactedError:
                _log.warning("index cache: revision compacted; reloading %r", prefix)
            except MeshError as error:
                delay = outage.failed(error)
            except Exception:  # a defect here must not end the node: listings read etcd
                _log.exception("index cache: following %r failed; loading it again", prefix)
            self._synced.discard(prefix)
            await asyncio.sleep(delay)

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
