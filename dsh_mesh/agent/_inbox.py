"""An agent's inbox: accepted inbound records waiting for a turn or a step boundary."""

from __future__ import annotations

from collections import deque

from dsh_mesh.core import INBOUND_TYPES, Record, is_queue_delivery


class Inbox:
    """FIFO of accepted records. Steer records wait for the next step boundary (or start a turn
    together); each Queue record (a human prompt) starts a turn of its own. Not thread-safe."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[Record, bool]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, record: Record) -> None:
        if not isinstance(record.entry, INBOUND_TYPES):
            raise TypeError(f"only inbound records enter an inbox, got {record.entry!r}")
        self._waiting.append((record, is_queue_delivery(record.entry)))

    def take_turn_input(self) -> list[Record]:
        """What the next turn starts with: the oldest record if it is a human prompt, else every
        steer record waiting (in acceptance order), leaving prompts for their own turns."""
        if self._waiting and self._waiting[0][1]:
            return [self._waiting.popleft()[0]]
        return self.take_steered()

    def take_steered(self) -> list[Record]:
        """Every waiting steer record, FIFO; human prompts stay queued."""
        steered = [record for record, queued in self._waiting if not queued]
        self._waiting = deque(item for item in self._waiting if item[1])
        return steered
