"""The change signal of one node's runtime: every state change wakes whoever waits on one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ChangeSignal:
    """One event per change: :meth:`changed` wakes every waiter, which re-checks its predicate.

    Single loop, not thread-safe. Callers never hold the event: a waiter takes the current one
    and a change replaces it, so no wake-up is lost between a check and the wait."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def changed(self) -> None:
        """Wake every waiter: something they may be waiting for changed."""
        self._event.set()
        self._event = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; re-checked after every change."""
        while not predicate():
            change = self._event
            await change.wait()
