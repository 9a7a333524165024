"""The bench's load runner: each concurrent caller makes its calls in its own task, so a call
keyed by its caller's task (the floors give each caller a session of its own) sees the same
task on every call. asyncio.wait_for wrapped each call in a new task: the floors then ran out
of sessions and `make bench` ended with an IndexError."""

from __future__ import annotations

import asyncio

from bench._measure import run_load


async def test_each_caller_makes_every_call_in_its_own_task() -> None:
    tasks: list[asyncio.Task[object] | None] = []

    async def call(_: int) -> None:
        tasks.append(asyncio.current_task())
        await asyncio.sleep(0)

    load = await run_load(call, calls=64, in_flight=4)
    assert len(tasks) == 64 and load is not None
    assert len({id(task) for task in tasks}) == 4
