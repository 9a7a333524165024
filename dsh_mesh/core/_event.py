"""An event flag for objects kept by the hundred thousand: :class:`LightEvent`."""

from __future__ import annotations

import asyncio
from typing import Literal


class LightEvent:
    """:class:`asyncio.Event`'s contract (``set``, ``clear``, ``is_set``, ``wait``) that holds
    nothing for waiters until one waits. Python 3.11's ``asyncio.Event`` allocates its waiter
    deque when it is made, about 760 bytes; an idle resident agent holds three events, and at
    100,000 agents on one node those deques were a fifth of the node's memory (ADR 0047).

    Not thread-safe: one event loop, as ``asyncio.Event``. A waiter woken by :meth:`set` returns
    True even when :meth:`clear` follows before it runs.
    """

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Set the flag and wake every waiter."""
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> Literal[True]:
        """Return True once the flag is set (at once if it is)."""
        if self._set:
            return True
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
            return True
        finally:
            # Cancelled (or woken): the list goes once nobody waits, and with it its memory.
            waiters = self._waiters
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    self._waiters = None
