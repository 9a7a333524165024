"""Stores that let a test step into their calls: fail one, hold one, count them.

One plan of faults (:class:`Faults`) and one store per store protocol that runs every call
through it: :class:`FaultySessionStore` is the in-memory session store (its own calls from one
method to another pass through the plan too, as a subclass's would: a creation's entries are
appends), :class:`FaultyLogStore` wraps any log store (a real PostgreSQL or SQLite one included).
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar, cast

from dsh_mesh.core import (
    Activation,
    ActivationId,
    Entry,
    Record,
    SessionHeader,
    SessionId,
    TreeStop,
)
from dsh_mesh.runtime import (
    DEFAULT_PAGE,
    Acceptance,
    IdempotencyKey,
    InMemorySessionStore,
    KeptUsage,
    Logged,
    LogStore,
    NamespaceCensus,
    Resumption,
    TreeCensus,
    Write,
    Written,
)

T = TypeVar("T")

Proceed = Callable[[], Awaitable[Any]]
"""Carries the call out on the store underneath; answers what it answered."""


@dataclass(frozen=True)
class StoreCall:
    """One call a faulty store was asked: its method and its arguments by name (``self`` left
    out), as the store protocol names them."""

    method: str
    arguments: Mapping[str, object]

    def entries(self) -> list[Entry]:
        """What the call writes: a session store's ``entry`` or ``entries``, a log store's
        ``writes``; nothing for a call that writes none."""
        entry = self.arguments.get("entry")
        written = [] if entry is None else [cast(Entry, entry)]
        entries = self.arguments.get("entries", ())
        written.extend(e for e in cast(Sequence[Entry], entries))
        writes = self.arguments.get("writes", ())
        written.extend(w.entry for w in cast(Sequence[Write], writes))
        return written


When = Callable[[StoreCall], bool]
Step = Callable[[StoreCall, Proceed], Awaitable[Any]]


def writing(*kinds: type[Entry]) -> When:
    """Matches a call that writes an entry of one of ``kinds``."""
    return lambda call: any(isinstance(e, kinds) for e in call.entries())


@dataclass(eq=False)
class Fault:
    """One planned step into calls of ``method``: it meets the calls ``when`` matches (all of
    them: None), ``times`` of them (None: every one), and counts those it met in ``met``."""

    method: str
    step: Step
    when: When | None
    times: int | None
    met: int = 0

    @property
    def spent(self) -> bool:
        """It met every call it was planned for."""
        return self.times is not None and self.met >= self.times


@dataclass(eq=False)
class Hold:
    """What :meth:`Faults.hold` planned: a call that meets it sets ``reached`` and waits for
    ``release``; ``left`` counts the calls that went on (or were cancelled while held)."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    left: int = 0

    async def wait(self) -> None:
        """Where a held call waits: sets ``reached``, returns once ``release`` is set."""
        self.reached.set()
        try:
            await self.release.wait()
        finally:
            self.left += 1


class Faults:
    """A test's plan of faults for one store, and the count of every call it was asked.

    Each call meets at most one fault: the earliest planned for its method that matches it and
    is not spent. So faults planned in a row for the same calls meet them in that order (fail
    the first, lose the second's answer, ...). Used from one event loop."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        """How many calls of each method the store was asked (faulted or not)."""
        self._planned: list[Fault] = []

    def around(
        self, method: str, step: Step, *, when: When | None = None, times: int | None = 1
    ) -> Fault:
        """Plan ``step`` to run instead of the calls it meets; it carries a call out (or not)
        with the ``Proceed`` it is handed, and what it answers is the call's answer."""
        fault = Fault(method=method, step=step, when=when, times=times)
        self._planned.append(fault)
        return fault

    def before(
        self,
        method: str,
        action: Callable[[StoreCall], Awaitable[None]],
        *,
        when: When | None = None,
        times: int | None = 1,
    ) -> Fault:
        """Plan ``action`` to run just before the calls it meets are carried out; an action
        that raises fails the call, which then did nothing."""

        async def step(call: StoreCall, proceed: Proceed) -> Any:
            await action(call)
            return await proceed()

        return self.around(method, step, when=when, times=times)

    def after(
        self,
        method: str,
        action: Callable[[StoreCall], Awaitable[None]],
        *,
        when: When | None = None,
        times: int | None = 1,
    ) -> Fault:
        """Plan ``action`` to run once the calls it meets were carried out, before they answer;
        an action that raises loses the answer of a call that took effect."""

        async def step(call: StoreCall, proceed: Proceed) -> Any:
            answer = await proceed()
            await action(call)
            return answer

        return self.around(method, step, when=when, times=times)

    def fail(
        self,
        method: str,
        error: Exception,
        *,
        landed: bool = False,
        when: When | None = None,
        times: int | None = 1,
    ) -> Fault:
        """Plan the calls it meets to raise (a copy of) ``error``: before they did anything, or
        with ``landed`` after they took effect (the store's answer lost on its way back)."""

        async def fail(call: StoreCall) -> None:
            raise copy.copy(error)

        plan = self.after if landed else self.before
        return plan(method, fail, when=when, times=times)

    def hold(
        self,
        method: str,
        *,
        landed: bool = False,
        when: When | None = None,
        times: int | None = 1,
    ) -> Hold:
        """Plan the calls it meets to wait for the test (:class:`Hold`): before they are
        carried out, or with ``landed`` after (the call took effect; its answer waits)."""
        held = Hold()

        async def wait(call: StoreCall) -> None:
            await held.wait()

        plan = self.after if landed else self.before
        plan(method, wait, when=when, times=times)
        return held

    def withdraw(self, *faults: Fault) -> None:
        """Take ``faults`` out of the plan: no call meets them any more (a spent one is out
        already)."""
        for fault in faults:
            if fault in self._planned:
                self._planned.remove(fault)

    async def run(self, call: StoreCall, proceed: Callable[[], Awaitable[T]]) -> T:
        """Count ``call``, and carry it out through the fault it meets, if any."""
        self.calls[call.method] += 1
        fault = next(
            (
                f
                for f in self._planned
                if f.method == call.method and not f.spent and (f.when is None or f.when(call))
            ),
            None,
        )
        if fault is None:
            return await proceed()
        fault.met += 1
        if fault.spent:
            self._planned.remove(fault)
        return cast(T, await fault.step(call, proceed))


class FaultySessionStore(InMemorySessionStore):
    """The in-memory session store, every call run through :attr:`faults`."""

    def __init__(self) -> None:
        super().__init__()
        self.faults = Faults()

    async def create_header(self, header: SessionHeader, entries: Sequence[Entry] = ()) -> None:
        await self.faults.run(
            StoreCall("create_header", {"header": header, "entries": entries}),
            lambda: InMemorySessionStore.create_header(self, header, entries),
        )

    async def get_header(self, session: SessionId) -> SessionHeader | None:
        return await self.faults.run(
            StoreCall("get_header", {"session": session}),
            lambda: InMemorySessionStore.get_header(self, session),
        )

    async def try_activate(self, activation: Activation) -> Activation:
        return await self.faults.run(
            StoreCall("try_activate", {"activation": activation}),
            lambda: InMemorySessionStore.try_activate(self, activation),
        )

    async def try_resume(
        self, activation: Activation, *, unless_known: IdempotencyKey | None = None
    ) -> Resumption:
        return await self.faults.run(
            StoreCall("try_resume", {"activation": activation, "unless_known": unless_known}),
            lambda: InMemorySessionStore.try_resume(self, activation, unless_known=unless_known),
        )

    async def current_activation(
        self, session: SessionId, *, fresh: bool = False
    ) -> Activation | None:
        return await self.faults.run(
            StoreCall("current_activation", {"session": session, "fresh": fresh}),
            lambda: InMemorySessionStore.current_activation(self, session, fresh=fresh),
        )

    async def rebind(self, activation: Activation, parent_activation: ActivationId) -> Activation:
        return await self.faults.run(
            StoreCall("rebind", {"activation": activation, "parent_activation": parent_activation}),
            lambda: InMemorySessionStore.rebind(self, activation, parent_activation),
        )

    async def release(self, activation: Activation, *, clean: bool = True) -> None:
        await self.faults.run(
            StoreCall("release", {"activation": activation, "clean": clean}),
            lambda: InMemorySessionStore.release(self, activation, clean=clean),
        )

    async def adopt_children(self, parent: Activation) -> list[Activation]:
        return await self.faults.run(
            StoreCall("adopt_children", {"parent": parent}),
            lambda: InMemorySessionStore.adopt_children(self, parent),
        )

    async def append(
        self,
        session: SessionId,
        entry: Entry,
        *,
        writer: ActivationId | None,
        idempotency: tuple[IdempotencyKey, Acceptance] | None = None,
    ) -> tuple[Record, Acceptance | None]:
        arguments = {"session": session, "entry": entry, "writer": writer}
        return await self.faults.run(
            StoreCall("append", {**arguments, "idempotency": idempotency}),
            lambda: InMemorySessionStore.append(
                self, session, entry, writer=writer, idempotency=idempotency
            ),
        )

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        return await self.faults.run(
            StoreCall("lookup", {"key": key}), lambda: InMemorySessionStore.lookup(self, key)
        )

    async def seal(self, session: SessionId) -> bool:
        return await self.faults.run(
            StoreCall("seal", {"session": session}),
            lambda: InMemorySessionStore.seal(self, session),
        )

    async def tree_census(self, session: SessionId, *, since: datetime) -> TreeCensus:
        return await self.faults.run(
            StoreCall("tree_census", {"session": session, "since": since}),
            lambda: InMemorySessionStore.tree_census(self, session, since=since),
        )

    async def namespace_census(self, namespace: str, *, since: datetime) -> NamespaceCensus:
        return await self.faults.run(
            StoreCall("namespace_census", {"namespace": namespace, "since": since}),
            lambda: InMemorySessionStore.namespace_census(self, namespace, since=since),
        )

    async def waiting_in_subtree(self, session: SessionId) -> list[tuple[SessionId, Record]]:
        return await self.faults.run(
            StoreCall("waiting_in_subtree", {"session": session}),
            lambda: InMemorySessionStore.waiting_in_subtree(self, session),
        )

    async def record_stop(self, stop: TreeStop) -> None:
        await self.faults.run(
            StoreCall("record_stop", {"stop": stop}),
            lambda: InMemorySessionStore.record_stop(self, stop),
        )

    async def clear_stop(self, session: SessionId) -> bool:
        return await self.faults.run(
            StoreCall("clear_stop", {"session": session}),
            lambda: InMemorySessionStore.clear_stop(self, session),
        )

    async def last(self, session: SessionId) -> Record | None:
        return await self.faults.run(
            StoreCall("last", {"session": session}),
            lambda: InMemorySessionStore.last(self, session),
        )

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int | None = None
    ) -> list[Record]:
        return await self.faults.run(
            StoreCall("read", {"session": session, "after_seq": after_seq, "limit": limit}),
            lambda: InMemorySessionStore.read(self, session, after_seq=after_seq, limit=limit),
        )


class FaultyLogStore:
    """A :class:`~dsh_mesh.runtime.LogStore` that runs every call to ``inner`` through
    :attr:`faults` (:meth:`aclose` included, so a test can hold or fail a store's close)."""

    def __init__(self, inner: LogStore) -> None:
        self.inner = inner
        self.faults = Faults()
        self.condition = inner.condition

    async def raise_fence(self, session: SessionId, fence: int) -> int:
        return await self.faults.run(
            StoreCall("raise_fence", {"session": session, "fence": fence}),
            lambda: self.inner.raise_fence(session, fence),
        )

    async def append(
        self, session: SessionId, writes: Sequence[Write], *, fence: int, unfenced: bool = False
    ) -> list[Written]:
        arguments = {"session": session, "writes": writes, "fence": fence, "unfenced": unfenced}
        return await self.faults.run(
            StoreCall("append", arguments),
            lambda: self.inner.append(session, writes, fence=fence, unfenced=unfenced),
        )

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int = DEFAULT_PAGE
    ) -> list[Record]:
        return await self.faults.run(
            StoreCall("read", {"session": session, "after_seq": after_seq, "limit": limit}),
            lambda: self.inner.read(session, after_seq=after_seq, limit=limit),
        )

    async def horizon(self) -> int:
        return await self.faults.run(StoreCall("horizon", {}), self.inner.horizon)

    async def since(
        self, sessions: Collection[SessionId], *, after: int, upto: int, limit: int = DEFAULT_PAGE
    ) -> list[Logged]:
        arguments = {"sessions": sessions, "after": after, "upto": upto, "limit": limit}
        return await self.faults.run(
            StoreCall("since", arguments),
            lambda: self.inner.since(sessions, after=after, upto=upto, limit=limit),
        )

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        return await self.faults.run(
            StoreCall("lookup", {"key": key}), lambda: self.inner.lookup(key)
        )

    async def last(self, session: SessionId) -> Record | None:
        return await self.faults.run(
            StoreCall("last", {"session": session}), lambda: self.inner.last(session)
        )

    async def last_compaction(self, session: SessionId) -> Record | None:
        return await self.faults.run(
            StoreCall("last_compaction", {"session": session}),
            lambda: self.inner.last_compaction(session),
        )

    async def usage(self, session: SessionId) -> KeptUsage | None:
        return await self.faults.run(
            StoreCall("usage", {"session": session}), lambda: self.inner.usage(session)
        )

    async def pending_approvals(
        self, sessions: Collection[SessionId]
    ) -> list[tuple[SessionId, Record]]:
        return await self.faults.run(
            StoreCall("pending_approvals", {"sessions": sessions}),
            lambda: self.inner.pending_approvals(sessions),
        )

    async def stranded_approvals(
        self, now: datetime, *, limit: int
    ) -> list[tuple[SessionId, Record, bool]]:
        return await self.faults.run(
            StoreCall("stranded_approvals", {"now": now, "limit": limit}),
            lambda: self.inner.stranded_approvals(now, limit=limit),
        )

    async def delete(self, session: SessionId, fence: int) -> None:
        await self.faults.run(
            StoreCall("delete", {"session": session, "fence": fence}),
            lambda: self.inner.delete(session, fence),
        )

    async def expire_keys(self, before: datetime) -> int:
        return await self.faults.run(
            StoreCall("expire_keys", {"before": before}), lambda: self.inner.expire_keys(before)
        )

    async def aclose(self) -> None:
        await self.faults.run(StoreCall("aclose", {}), self.inner.aclose)
