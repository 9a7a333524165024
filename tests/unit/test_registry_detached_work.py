"""The registry's detached work, ended by its owner's close (no etcd or database needed: fakes
answer).

The store's group commit outlives the append that started it (it carries other callers'
appends), and :meth:`EtcdSessionStore.aclose` ends every commit still running: each append it
carried fails with :class:`RegistryUnavailable`, none is left waiting, nothing keeps running.
A watch whose caller left while it was being created is dropped once created, and
:meth:`Etcd.close` ends that drop too.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dsh_mesh.core import (
    HumanPromptEntry,
    Record,
    RegistryUnavailable,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
)
from dsh_mesh.logstore import MemoryLogStore
from dsh_mesh.registry import Etcd, EtcdConfig, EtcdSessionStore, Keys
from dsh_mesh.registry._codec import encode_header
from dsh_mesh.testing import FaultyLogStore, Hold

SESSION = SessionId("s-1")


class FakeEtcd:
    """An etcd that knows one root, ``SESSION``, with no activation."""

    async def get(self, key: bytes) -> Any:
        header = SessionHeader(
            session_id=SESSION,
            kind=SessionKind.ROOT,
            parent_session=None,
            spec=SessionSpec(preset="p", model="m"),
        )
        return SimpleNamespace(value=encode_header(header))

    async def txn(self, compares: Any, success: Any, failure: Any = ()) -> Any:
        """The one read of a write with no activation: the header, and no activation."""
        header = await self.get(b"")

        def answer(*kvs: Any) -> Any:
            return SimpleNamespace(response_range=SimpleNamespace(kvs=list(kvs)))

        return SimpleNamespace(
            succeeded=True, responses=[answer(header), answer()], header=SimpleNamespace(revision=5)
        )


def blocking_log() -> tuple[FaultyLogStore, Hold]:
    """A log store whose appends wait for the hold's release; ``left`` counts those that left
    it (their commit ended, or was cancelled)."""
    log = FaultyLogStore(MemoryLogStore())
    return log, log.faults.hold("append", times=None)


def _store(log: FaultyLogStore) -> EtcdSessionStore:
    return EtcdSessionStore(cast(Etcd, FakeEtcd()), Keys(b"/t/"), log=log, lease=lambda: 1)


async def _append(store: EtcdSessionStore, content: str) -> tuple[Record, Any]:
    return await store.append(SESSION, HumanPromptEntry(content=content), writer=None)


async def test_aclose_fails_every_append_of_a_running_commit_and_leaves_nothing_running() -> None:
    log, gate = blocking_log()
    store = _store(log)
    leader = asyncio.create_task(_append(store, "a"))
    await gate.reached.wait()  # "a" is in flight; the next two queue behind it
    queued = [asyncio.create_task(_append(store, c)) for c in ("b", "c")]
    await asyncio.sleep(0)
    await store.aclose()
    assert log.faults.calls["append"] == 1 and gate.left == 1
    for appending in (leader, *queued):
        # The leader too gets the store's answer, not the cancellation of its commit.
        with pytest.raises(RegistryUnavailable, match="interrupted"):
            await asyncio.wait_for(appending, 5)
    assert len(store._commits) == 0
    await store.aclose()  # idempotent
    assert log.faults.calls["append"] == 1


async def test_a_cancelled_leader_leaves_its_commit_running_for_the_others() -> None:
    log, gate = blocking_log()
    store = _store(log)
    leader = asyncio.create_task(_append(store, "a"))
    await gate.reached.wait()
    follower = asyncio.create_task(_append(store, "b"))
    await asyncio.sleep(0)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert len(store._commits) == 1
    gate.release.set()
    record, known = await asyncio.wait_for(follower, 5)
    assert record.seq == 2 and known is None  # "a" landed as 1 though its caller left
    await store.aclose()
    assert len(store._commits) == 0


async def test_aclose_with_nothing_running_returns() -> None:
    log, gate = blocking_log()
    store = _store(log)
    gate.release.set()
    record, _ = await _append(store, "a")
    assert record.seq == 1
    await store.aclose()
    assert len(store._commits) == 0


class FakeWatch:
    def __init__(self) -> None:
        self.cancelled = 0

    async def cancel(self) -> None:
        self.cancelled += 1


class SlowWatchClient:
    """An aetcd client whose watch creation waits for ``gate``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.creating = asyncio.Event()
        self.made = FakeWatch()
        self.creates_cancelled = 0
        self.closed = 0

    async def watch(self, *_: Any, **__: Any) -> FakeWatch:
        self.creating.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.creates_cancelled += 1
            raise
        return self.made

    async def close(self) -> None:
        self.closed += 1


async def _left_while_creating() -> tuple[Etcd, SlowWatchClient]:
    """An Etcd on a slow client whose only watcher was cancelled while its watch was created."""
    etcd = Etcd(EtcdConfig(endpoint="127.0.0.1:1"))  # never dialled
    client = SlowWatchClient()
    etcd._client = client

    async def follow() -> None:
        async for _ in etcd.watch_prefix(b"/p/", start_revision=1):
            pass

    following = asyncio.create_task(follow())
    await client.creating.wait()
    following.cancel()
    with pytest.raises(asyncio.CancelledError):
        await following
    return etcd, client


async def test_a_watch_created_after_its_caller_left_is_dropped() -> None:
    etcd, client = await _left_while_creating()
    assert len(etcd._dropping) == 1
    client.gate.set()
    await etcd._dropping.wait()
    assert client.made.cancelled == 1
    await etcd.close()


async def test_close_ends_a_watch_drop_still_waiting_for_its_create() -> None:
    etcd, client = await _left_while_creating()
    await etcd.close()
    assert len(etcd._dropping) == 0
    assert client.creates_cancelled == 1 and client.made.cancelled == 0
    assert client.closed == 1
    await etcd.close()  # idempotent
