"""Where a node runs blocking Python tools: daemon threads, a bounded number at once."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ToolThreads(Executor):
    """Runs each call on a daemon thread of its own, at most ``limit`` at once (a call past it
    waits for a free slot). Daemon threads, unlike a ``ThreadPoolExecutor``'s: a blocking call
    cannot be stopped, and a node that drains and exits must not wait for one (an interrupted
    or timed-out call was answered when its turn ended). :meth:`shutdown` refuses new calls and
    never waits."""

    def __init__(self, limit: int, *, name: str = "dsh-tool") -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._slots = threading.BoundedSemaphore(limit)
        self._name = name
        self._numbers = itertools.count(1)
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        if self._closed:
            raise RuntimeError("the node's tool threads are shut down")
        future: Future[T] = Future()

        def run() -> None:
            with self._slots:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    result = fn(*args, **kwargs)
                except BaseException as failure:  # handed to the caller through the future
                    future.set_exception(failure)
                else:
                    future.set_result(result)

        name = f"{self._name}-{next(self._numbers)}"
        threading.Thread(target=run, name=name, daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"ToolThreads({self._name!r})"
