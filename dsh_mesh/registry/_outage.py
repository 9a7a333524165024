"""Saying an outage once: a loop that retries what etcd refuses (a watch, a reload) logs the
first failure, then at most one line a :data:`SAY_EVERY` while the failure lasts, and one line
when it ends; it waits longer between tries the longer the failure lasts, up to a cap. A node
that cannot reach etcd for minutes writes a few lines, not one per try (issue 36: a node started
without etcd wrote 2,293 lines in 30 s)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

SAY_EVERY = 30.0
"""Seconds between two lines about one failure that goes on."""


class Outage:
    """The failures of one retried thing (``what``: "directory: watch on b'/dsh/nodes/'"),
    said to ``log`` once, then every ``every`` seconds, and once more when they end. The
    delay before the next try starts at ``first_delay`` and doubles up to ``last_delay``.
    Not thread-safe: one loop's."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        first_delay: float,
        last_delay: float = 1.0,
        every: float = SAY_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._what = what
        self._first_delay = first_delay
        self._last_delay = max(first_delay, last_delay)
        self._every = every
        self._clock = clock
        self._since: float | None = None
        self._said_at = 0.0
        self._tries = 0
        self.last: str | None = None
        """The last failure's words while it lasts, else None."""

    def failed(self, error: object) -> float:
        """Note a failed try; returns the seconds to wait before the next one."""
        now = self._clock()
        self._tries += 1
        self.last = str(error)
        if self._since is None:
            self._since = self._said_at = now
            self._log.warning("%s broke: %s", self._what, self.last)
        elif now - self._said_at >= self._every:
            self._said_at = now
            self._log.warning(
                "%s still broken after %.0f s (%d tries): %s",
                self._what,
                now - self._since,
                self._tries,
                self.last,
            )
        return min(self._last_delay, self._first_delay * (1 << min(self._tries - 1, 16)))

    def ended(self) -> None:
        """Note a try that worked: said once if a failure lasted until now."""
        if self._since is None:
            return
        if self._tries > 1:
            self._log.warning(
                "%s works again after %.1f s (%d tries)",
                self._what,
                self._clock() - self._since,
                self._tries,
            )
        self._since, self._tries, self.last = None, 0, None
