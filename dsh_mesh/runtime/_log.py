"""The log store a session store keeps transcripts and idempotency records in, fenced by etcd
revisions (ADR 0026); its backends are the ``dsh_mesh.logstore`` package."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from dsh_mesh.core import Entry, Record, SessionId, SessionUsage
from dsh_mesh.runtime._condition import StoreCondition
from dsh_mesh.runtime._store import Acceptance, IdempotencyKey

DEFAULT_PAGE = 500
"""Records one :meth:`LogStore.read` returns when no limit is given."""


@dataclass(frozen=True, kw_only=True)
class Write:
    """One entry to append, with the idempotency key that guards it (if any)."""

    entry: Entry
    idempotency: tuple[IdempotencyKey, Acceptance] | None = None


@dataclass(frozen=True, kw_only=True)
class Written:
    """What one :class:`Write` became: its record, or (``known`` set) the record of the first
    write under its key, when that key was used before and nothing was written."""

    record: Record
    known: Acceptance | None = None


@dataclass(frozen=True, kw_only=True)
class Logged:
    """A record with the session it belongs to and its position in the whole store."""

    session: SessionId
    position: int
    record: Record


@dataclass(frozen=True, kw_only=True)
class KeptUsage:
    """A session's usage as its log store keeps it: the sum over its model calls up to and
    including seq ``through`` (0: none yet), the last call it covers."""

    usage: SessionUsage
    through: int


class LogStore(Protocol):
    """Durable transcripts and idempotency records. Every method is safe to call concurrently
    from one event loop, and from several processes sharing the same store.

    Each session has a fence, an etcd revision that only rises. An activation writes under its
    activation key's create revision; a writer with no activation under the revision at which
    it saw the session without one (ADR 0026).

    ``condition`` holds the store's last refusal (``REGISTRY_UNAVAILABLE`` or
    ``STORE_REFUSED``), for the node's health."""

    condition: StoreCondition

    async def raise_fence(self, session: SessionId, fence: int) -> int:
        """Raise ``session``'s fence to ``fence`` unless it is higher already; return the fence
        now current. A new activation calls this (with its create revision) before it reads
        the transcript: no append under an older fence lands after it. Durable when it
        returns."""
        ...

    async def append(
        self, session: SessionId, writes: Sequence[Write], *, fence: int, unfenced: bool = False
    ) -> list[Written]:
        """Append ``writes`` in order, as the next seqs, in one transaction: all land or none.

        A write whose key is known writes nothing and answers the first acceptance (raising
        ``IdempotencyConflict`` when the key was used for another request); a new key is
        recorded with its entry, the acceptance's ``seq`` filled in. If anything is to be
        written, the fence is checked first, and ``ActivationFenced`` raised when it fails:

        - fenced (an activation's write): ``fence`` must equal the session's fence;
        - ``unfenced`` (a writer with no activation): ``fence`` must be at least the session's
          fence, which it then becomes.

        Records carry ``recorded_at`` (UTC, when written). Durable when it returns."""
        ...

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int = DEFAULT_PAGE
    ) -> list[Record]:
        """Up to ``limit`` of ``session``'s records after ``after_seq``, in seq order (empty
        for a session with no records)."""
        ...

    async def horizon(self) -> int:
        """A position at or below which every record is committed and readable: no append that
        commits later gets a position at or below it. Only rises. Feeds read up to it."""
        ...

    async def since(
        self, sessions: Collection[SessionId], *, after: int, upto: int, limit: int = DEFAULT_PAGE
    ) -> list[Logged]:
        """Up to ``limit`` records of ``sessions`` whose position is above ``after`` and at most
        ``upto``, in position order. Every record has a position, strictly increasing along
        each session's seqs. Across sessions positions need not follow commit order (two
        transactions may commit in either order): a reader reads only up to :meth:`horizon`."""
        ...

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        """The first acceptance recorded under ``key``, if any."""
        ...

    async def last(self, session: SessionId) -> Record | None:
        """``session``'s last record (None when it has none): one row read, however long the
        transcript."""
        ...

    async def last_compaction(self, session: SessionId) -> Record | None:
        """``session``'s last record holding a ``CompactionEntry`` (None when it has none):
        one indexed read, however long the transcript. The store indexes every compaction it
        appends, in the append's transaction."""
        ...

    async def usage(self, session: SessionId) -> KeptUsage | None:
        """The usage of ``session``'s model calls (steps and compactions), kept as each is
        appended, in the append's transaction: one row read, however long the transcript.
        ``None`` when the store keeps none for it: no record, or a transcript written before
        the store kept usage and with no model call appended since (a reader sums it then)."""
        ...

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        """The approval requests of ``sessions`` that no decision has answered yet, each with
        its session, by session then seq: one indexed read, however long the transcripts. The
        store indexes every request and decision it appends, in the append's transaction (a
        later request on the same call replaces the earlier one)."""
        ...

    async def stranded_approvals(
        self, now: datetime, *, limit: int
    ) -> list[tuple[SessionId, Record, bool]]:
        """Up to ``limit`` approval requests (of any session) whose call has no result yet and
        that either expired undecided (``expires_at`` at or before ``now``) or were decided,
        each with its session and whether it was decided, by session then seq: what a node
        looks at to wake an absent agent that has a request to answer as denied, or a decision
        to read (one indexed read)."""
        ...

    async def delete(self, session: SessionId, fence: int) -> None:
        """Forget ``session``: its records and the idempotency records that point at them go,
        in one transaction that first raises its fence to ``fence`` (the etcd revision that
        deleted its header). The fence stays: a writer from before the deletion is refused,
        as after any raise. Idempotent. Durable when it returns."""
        ...

    async def expire_keys(self, before: datetime) -> int:
        """Forget the idempotency records written before ``before`` (their entries stay): a
        retry under such a key is a new request. Returns how many went."""
        ...

    async def aclose(self) -> None:
        """Release the store's connections. Idempotent; no call may follow it."""
        ...
