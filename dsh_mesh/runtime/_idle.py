"""Idle passivation (ADR 0044): one check per node ends the activations idle past
``idle_passivate_after``, so a node's memory follows its busy agents."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import timedelta

from dsh_mesh.agent import Agent
from dsh_mesh.runtime._residency import Residency

_log = logging.getLogger(__name__)

_MAX_CHECK_INTERVAL = timedelta(minutes=1)


class IdlePassivation:
    """Every :attr:`interval`, asks each agent of ``residency`` that has been idle with nothing
    unread (:attr:`Agent.idle_since`) for at least ``after`` and that ``may_settle`` (nothing on
    its way to it, no live child: docs/adr/0004) to end its activation.

    It is one loop per node, not a timer per agent: an idle agent costs it nothing but the
    float of its idle-since time, and each check is one pass over the resident agents. An
    agent is passivated between ``after`` and ``after + interval`` after it became idle.
    ``clock`` is ``time.monotonic``, the clock :attr:`Agent.idle_since` reads."""

    def __init__(
        self,
        *,
        residency: Residency,
        may_settle: Callable[[Agent], bool],
        after: timedelta,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if after <= timedelta(0):
            raise ValueError("after must be positive")
        self._residency = residency
        self._may_settle = may_settle
        self._after = after
        self._clock = clock

    @property
    def interval(self) -> timedelta:
        """How often it checks: a quarter of ``after``, at most a minute."""
        return min(self._after / 4, _MAX_CHECK_INTERVAL)

    def check(self, now: float | None = None) -> int:
        """Ask every agent idle for ``after`` or longer at ``now`` (default: the clock's
        now) that may end to end; returns how many were asked. Synchronous: what it reads is
        one consistent view of the event loop."""
        now = self._clock() if now is None else now
        return self._residency.passivate_idle_since(
            now - self._after.total_seconds(), may_settle=self._may_settle
        )

    async def run(self) -> None:
        """Check every :attr:`interval` until cancelled. A defect in one check is logged with
        its trace, and the next check runs: this loop shares the drivers' task group, which an
        exception would end."""
        while True:
            await asyncio.sleep(self.interval.total_seconds())
            try:
                self.check()
            except Exception:
                _log.exception("idle passivation: not checked this time")
