"""What comes into one agent and the step boundary that reads it (docs/adr/0007).

One owner: the inbox of accepted records, the gate between accepts and boundaries, the doubt
an accept leaves when its answer was lost, the writes in flight (each runs to its end whatever
the turn does), and the trace links the next step's span takes from what a boundary read. The
records themselves are the :class:`~dsh_mesh.agent._transcript.LocalTranscript`'s; the host
is reached through the narrow calls of :class:`HostCalls`. It is never handed the agent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from dsh_mesh.agent._gate import BoundaryGate
from dsh_mesh.agent._inbox import Inbox
from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.core import (
    INBOUND_TYPES,
    ConsumedEntry,
    DeliveryKind,
    DetachedWork,
    Entry,
    Record,
)

T = TypeVar("T")


class HostCalls(Protocol):
    """The host's calls the boundary makes for its agent."""

    async def append(self, entry: Entry) -> Record:
        """Durably append ``entry`` (fenced)."""
        ...

    async def read_after(self, seq: int) -> Sequence[Record]:
        """The durable transcript after ``seq``."""
        ...

    def admitted(self, records: Sequence[Record]) -> None:
        """The driver consumed ``records``: their waking-send reservations end."""
        ...

    def deliver(self, record: Record) -> DeliveryKind:
        """Hand an inbound record that landed unseen to the agent, as an accept would."""
        ...


class Boundary:
    """The inbound side of one agent (see the module's docstring)."""

    def __init__(self, *, transcript: LocalTranscript, host: HostCalls) -> None:
        self._transcript = transcript
        self._host = host
        self.inbox = Inbox()
        self._gate = BoundaryGate()
        self._in_doubt = False
        self._doubts = 0
        """How often :meth:`doubt` was called: a read clears the doubt only if none came
        while it read (its snapshot may predate that accept's record)."""
        self._writes = DetachedWork()
        """Writes started by a turn: each runs to its end even if the turn is interrupted
        meanwhile, and the turn's close waits for them (:meth:`finish_writes`), so nothing
        lands after the turn's end."""
        self._links: list[str] = []

    @property
    def in_doubt(self) -> bool:
        """Whether an accept's answer was lost and what landed is not read yet."""
        return self._in_doubt

    def doubt(self) -> None:
        """An accept failed without knowing whether its append landed: the next boundary
        reads the transcript past what is held and takes any inbound record it finds."""
        self._in_doubt = True
        self._doubts += 1

    def accepting(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold off the step boundary while one inbound record is appended and delivered."""
        return self._gate.accepting()

    def take_links(self) -> list[str]:
        """The trace links of what the boundaries read since the last step took them."""
        links, self._links = self._links, []
        return links

    async def append(self, entry: Entry) -> Record:
        """Append ``entry`` and keep its record locally. Shielded: once a write starts it
        finishes and is kept, even if the turn is interrupted meanwhile, so the local
        transcript never lags the durable one."""

        async def write() -> Record:
            record = await self._host.append(entry)
            self._transcript.add(record)
            return record

        return await self._writes.run(write())

    async def append_shielded(self, entry: Entry) -> Record:
        """Append ``entry``, shielded, without keeping it (the caller delivers it)."""

        async def write() -> Record:
            return await self._host.append(entry)

        return await self._writes.run(write())

    async def finish_writes(self) -> None:
        """Wait for every write an interrupted turn left running: the step or result being
        written must be in the local transcript before the turn's open calls are closed."""
        await self._writes.wait()

    async def read_waiting(self, first: Sequence[Record] = (), *, steered: bool = True) -> bool:
        """The read of a step boundary (or of a turn's start, with the turn's ``first``
        records): every Steer record waiting, in seq order, made durable as one
        ``ConsumedEntry``. It holds the gate against accepts, so no Steer record durable before
        that entry is left unread. False when there was nothing to read. ``steered`` False:
        going on from a call waiting for approval reads only decisions (one that landed
        unseen, just taken, among them); the rest waits for the step's boundary."""

        async def read() -> list[Record]:
            await self.catch_up(0)
            waiting = self.inbox.take_steered() if steered else self.inbox.take_decisions()
            records = sorted([*first, *waiting], key=lambda r: r.seq)
            if records:
                record = await self._host.append(ConsumedEntry(seqs=tuple(r.seq for r in records)))
                self._transcript.add(record)
                self._host.admitted(records)
            return records

        records = await self.at_boundary(read)
        # The next step reads these: its span links to the spans that sent them.
        self._links.extend(getattr(r.entry, "trace", "") for r in records)
        return bool(records)

    async def at_boundary(self, write: Callable[[], Awaitable[T]]) -> T:
        """Run ``write`` with the gate held against accepts: every inbound record durable
        before what it writes is then in the inbox (docs/adr/0007). Shielded like any write;
        the gate opens when its entry is durable, or failed."""
        held = await self._gate.held()

        async def written() -> T:
            with held:
                return await write()

        return await self._writes.run(written())

    async def resolve_doubt(self) -> None:
        """Take what landed unseen, the gate held (a call waits: a decision may be among it)."""
        with await self._gate.held():
            await self.take_landed()

    async def catch_up(self, through: int) -> None:
        """Take what landed unseen, when in doubt or when a seq up to ``through`` is missing."""
        if self._in_doubt or self._transcript.held_through < through:
            await self.take_landed()

    async def take_landed(self) -> None:
        """Deliver every inbound record that landed without its accept knowing (the answer was
        lost). The doubt ends only once the read succeeded, and only if no other doubt came
        while it read: a decision takes what landed with other accepts still appending, and
        their lost answers are read next time."""
        doubts = self._doubts
        for record in await self._host.read_after(self._transcript.held_through):
            if self._transcript.holds(record.seq):
                continue
            if isinstance(record.entry, INBOUND_TYPES):
                self._host.deliver(record)
            else:
                self._transcript.add(record)
        if self._doubts == doubts:
            self._in_doubt = False
