"""The index cache (ADR 0046) over a stand-in for etcd: it loads, follows puts and deletes in
key order, answers only for a prefix it follows while synced, and a defect or a broken watch
makes it unsynced (listings read etcd) until it has loaded again: it never ends its node. It
counts for the quotas only once its watch has brought its own client's last write (ADR 0047)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dsh_mesh.core import RegistryUnavailable
from dsh_mesh.registry import IndexCache
from dsh_mesh.registry._etcd import WriteObserver, delete, put
from dsh_mesh.registry._keys import prefix_end

PREFIX = b"/m/created/"


@dataclass
class _Kv:
    key: bytes
    mod_revision: int = 0


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
    observers: list[WriteObserver] = field(default_factory=list)

    def observe_writes(self, observer: WriteObserver) -> None:
        self.observers.append(observer)

    def wrote(self, revision: int, *keys: bytes) -> None:
        """As the real client does after a transaction that put ``keys``."""
        for observer in self.observers:
            observer(revision, [put(k, b"") for k in keys])

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


async def test_it_counts_from_a_start_and_its_own_writes_before_its_watch_brings_them() -> None:
    etcd = FakeEtcd(keys={key(n) for n in (1, 3, 5)})
    async with following(etcd) as cache:
        await until(lambda: cache.count(PREFIX) == 3)
        assert cache.count(PREFIX, start=key(2)) == 2
        assert cache.count(PREFIX, start=key(9)) == 0
        etcd.wrote(9, key(6))  # this node's own put; its event has not come yet
        etcd.wrote(10, b"/m/other/x")  # not under a followed prefix
        assert cache.count(PREFIX) == 4
        assert cache.count(PREFIX, start=key(6)) == 1
        etcd.wrote(11, key(6), key(3))  # puts again (no change) and ...
        assert cache.count(PREFIX) == 4
        for observer in etcd.observers:
            observer(12, [delete(key(3)), delete(key(8))])  # ... deletes one, and a missing one
        assert cache.count(PREFIX) == 3
        await etcd.events.put(_Event("PUT", _Kv(key(6), mod_revision=11)))
        await etcd.events.put(_Event("DELETE", _Kv(key(3), mod_revision=12)))
        await until(lambda: cache.after(PREFIX, PREFIX, 10) == [key(1), key(5), key(6)])
        assert cache.count(PREFIX) == 3
        await etcd.events.put(_Event("PUT", _Kv(key(7), mod_revision=13)))  # another node's
        await until(lambda: cache.count(PREFIX) == 4)
        assert cache.pending() == 0  # the missing key's delete, which brings no event, too


async def test_an_unsynced_cache_sends_counts_to_etcd() -> None:
    etcd = FakeEtcd(failures=[RegistryUnavailable("etcd away")] * 1000)
    async with following(etcd) as cache:
        etcd.wrote(9, key(6))
        assert cache.count(PREFIX) is None
