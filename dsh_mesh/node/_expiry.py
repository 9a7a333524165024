"""Expiring approval requests of absent agents (docs/approvals.md).

A resident agent answers its own expired request (its driver wakes at the deadline). An absent
one, passivated or lost with its host, has no driver: this node finds its expired requests in
the log store's index and resumes it, and its new driver answers them as denied and goes on.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from dsh_mesh.core import MeshError, SessionId
from dsh_mesh.runtime import ContinuationManager, LogStore, SessionStore

_log = logging.getLogger(__name__)

BATCH = 100
"""Expired requests read per sweep."""


class ApprovalExpiry:
    """Wakes absent agents whose approval requests expired. Holds no state between sweeps;
    several nodes sweeping at once is safe: one wins each resume, the others find the session
    resident (or resumed) and leave it."""

    def __init__(self, *, log: LogStore, store: SessionStore) -> None:
        self._log = log
        self._store = store

    async def sweep(self, manager: ContinuationManager) -> list[SessionId]:
        """Resume here every absent session with an expired request (up to :data:`BATCH`
        requests a sweep); returns the sessions resumed. A session that cannot be resumed now
        (its subtree is closed, this node cannot serve its tools, it was resumed elsewhere
        meanwhile) is left for the next sweep or the next message."""
        due = await self._log.due_approvals(datetime.now(UTC), limit=BATCH)
        woken: list[SessionId] = []
        for session in dict.fromkeys(s for s, _ in due):
            if await self._store.current_activation(session) is not None:
                continue  # resident: its own driver answers at the deadline
            try:
                await manager.resume(session)
            except MeshError as failure:
                _log.info("%s: its expired approval waits (%s)", session, failure)
                continue
            woken.append(session)
        return woken
