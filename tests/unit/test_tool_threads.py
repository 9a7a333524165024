"""A node's tool threads: daemon threads (an exiting node never waits for a blocking call that
cannot be stopped), at most ``limit`` calls at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsh_mesh.node._threads import ToolThreads


async def test_calls_run_on_daemon_threads_at_most_limit_at_once() -> None:
    threads = ToolThreads(2, name="t")
    release = threading.Event()
    running = 0
    most = 0
    lock = threading.Lock()
    daemons: list[bool] = []

    def work() -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            daemons.append(threading.current_thread().daemon)
        release.wait(5)
        with lock:
            running -= 1
        return 7

    loop = asyncio.get_running_loop()
    calls = [loop.run_in_executor(threads, work) for _ in range(5)]
    await asyncio.sleep(0.2)
    assert most == 2  # three wait for a slot
    release.set()
    assert await asyncio.gather(*calls) == [7] * 5
    assert most == 2 and all(daemons)


async def test_a_failure_reaches_the_caller_and_a_shut_executor_refuses() -> None:
    threads = ToolThreads(1)

    def broken() -> None:
        raise OSError("no disk")

    with pytest.raises(OSError, match="no disk"):
        await asyncio.get_running_loop().run_in_executor(threads, broken)
    threads.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        threads.submit(print)
