"""A call to a node that lost its target mid-call is given up at once, not at its deadline
(found by the fault run: a prompt to a root on a host cut off waited out the client's 5 s
deadline, though the host's lease lapsed after 2 s)."""

from __future__ import annotations

import asyncio

import pytest

from dsh_mesh.core import RegistryUnavailable
from dsh_mesh.runtime import Departed, unless_departed


async def test_a_call_whose_target_departs_is_cancelled_and_reported() -> None:
    cancelled = asyncio.Event()
    there = True

    async def hangs() -> str:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return "never"

    async def still_there() -> bool:
        return there

    waiting = asyncio.create_task(unless_departed(hangs(), still_there, what="node-b", every=0.01))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # still there: keep waiting
    there = False
    with pytest.raises(Departed, match="node-b went away"):
        await asyncio.wait_for(waiting, 1.0)
    assert cancelled.is_set()


async def test_a_call_that_answers_returns_its_answer() -> None:
    async def answers() -> str:
        await asyncio.sleep(0.03)
        return "accepted"

    async def still_there() -> bool:
        return True

    assert await unless_departed(answers(), still_there, what="node-b", every=0.01) == "accepted"


async def test_a_check_that_cannot_reach_the_registry_cancels_nothing() -> None:
    async def answers() -> str:
        await asyncio.sleep(0.05)
        return "accepted"

    async def registry_away() -> bool:
        raise RegistryUnavailable("etcd is away")

    assert await unless_departed(answers(), registry_away, what="node-b", every=0.01) == "accepted"


async def test_the_callers_cancellation_cancels_the_call() -> None:
    cancelled = asyncio.Event()

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    async def still_there() -> bool:
        return True

    waiting = asyncio.create_task(unless_departed(hangs(), still_there, what="node-b", every=0.01))
    await asyncio.sleep(0.03)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cancelled.is_set()
