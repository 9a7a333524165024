"""The durable session store the continuation manager runs on.

The in-memory implementation serves tests and the in-process demo; the etcd implementation
(next layer) keeps exactly this contract: create-only headers, one current activation per
session won by create-if-absent, fenced transcript appends, idempotency records written with
the entry they protect.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from dsh_mesh.core import (
    Activation,
    ActivationId,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ApprovalStale,
    Delivery,
    DeliveryKind,
    Entry,
    IdempotencyConflict,
    InboundEntry,
    Record,
    SessionHeader,
    SessionId,
    TreeStop,
    bounded_quote,
)


@dataclass(frozen=True, kw_only=True)
class IdempotencyKey:
    """Who asked and the key they chose. The principal is a sender session (agent messages),
    ``human:<session>`` (prompts), ``notice:<parent>`` (settlement notices, keyed by the child
    activation) or ``spawn:<child>`` (a new child's first entries, keyed by entry type)."""

    principal: str
    key: str


@dataclass(frozen=True, kw_only=True)
class Acceptance:
    """What an idempotency record remembers: the first acceptance of a keyed request."""

    target: SessionId
    seq: int
    target_activation: ActivationId
    kind: DeliveryKind
    fingerprint: str


@dataclass(frozen=True, kw_only=True)
class Resumption:
    """What :meth:`SessionStore.try_resume` found: the session's current activation (the one
    asked for when the call won it) and, when it won, the session's context as of that moment
    (read after every earlier activation was fenced off): the whole transcript, or, once it was
    compacted, what its latest compaction kept and everything after that compaction's range
    (:func:`~dsh_mesh.core.context_of`); or, instead of either, the first acceptance of an
    idempotency key already used."""

    current: Activation | None
    records: tuple[Record, ...] = ()
    known: Acceptance | None = None
    at_win: AtWin | None = None
    """What the winning transaction read with the win, if the store read it there."""


@dataclass(frozen=True, kw_only=True)
class AtWin:
    """What a store read in the same transaction that won an activation (ADR 0043), so that
    the resume needs no read of its own to bind to its parent and to adopt its children: the
    parent's current activation (``None`` for a root or an absent parent) and whether any
    child of the session holds an activation (``None``: not known from that read)."""

    parent: Activation | None
    live_children: bool | None


@dataclass(frozen=True, kw_only=True)
class TreeCensus:
    """What :meth:`SessionStore.tree_census` counted of one tree, cluster-wide: its ``root``,
    its members other than the root that hold an activation now (``live_descendants``) and
    its members created at or after the census's ``since`` (``created_since``, the root
    included). A count may miss a write in flight: limits built on it are exact only up to
    the spawns decided at the same moment."""

    root: SessionId
    live_descendants: int
    created_since: int


@dataclass(frozen=True, kw_only=True)
class NamespaceCensus:
    """What :meth:`SessionStore.namespace_census` counted of one namespace, cluster-wide: its
    sessions that hold an activation now (``live_sessions``) and its roots created at or after
    the census's ``since`` (``roots_since``). Exact up to the creations decided at the same
    moment, as a :class:`TreeCensus` is."""

    namespace: str
    live_sessions: int
    roots_since: int


class SessionStore(Protocol):
    """Durable state of sessions. Every method is safe to call concurrently from one loop."""

    async def create_header(self, header: SessionHeader, entries: Sequence[Entry] = ()) -> None:
        """Create the session with ``entries`` as its transcript's seqs 1..n, in one atomic step:
        a session exists whole, or not at all. Create-only: raises ``SessionExists`` (and writes
        nothing) if the id is taken; headers never change. The session has no activation yet,
        so the entries are unfenced writes (``writer=None``). Durable when it returns.

        The stored header gets ``created_at`` (now, UTC) unless ``header`` carries one, and each
        entry its record's ``recorded_at``: :meth:`get_header` and :meth:`read` return them."""
        ...

    async def create_active(
        self, header: SessionHeader, entries: Sequence[Entry], activation: Activation
    ) -> Activation:
        """:meth:`create_header`, then :meth:`try_activate` of ``activation``, the store's
        fastest way: the current activation when it returns (``activation`` itself, unless a
        replay of the creation won it first). Raises ``SessionExists`` as
        :meth:`create_header` does. A store may create the two at once, so that the session
        is never seen without an activation."""
        ...

    async def get_header(self, session: SessionId) -> SessionHeader | None:
        """``session``'s header; None when no session has that id."""
        ...

    async def try_activate(self, activation: Activation) -> Activation:
        """Create the session's activation only if none exists. Returns the current activation:
        ``activation`` itself when this call won, the winner's otherwise."""
        ...

    async def try_resume(
        self, activation: Activation, *, unless_known: IdempotencyKey | None = None
    ) -> Resumption:
        """:meth:`try_activate` for an existing session, in one atomic step with reading its
        context (:class:`Resumption`): O(context), not O(transcript). With
        ``unless_known``, a key already recorded wins over everything else: nothing is
        activated and the result carries only the first acceptance under it."""
        ...

    async def current_activation(
        self, session: SessionId, *, fresh: bool = False
    ) -> Activation | None:
        """The session's current activation. An implementation may answer from a cache that
        follows the durable state closely; ``fresh`` asks for the durable state itself."""
        ...

    async def rebind(self, activation: Activation, parent_activation: ActivationId) -> Activation:
        """Re-point a current activation at a newer parent activation. Raises
        ``ActivationFenced`` if ``activation`` is no longer current."""
        ...

    async def release(self, activation: Activation, *, clean: bool = True) -> None:
        """End ``activation`` if it is still current; a no-op otherwise (idempotent). Unless
        ``clean`` (its notice is still owed, or it may leave entries unread), its held marker
        stays for the sweep to finish what it left (ADR 0043)."""
        ...

    async def live_children(self, session: SessionId) -> list[Activation]:
        """The current activations of ``session``'s children that are resident somewhere."""
        ...

    async def adopt_children(self, parent: Activation) -> list[Activation]:
        """Re-bind each live child of ``parent``'s session to ``parent``, by ``parent``'s own
        authority (only while it is current), so that its children may message it at once
        (ADR 0043). Returns every live child bound to ``parent`` (re-bound or already so).
        Raises ``ActivationFenced`` when ``parent`` is not held here."""
        ...

    async def append(
        self,
        session: SessionId,
        entry: Entry,
        *,
        writer: ActivationId | None,
        idempotency: tuple[IdempotencyKey, Acceptance] | None = None,
    ) -> tuple[Record, Acceptance | None]:
        """Append ``entry`` as the next seq, fenced: ``writer`` must be the current activation
        (``None``: the session must have none). Raises ``ActivationFenced`` otherwise. The
        record returned (and read back later) carries ``recorded_at``, when it was written.

        With ``idempotency``, a known key returns ``(its record, the first acceptance)`` and
        writes nothing; a new key is recorded in the same atomic step as the entry, with the
        acceptance's ``seq`` filled in. Durable when it returns.

        An approval decision that :func:`refuse_decision` refuses (a second one on its
        request, whoever writes it) raises ``ApprovalStale`` and writes nothing.
        """
        ...

    async def lookup(self, key: IdempotencyKey) -> Acceptance | None:
        """The first acceptance recorded under ``key``, if any."""
        ...

    async def seal(self, session: SessionId) -> bool:
        """If ``session`` has no activation now, make sure no writer of an activation that
        ended can still append to it (a frozen or cut-off host's write in flight), and return
        True; False when it has an activation. After True, a key not recorded yet never will
        be by such a writer: a refusal that says "not live" is then exact."""
        ...

    async def tree_census(self, session: SessionId, *, since: datetime) -> TreeCensus:
        """Count the tree ``session`` belongs to (:class:`TreeCensus`), counting members
        created at or after ``since``. Raises ``SessionUnknown`` for a session that does not
        exist."""
        ...

    async def namespace_census(self, namespace: str, *, since: datetime) -> NamespaceCensus:
        """Count ``namespace`` (:class:`NamespaceCensus`), counting roots created at or after
        ``since``. A namespace nothing was created in counts zero."""
        ...

    async def subtree(self, session: SessionId) -> list[SessionId]:
        """``session`` and its descendants, parents before their children, from the tree's
        index. Raises ``SessionUnknown``."""
        ...

    async def waiting_in_subtree(self, session: SessionId) -> list[tuple[SessionId, Record]]:
        """The approval requests no decision answered yet of ``session`` and its descendants,
        each with its session (docs/approvals.md): read from the tree's index and the log
        store's index of pending requests, not from any transcript. Raises
        ``SessionUnknown`` for a session that does not exist."""
        ...

    async def record_stop(self, stop: TreeStop) -> None:
        """Make ``stop`` the durable stop of the subtree under its session (replacing an
        earlier one); every node's :meth:`stops` shows it soon after. Raises
        ``SessionUnknown`` for a session that does not exist."""
        ...

    async def clear_stop(self, session: SessionId) -> bool:
        """Reopen the subtree under ``session``: its stop is gone (True when there was one).
        Idempotent."""
        ...

    def stops(self) -> dict[SessionId, TreeStop]:
        """Every subtree's stop not cleared, by the session it names, as this node last saw
        them (a stop another node made may show a moment later)."""
        ...

    async def last(self, session: SessionId) -> Record | None:
        """``session``'s last durable record (None when it has none); one read, however long
        the transcript."""
        ...

    async def read(
        self, session: SessionId, *, after_seq: int = 0, limit: int | None = None
    ) -> list[Record]:
        """``session``'s durable records after ``after_seq``, in seq order, at most ``limit``
        of them (None: all, read in bounded pages). Raises ``SessionUnknown`` for a session
        that does not exist."""
        ...

    async def read_context(self, session: SessionId) -> list[Record]:
        """What an agent of ``session`` needs of its transcript (``context_of``): from its
        last compaction on, the entries that compaction kept pending among them."""
        ...


def check_same_request(key: IdempotencyKey, known: Acceptance, asked: Acceptance) -> None:
    """Raise :class:`IdempotencyConflict` when ``key`` was first used for another message."""
    if known.fingerprint != asked.fingerprint or known.target != asked.target:
        raise IdempotencyConflict(
            f"key {bounded_quote(key.key)} was already used for another message"
        )


def duplicate_of(
    key: IdempotencyKey, known: Acceptance, target: SessionId, fingerprint: str
) -> Delivery:
    """The answer to a repeat of an accepted request; raises :class:`IdempotencyConflict` when
    ``key`` was used for another target or content."""
    if known.target != target or known.fingerprint != fingerprint:
        raise IdempotencyConflict(
            f"key {bounded_quote(key.key)} was already used for another message"
        )
    return Delivery(
        target=known.target,
        target_activation=known.target_activation,
        kind=known.kind,
        accepted_seq=known.seq,
        duplicate=True,
    )


def fingerprint(target: SessionId, entry: InboundEntry) -> str:
    """What a key remembers of its request: target, entry type and content."""
    digest = hashlib.sha256(f"{target}\0{type(entry).__name__}\0".encode())
    digest.update(getattr(entry, "content", "").encode())
    return digest.hexdigest()


def refuse_decision(
    session: SessionId,
    decision: ApprovalDecisionEntry,
    waiting: tuple[ApprovalRequestEntry, bool] | None,
) -> ApprovalStale | None:
    """The store's own refusal of ``decision`` (docs/approvals.md, "decided once"), given what
    the index of requests holds for its call: ``(the request whose call has no result yet,
    whether a decision answered it)``, or None. A request is decided at most once, and only
    while its call waits: a second decision on it, a decision on another request than the one
    waiting, or on a call that none waits on, is refused whoever writes it (the agent, a
    person through it, a node's sweep or stop, a retry whose first try landed). None when
    ``decision`` may be stored. Every store applies it in the append's own atomic step."""
    call = decision.call_id
    stale = {"call_id": call}
    if waiting is None:
        return ApprovalStale(
            f"{session}: no request waits on call {bounded_quote(call)}", metadata=stale
        )
    request, decided = waiting
    if decided:
        return ApprovalStale(
            f"{session}: call {bounded_quote(call)} was decided already", metadata=stale
        )
    if decision.request_digest != request.digest:
        return ApprovalStale(
            f"{session}: the request waiting on call {bounded_quote(call)} is not the one"
            f" decided (digest {request.digest[:12]}..., not {decision.request_digest[:12]}...)",
            metadata=stale,
        )
    return None
