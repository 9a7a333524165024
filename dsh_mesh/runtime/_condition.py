"""Whether a log store refuses now, and why: what a node's health says of its log store."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from dsh_mesh.core import Rejected

DEGRADED_FOR = timedelta(seconds=15)
"""How long after its last refusal a log store still counts as refusing. An agent waiting at
its step boundary tries again at least every second (``outage_backoff_max``), so a store that
keeps refusing is reported without a gap; one that stopped refusing is clear within this."""


class StoreCondition:
    """The last refusal of one log store (an outage or a refusal an operator must mend), noted
    by the backend where it maps its driver's exceptions, and cleared by its next accepted
    write. Read by the node's health: the store is *degraded* while its last refusal is younger
    than ``window`` and no write was accepted since (a store that refuses writes and serves
    reads, a revoked INSERT, stays degraded). Not thread-safe: noted and read on the event
    loop."""

    def __init__(
        self,
        *,
        window: timedelta = DEGRADED_FOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window.total_seconds()
        self._clock = clock
        self._last: tuple[float, str] | None = None

    def refused(self, refusal: Rejected) -> Rejected:
        """Note ``refusal`` as the store's latest (and return it, for ``raise``)."""
        self._last = (self._clock(), f"{refusal.reason.value}: {refusal.detail}")
        return refusal

    def accepted(self) -> None:
        """Note that the store took a write: whatever it refused before has passed (a blip
        does not leave the store reported degraded for the whole window)."""
        self._last = None

    def degraded(self) -> str | None:
        """Why the store counts as refusing now (its last refusal's reason and words), or
        None when it has not refused within the window."""
        if self._last is None or self._clock() - self._last[0] >= self._window:
            return None
        return self._last[1]
