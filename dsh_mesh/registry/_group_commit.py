"""Group commit of transcript appends (ADR 0022): :class:`GroupCommit` owns the appends waiting
per session, the commit running for each session, and how a batch is formed, written and
answered.

Its owner (the node's :class:`~dsh_mesh.registry.EtcdSessionStore`) works out each append's
fence and encoded size and hands in the log store's append as a callable; this module knows
nothing of etcd, headers or activations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dsh_mesh.core import (
    ActivationFenced,
    ActivationId,
    ApprovalStale,
    DetachedWork,
    IdempotencyConflict,
    RegistryUnavailable,
    SessionId,
)
from dsh_mesh.runtime import Write, Written

BATCH_ENTRIES = 32
"""At most this many entries per group-commit transaction."""
BATCH_BYTES = 1024 * 1024
"""At most this much payload per group-commit transaction (its first entry's included); an
entry larger than this is committed alone."""


class AppendBatch(Protocol):
    """The log store's append (:meth:`~dsh_mesh.runtime.LogStore.append`): ``writes`` in one
    transaction under one fence, all or nothing."""

    async def __call__(
        self, session: SessionId, writes: Sequence[Write], *, fence: int, unfenced: bool = False
    ) -> list[Written]: ...


@dataclass(eq=False, kw_only=True)
class _Pending:
    """One append waiting for its group commit."""

    write: Write
    size: int
    fence: int
    unfenced: bool
    writer: ActivationId | None
    done: asyncio.Future[Written]


class GroupCommit:
    """The group commits of one node's appends: one queue and at most one commit running per
    session.

    Every method is safe to call concurrently from one event loop. :meth:`aclose` ends the
    commits still running; ``append`` is the caller's to close.
    """

    def __init__(self, append: AppendBatch) -> None:
        self._append = append
        self._queues: dict[SessionId, list[_Pending]] = {}
        self._flushing: set[SessionId] = set()
        self._flushes = DetachedWork()
        """The group commits running: each outlives the append that started it."""

    def __len__(self) -> int:
        """How many commits are running."""
        return len(self._flushes)

    async def aclose(self) -> None:
        """Cancel every group commit still running and wait until all have ended. Idempotent.

        Callers stop appending first (a commit started meanwhile is awaited, not cancelled).
        An append whose commit is cancelled fails with :class:`RegistryUnavailable` (its entry
        may or may not have landed, as after any outage mid-commit); none is left waiting."""
        await self._flushes.aclose()

    async def append(
        self,
        session: SessionId,
        write: Write,
        *,
        size: int,
        fence: int,
        unfenced: bool,
        writer: ActivationId | None,
    ) -> Written:
        """Append ``write`` (``size`` bytes encoded) to ``session`` under ``fence``, in one
        transaction with the appends queued beside it; what it became, or the error that
        refused its batch (``writer`` names the writer in a fence failure)."""
        pending = _Pending(
            write=write,
            size=size,
            fence=fence,
            unfenced=unfenced,
            writer=writer,
            done=asyncio.get_running_loop().create_future(),
        )
        # A caller cancelled while it waits leaves the outcome to nobody: mark a failure
        # as seen, so it is not logged as "never retrieved" (the caller already gave up).
        pending.done.add_done_callback(_seen)
        self._queues.setdefault(session, []).append(pending)
        if session not in self._flushing:
            # This caller commits for everyone waiting on the session. Detached: the batch
            # it carries is other callers' too, so its own cancellation must not stop it
            # (it ends only its wait). A commit cancelled by aclose() ends the wait too,
            # and its answer is this caller's pending.done, like every other caller's.
            self._flushing.add(session)
            flush = self._flushes.start(self._flush(session), name=f"flush {session}")
            await asyncio.wait((flush,))
        return await asyncio.shield(pending.done)

    async def _flush(self, session: SessionId) -> None:
        """Group commit: while appends to ``session`` wait, take them in arrival order and write
        as many as fit into one log-store transaction (same fence, at most ``BATCH_ENTRIES``
        entries and ``BATCH_BYTES`` of payload), then answer each caller with its own record.
        A key used twice in one batch is written once; the second use answers the first."""
        queue = self._queues[session]
        batch: list[_Pending] = []
        try:
            while queue:
                batch = [queue.pop(0)]
                size = batch[0].size
                while (
                    queue
                    and len(batch) < BATCH_ENTRIES
                    and (queue[0].fence, queue[0].unfenced) == (batch[0].fence, batch[0].unfenced)
                    and size + queue[0].size <= BATCH_BYTES
                ):
                    size += queue[0].size
                    batch.append(queue.pop(0))
                await self._commit(session, batch)
        finally:
            # In the same step as the queue goes: an append arriving after this starts a
            # commit of its own, and none can find a queue that nobody will commit. A commit
            # cancelled mid-batch (aclose) strands its batch too: _commit answers only on
            # Exception, and the batch may or may not have landed.
            for stranded in (*batch, *queue):
                if not stranded.done.done():
                    stranded.done.set_exception(
                        RegistryUnavailable(f"{session}: the commit was interrupted")
                    )
            queue.clear()
            self._queues.pop(session, None)
            self._flushing.discard(session)

    async def _commit(self, session: SessionId, batch: list[_Pending]) -> None:
        first = batch[0]
        try:
            written = await self._append(
                session, [p.write for p in batch], fence=first.fence, unfenced=first.unfenced
            )
        except (IdempotencyConflict, ApprovalStale) as conflict:
            if len(batch) == 1:
                _fail_waiting(batch, conflict)
                return
            # One retry reused its key for another message, or one decision answers a request
            # decided already, which refuses the whole batch: commit one by one, so only that
            # one is refused and the others go in, in order.
            for pending in batch:
                await self._commit(session, [pending])
            return
        except ActivationFenced as fenced:
            _fail_waiting(batch, ActivationFenced(f"{session}: writer {first.writer}: {fenced}"))
            return
        except Exception as failure:  # fails every waiting caller; none is left hanging
            _fail_waiting(batch, failure)
            return
        for pending, answer in zip(batch, written, strict=True):
            if not pending.done.done():
                pending.done.set_result(answer)


def _fail_waiting(batch: list[_Pending], failure: BaseException) -> None:
    """Fail every caller of ``batch`` still waiting."""
    for pending in batch:
        if not pending.done.done():
            pending.done.set_exception(failure)


def _seen(done: asyncio.Future[Written]) -> None:
    if not done.cancelled():
        done.exception()
