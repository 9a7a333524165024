"""An agent's inbox: accepted inbound records waiting for a turn or a step boundary."""

from __future__ import annotations

import bisect

from dsh_mesh.core import INBOUND_TYPES, ApprovalDecisionEntry, Record, is_queue_delivery


class Inbox:
    """Accepted records in acceptance (seq) order, whatever order their deliveries came in: two
    accepts' answers may come back in the reverse of their seqs. Steer records wait for the
    next step boundary (or start a turn together); each Queue record (a human prompt) starts a
    turn of its own. Not thread-safe."""

    def __init__(self) -> None:
        self._waiting: list[Record] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, record: Record) -> None:
        if not isinstance(record.entry, INBOUND_TYPES):
            raise TypeError(f"only inbound records enter an inbox, got {record.entry!r}")
        bisect.insort(self._waiting, record, key=lambda r: r.seq)

    def take_turn_input(self) -> list[Record]:
        """What the next turn starts with: the oldest record if it is a human prompt, else every
        steer record waiting (in acceptance order), leaving prompts for their own turns."""
        if self._waiting and _queued(self._waiting[0]):
            return [self._waiting.pop(0)]
        return self.take_steered()

    def take_steered(self) -> list[Record]:
        """Every waiting steer record, in seq order; human prompts stay queued."""
        steered = [record for record in self._waiting if not _queued(record)]
        self._waiting = [record for record in self._waiting if _queued(record)]
        return steered

    def has_decision(self, call_id: str) -> bool:
        """Whether a decision on the approval request of call ``call_id`` waits here."""
        return any(
            isinstance(r.entry, ApprovalDecisionEntry) and r.entry.call_id == call_id
            for r in self._waiting
        )

    def take_decisions(self) -> list[Record]:
        """Every waiting decision on an approval request, in seq order: they start the turn
        that goes on from the call waiting for one, before anything else is read."""
        taken = [r for r in self._waiting if isinstance(r.entry, ApprovalDecisionEntry)]
        self._waiting = [r for r in self._waiting if not isinstance(r.entry, ApprovalDecisionEntry)]
        return taken

    def take_all(self) -> list[Record]:
        """Every waiting record, prompts too, in seq order; the inbox is empty after."""
        waiting, self._waiting = sorted(self._waiting, key=lambda r: r.seq), []
        return waiting


def _queued(record: Record) -> bool:
    return is_queue_delivery(record.entry)  # type: ignore[arg-type]
