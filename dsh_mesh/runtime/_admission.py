"""Waking admission (contract rule 4) and the node's intake limits.

A target cannot settle while a send to it is on its way: from before anything of the send can
suspend until the target's driver admits the accepted record, or the send fails. Each such send
holds one :class:`Reservation` of its target; the :class:`AdmissionLedger` owns them all, with
the node's in-flight count and each target's inbox limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from dsh_mesh.core import DetachedWork, InboxFull, NodeId, NodeOverloaded, Record, SessionId

T = TypeVar("T")


class _Hold(enum.Enum):
    HELD = "held"
    HANDED_OVER = "handed over"
    AWAITING_ADMISSION = "awaiting admission"
    RELEASED = "released"


class Reservation:
    """One waking send's hold on its target, released exactly once.

    Use as a context manager: leaving the block releases it, unless it was handed over to the
    next owner (:meth:`hand_over`, which returns the hold that owner enters) or bound to an
    accepted record (:meth:`admit_on`): the ledger releases it when the driver admits that
    record."""

    def __init__(self, ledger: AdmissionLedger, target: SessionId) -> None:
        self._ledger = ledger
        self.target = target
        self._hold = _Hold.HELD

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.end()

    def end(self) -> None:
        """Release the hold unless it was handed over or bound to a record; idempotent. The
        owner of work that may be cancelled before it runs (so before it enters its block)
        calls this when that work is done."""
        if self._hold is _Hold.HELD:
            self._hold = _Hold.RELEASED
            self._ledger._release(self.target)

    @property
    def released(self) -> bool:
        """Whether this hold was given back (by its block, or by the record's admission)."""
        return self._hold is _Hold.RELEASED

    def ends_with(self, work: asyncio.Future[Any]) -> None:
        """Release the hold (unless handed over or bound) when ``work`` ends: work cancelled
        before it ran (at shutdown) never entered the block that would release it."""
        work.add_done_callback(lambda _: self.end())

    async def hand_to(
        self, work: DetachedWork, accepting: Callable[[Reservation], Coroutine[Any, Any, T]]
    ) -> T:
        """Hand the hold over to ``accepting(hold)``, run detached by ``work`` to its end whatever
        this caller does, and await it. The hold is released by that work's block or its
        record's admission, or (cancelled before it ran) when its task ends."""
        handed = self.hand_over()
        task = work.start(accepting(handed))
        handed.ends_with(task)
        return await asyncio.shield(task)

    def hand_over(self) -> Reservation:
        """Pass the hold to a new owner (work that runs on after this block, whatever its
        caller does): this block no longer releases it; the returned one does."""
        if self._hold is not _Hold.HELD:
            raise RuntimeError(f"reservation of {self.target} is {self._hold.value}")
        self._hold = _Hold.HANDED_OVER
        return Reservation(self._ledger, self.target)

    def admit_on(self, seq: int) -> None:
        """The send's record ``seq`` is in the target's inbox: the hold ends when the target's
        driver admits it (:meth:`AdmissionLedger.admitted`), not with this block."""
        if self._hold is not _Hold.HELD:
            raise RuntimeError(f"reservation of {self.target} is {self._hold.value}")
        self._hold = _Hold.AWAITING_ADMISSION
        self._ledger._await_admission(self, seq)

    def _admitted(self) -> None:
        self._hold = _Hold.RELEASED
        self._ledger._release(self.target)


class AdmissionLedger:
    """Waking sends per target, records awaiting admission, and sends in flight on the node.

    ``on_release(target)`` is called after each release (the owner pokes the target's driver
    and signals the change). Single loop, not thread-safe."""

    def __init__(
        self,
        *,
        node_id: NodeId,
        max_inflight: int,
        max_inbox_depth: int,
        on_release: Callable[[SessionId], None],
    ) -> None:
        self._node_id = node_id
        self._max_inflight = max_inflight
        self._max_inbox_depth = max_inbox_depth
        self._on_release = on_release
        self._waking: Counter[SessionId] = Counter()
        self._awaiting: defaultdict[SessionId, dict[int, Reservation]] = defaultdict(dict)
        self._inflight = 0

    def reserve(self, target: SessionId) -> Reservation:
        """Hold ``target`` awake for one send, from now: call before anything can suspend."""
        self._waking[target] += 1
        return Reservation(self, target)

    def waking(self, target: SessionId) -> int:
        """How many sends hold ``target`` now (also those whose record awaits admission)."""
        return self._waking[target]

    def may_settle(self, target: SessionId) -> bool:
        """Whether no send holds ``target``: only then may its activation end."""
        return self._waking[target] == 0

    def only_awaiting_admission(self, target: SessionId) -> bool:
        """Whether every send holding ``target`` has its record in the inbox already."""
        return self._waking[target] <= len(self._awaiting.get(target, ()))

    def idle(self) -> bool:
        """Whether no send holds any target."""
        return not any(self._waking.values())

    def check_inbox(self, target: SessionId) -> InboxFull | None:
        """The refusal of one more send to ``target`` (its reservation counted), if over the
        inbox limit; None when it fits."""
        if self._waking[target] <= self._max_inbox_depth:
            return None
        return InboxFull(
            f"{target} holds {self._max_inbox_depth} unread messages and prompts;"
            " retry once it has read some",
            metadata={"target_session_id": target},
        )

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count one send or prompt this node handles; refused (NODE_OVERLOADED) past the
        limit."""
        if self._inflight >= self._max_inflight:
            raise NodeOverloaded(
                f"node {self._node_id} is handling {self._inflight} sends; retry after a back-off",
                metadata={"limit": "inflight_sends"},
            )
        self._inflight += 1
        try:
            yield
        finally:
            self._inflight -= 1

    def admitted(self, target: SessionId, records: Sequence[Record]) -> None:
        """``target``'s driver took ``records`` into a step: their sends' holds end."""
        awaiting = self._awaiting.get(target)
        if not awaiting:
            return
        for record in records:
            reservation = awaiting.pop(record.seq, None)
            if reservation is not None:
                reservation._admitted()
        if not awaiting:
            del self._awaiting[target]

    def _await_admission(self, reservation: Reservation, seq: int) -> None:
        self._awaiting[reservation.target][seq] = reservation

    def _release(self, target: SessionId) -> None:
        self._waking[target] -= 1
        if self._waking[target] <= 0:
            del self._waking[target]
        self._on_release(target)
