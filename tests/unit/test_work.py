"""DetachedWork: work that runs to its end whatever its caller does, owned and ended by its owner.

Asyncio reports a task's exception nobody retrieved through the loop's exception handler when
the task is collected ("Task exception was never retrieved"), not as a warning, so these tests
install a handler of their own and collect garbage before they look.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dsh_mesh.core import DetachedWork


class Boom(Exception):
    """The failure of a piece of work."""


@pytest.fixture
async def unhandled() -> AsyncIterator[list[dict[str, Any]]]:
    """What the test's loop's exception handler is given while the test runs."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)


def _never_retrieved(seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reports in ``seen`` of an exception nobody retrieved, once garbage is collected."""
    gc.collect()
    return [c for c in seen if "never retrieved" in str(c.get("message", ""))]


async def _result(value: int, gate: asyncio.Event | None = None) -> int:
    if gate is not None:
        await gate.wait()
    return value


async def _fail(gate: asyncio.Event | None = None) -> int:
    if gate is not None:
        await gate.wait()
    raise Boom("failed")


async def _cancelled_caller(work: DetachedWork, coroutine: Any, entered: asyncio.Event) -> None:
    """A caller of ``run`` that is cancelled while it waits."""

    async def caller() -> None:
        await work.run(coroutine)

    calling = asyncio.create_task(caller())
    await entered.wait()
    calling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await calling


async def test_run_returns_the_work_result() -> None:
    work = DetachedWork()
    assert await work.run(_result(7)) == 7
    assert len(work) == 0


async def test_run_raises_the_work_failure() -> None:
    work = DetachedWork()
    with pytest.raises(Boom):
        await work.run(_fail())
    assert len(work) == 0


async def test_start_names_the_task_and_returns_it() -> None:
    work = DetachedWork()
    task = work.start(_result(3), name="piece")
    assert task.get_name() == "piece"
    assert await task == 3


async def test_cancelling_the_caller_of_run_does_not_cancel_the_work(
    unhandled: list[dict[str, Any]],
) -> None:
    work = DetachedWork()
    entered, gate, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def piece() -> int:
        entered.set()
        await gate.wait()
        finished.set()
        return 1

    await _cancelled_caller(work, piece(), entered)
    assert len(work) == 1  # the caller is gone, its work is not
    gate.set()
    await work.wait()
    assert finished.is_set()
    assert len(work) == 0
    assert _never_retrieved(unhandled) == []


async def test_a_failure_whose_caller_was_cancelled_is_not_reported_as_never_retrieved(
    unhandled: list[dict[str, Any]],
) -> None:
    work = DetachedWork()
    entered, gate = asyncio.Event(), asyncio.Event()

    async def piece() -> int:
        entered.set()
        return await _fail(gate)

    await _cancelled_caller(work, piece(), entered)
    gate.set()
    await work.wait()
    assert len(work) == 0
    assert _never_retrieved(unhandled) == []


async def test_a_failure_nobody_awaits_is_not_reported_as_never_retrieved(
    unhandled: list[dict[str, Any]],
) -> None:
    work = DetachedWork()
    work.start(_fail())
    await work.wait()
    assert len(work) == 0
    assert _never_retrieved(unhandled) == []


async def test_the_never_retrieved_check_sees_a_bare_task_failure(
    unhandled: list[dict[str, Any]],
) -> None:
    # The control of the two tests above: without DetachedWork the failure is reported.
    bare = asyncio.get_running_loop().create_task(_fail())
    await asyncio.wait((bare,))
    del bare
    reported = _never_retrieved(unhandled)
    assert len(reported) == 1
    assert isinstance(reported[0]["exception"], Boom)


async def test_len_counts_the_work_still_running() -> None:
    work = DetachedWork()
    first_gate, second_gate = asyncio.Event(), asyncio.Event()
    first = work.start(_result(1, first_gate))
    second = work.start(_result(2, second_gate))
    assert len(work) == 2
    first_gate.set()
    assert await first == 1
    assert len(work) == 1
    second_gate.set()
    assert await second == 2
    assert len(work) == 0


async def test_cancel_then_wait_leaves_nothing_running() -> None:
    work = DetachedWork()
    gate = asyncio.Event()
    tasks = [work.start(_result(n, gate)) for n in range(3)]
    work.cancel()
    await work.wait()
    assert len(work) == 0
    assert all(task.cancelled() for task in tasks)


async def test_cancel_is_idempotent_and_harmless_when_nothing_runs() -> None:
    work = DetachedWork()
    work.cancel()
    task = work.start(_result(1, asyncio.Event()))
    work.cancel()
    work.cancel()
    await work.wait()
    assert task.cancelled()
    assert len(work) == 0


async def test_wait_also_awaits_work_started_meanwhile() -> None:
    work = DetachedWork()
    first_gate, second_gate = asyncio.Event(), asyncio.Event()
    second_done = asyncio.Event()

    async def second() -> None:
        await second_gate.wait()
        second_done.set()

    async def first() -> None:
        await first_gate.wait()
        work.start(second())

    work.start(first())
    waiting = asyncio.create_task(work.wait())
    await asyncio.sleep(0)  # the wait has begun, and sees only the first
    assert len(work) == 1 and not waiting.done()
    first_gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(work) == 1  # the first ended, the one it started runs
    assert not waiting.done()
    second_gate.set()
    await waiting
    assert second_done.is_set()
    assert len(work) == 0


async def test_aclose_cancels_and_awaits_everything_and_is_idempotent() -> None:
    work = DetachedWork()
    ended: list[str] = []

    async def piece() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # its clean-up takes a step: aclose waits for it
            ended.append("piece")

    tasks = [work.start(piece()) for _ in range(2)]
    await asyncio.sleep(0)
    await work.aclose()
    assert ended == ["piece", "piece"]
    assert all(task.cancelled() for task in tasks)
    assert len(work) == 0
    await work.aclose()
    assert len(work) == 0


async def test_on_done_is_called_once_per_finished_piece(
    unhandled: list[dict[str, Any]],
) -> None:
    calls: list[int] = []
    work = DetachedWork(on_done=lambda: calls.append(len(work)))
    assert await work.run(_result(1)) == 1
    assert calls == [0]  # called once the piece is no longer counted
    with pytest.raises(Boom):
        await work.run(_fail())
    assert len(calls) == 2
    cancelled = work.start(_result(2, asyncio.Event()))
    failed = work.start(_fail())
    await asyncio.sleep(0)
    cancelled.cancel()
    await work.wait()
    assert failed.done()
    assert len(calls) == 4
    await work.aclose()
    assert len(calls) == 4
    assert _never_retrieved(unhandled) == []
