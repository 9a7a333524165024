"""How a provider retries a call its endpoint failed for a while: backoff with jitter, within a
budget of attempts and of time."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retries of one model call refused as overloaded (429) or failed by the server (5xx, a
    dropped connection) before it streamed anything.

    The n-th retry waits half of ``min(max_backoff, initial_backoff * 2**(n-1))`` plus a random
    part up to the other half ("equal jitter": callers that failed together spread out, yet
    each waits a little). A ``Retry-After`` the endpoint sent is a floor. No retry starts when
    it would end past ``budget`` after the first attempt began, or past ``max_attempts``.
    """

    max_attempts: int = 5
    initial_backoff: timedelta = timedelta(milliseconds=500)
    max_backoff: timedelta = timedelta(seconds=8)
    budget: timedelta = timedelta(seconds=60)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff < timedelta(0) or self.max_backoff < self.initial_backoff:
            raise ValueError("backoffs must satisfy 0 <= initial_backoff <= max_backoff")
        if self.budget < timedelta(0):
            raise ValueError("budget must not be negative")

    def backoff(
        self, retry: int, *, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        ceiling = min(
            self.max_backoff.total_seconds(),
            self.initial_backoff.total_seconds() * 2 ** (retry - 1),
        )
        wait: float = ceiling / 2 + (rng or random.Random()).uniform(0, ceiling / 2)
        return max(wait, retry_after or 0.0)
