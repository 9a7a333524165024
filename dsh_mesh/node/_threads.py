"""Where a node runs blocking Python tools: daemon threads, a bounded number at once."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Work = tuple[Future[Any], Callable[[], Any]]


class ToolThreads(Executor):
    """Runs calls on up to ``limit`` daemon threads, started as calls need them and kept for
    the next ones (a call past the limit waits for a free thread). Daemon threads, unlike a
    ``ThreadPoolExecutor``'s: a blocking call cannot be stopped, and a node that drains and
    exits must not wait for one (an interrupted or timed-out call was answered when its turn
    ended). :meth:`shutdown` refuses new calls and never waits."""

    def __init__(self, limit: int, *, name: str = "dsh-tool") -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._limit = limit
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the node's tool threads are shut down")
            self._work.put((future, lambda: fn(*args, **kwargs)))
            if self._idle == 0 and self._threads < self._limit:
                self._threads += 1
                name = f"{self._name}-{self._threads}"
                threading.Thread(target=self._serve, name=name, daemon=True).start()
            else:
                self._idle -= 1 if self._idle else 0
        return future

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            future, call = work
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as failure:  # handed to the caller through the future
                    future.set_exception(failure)
                else:
                    future.set_result(result)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            for _ in range(self._threads):
                self._work.put(None)

    def __repr__(self) -> str:
        return f"ToolThreads({self._name!r})"
