"""Approval requests of absent agents (docs/approvals.md).

A resident agent answers its own expired request (its driver wakes at the deadline) and reads a
decision as it arrives. An absent one, passivated or lost with its host, has no driver. This
node finds such requests in the log store's index of requests whose call has no result: one
that expired undecided gets the mesh's denial (appended with no activation); then the agent is
resumed here, and its new driver reads the decision and goes on. A decision accepted just
before its agent's host died is read the same way.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from dsh_mesh.core import EXPIRED_APPROVAL_REASON, ApprovalRequestEntry, MeshError, SessionId
from dsh_mesh.runtime import ContinuationManager, LogStore, SessionStore, deny_absent

_log = logging.getLogger(__name__)

BATCH = 1000
"""Requests read per sweep."""
MAX_BACKOFF = 64
"""At most this many sweeps pass before a session that could not be resumed is tried again."""


class ApprovalExpiry:
    """Answers the expired requests of absent agents and wakes the agents that have a decision
    to read. Several nodes sweeping at once is safe: the denial is appended under the
    request's idempotency key and fenced against any activation, and one node wins each
    resume. A session that cannot be resumed (its subtree is closed, no node serves its tools)
    is tried again after 1, 2, 4, ... sweeps, so it never crowds the others out."""

    def __init__(self, *, log: LogStore, store: SessionStore) -> None:
        self._log = log
        self._store = store
        self._sweeps = 0
        self._later: dict[SessionId, tuple[int, int]] = {}
        """Sessions that failed to resume: (the sweep to try again at, the backoff)."""

    async def sweep(self, manager: ContinuationManager) -> list[SessionId]:
        """One look at the index: deny what expired undecided, then resume each absent
        session that has a request to read; returns the sessions resumed."""
        self._sweeps += 1
        stranded = await self._log.stranded_approvals(datetime.now(UTC), limit=BATCH)
        waking: dict[SessionId, None] = {}
        for session, record, decided in stranded:
            again = self._later.get(session)
            if again is not None and again[0] > self._sweeps:
                continue
            if await self._store.current_activation(session) is not None:
                continue  # resident: its own driver answers and reads
            if not decided:
                assert isinstance(record.entry, ApprovalRequestEntry)
                await deny_absent(self._store, session, record.entry, EXPIRED_APPROVAL_REASON)
            waking[session] = None
        woken: list[SessionId] = []
        for session in waking:
            try:
                await manager.resume(session)
            except MeshError as failure:
                backoff = min(MAX_BACKOFF, 2 * self._later.get(session, (0, 1))[1])
                self._later[session] = (self._sweeps + backoff, backoff)
                _log.info("%s: its approval waits for a resume (%s)", session, failure)
                continue
            self._later.pop(session, None)
            woken.append(session)
        return woken
