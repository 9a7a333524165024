"""The index cache (ADR 0046) over a stand-in for etcd: it loads, follows puts and deletes in
key order, answers only for a prefix it follows while synced, and a defect or a broken watch
makes it unsynced (listings read etcd) until it has loaded again: it never ends its node."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dsh_mesh.core import RegistryUnavailable
from dsh_mesh.registry import IndexCache
from dsh_mesh.registry._keys import prefix_end

PREFIX = b"/m/created/"


@dataclass
class _Kv:
    key: bytes


@dataclass
class _Header:
    revision: int


@dataclass
class _Range:
    kvs: list[_Kv]
    more: bool
    header: _Header


@dataclass
class _Event:
    kind: str
    kv: _Kv


@dataclass
class FakeEtcd:
    """Keys in memory; each watch first fails as ``failures`` says, then yields ``events``."""

    keys: set[bytes] = field(default_factory=set)
    failures: list[BaseException] = field(default_factory=list)
    events: asyncio.Queue[_Event] = field(default_factory=asyncio.Queue)
    loads: int = 0

    async def get_prefix(
        self, prefix: bytes, *, start: bytes | None = None, limit: int = 0, **_: Any
    ) -> _Range:
        if start in (None, prefix):
            self.loads += 1
        found = sorted(k for k in self.keys if (start or prefix) <= k < prefix_end(prefix))
        page = found[:limit] if limit else found
        return _Range([_Kv(k) for k in page], len(found) > len(page), _Header(7))

    async def watch_prefix(self, prefix: bytes, *, start_revision: int) -> AsyncIterator[_Event]:
        if self.failures:
            raise self.failures.pop(0)
        while True:
            event = await self.events.get()
            if event.kind == "PUT":
                self.keys.add(event.kv.key)
            else:
                self.keys.discard(event.kv.key)
            yield event


async def until(condition: Any) -> None:
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 (the cache has no event to wait on)
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def following(etcd: FakeEtcd) -> AsyncIterator[IndexCache]:
    cache = IndexCache(etcd, [PREFIX])  # type: ignore[arg-type]
    task = asyncio.create_task(cache.follow())
    try:
        yield cache
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def key(n: int) -> bytes:
    return PREFIX + f"{n:020d}/s-{n}".encode()


async def test_it_loads_follows_and_answers_in_key_order() -> None:
    etcd = FakeEtcd(keys={key(n) for n in (1, 3, 5)})
    async with following(etcd) as cache:
        await until(lambda: cache.count(PREFIX) == 3)
        await etcd.events.put(_Event("PUT", _Kv(key(4))))
        await etcd.events.put(_Event("DELETE", _Kv(key(1))))
        await until(lambda: cache.after(PREFIX, PREFIX, 10) == [key(3), key(4), key(5)])
        assert cache.after(PREFIX, key(3) + b"\0", 1) == [key(4)]
        assert cache.after(b"/m/other/", b"/m/other/", 10) is None  # not followed
        assert cache.count(b"/m/created/000") == 3


async def test_a_defect_or_a_broken_watch_unsyncs_it_until_it_has_loaded_again() -> None:
    etcd = FakeEtcd(
        keys={key(1)}, failures=[ValueError("a defect"), RegistryUnavailable("etcd away")]
    )
    async with following(etcd) as cache:
        await until(lambda: etcd.loads >= 3 and cache.count(PREFIX) == 1)
        await etcd.events.put(_Event("PUT", _Kv(key(2))))
        await until(lambda: cache.after(PREFIX, PREFIX, 10) == [key(1), key(2)])
