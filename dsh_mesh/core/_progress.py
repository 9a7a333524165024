"""Has a tree settled? What each of its sessions still waits for, folded from its transcripts.

A tree has *settled* when nothing in it will move without someone outside: no session has a
turn open, an inbound entry no turn read (a task, prompt, message, notice or decision), or a
call that asked for a decision and has no result; and every child activation that ran a turn
has its settlement notice at its parent (contract rule 8: a notice is written while the child
still holds its session, so an activation that ran a turn and has no notice yet is still
settling).

:class:`TreeProgress` is fed one fact at a time, in each session's transcript order, by
whoever reads the transcripts: the SDK's ``MeshClient.run`` over a tree watch, and the fault
run's liveness count over what it read at the end (:meth:`TreeProgress.read` takes core
records). It never reads anything itself. Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from dsh_mesh.core._approval import ApprovalRequestEntry
from dsh_mesh.core._ids import ActivationId, SessionId
from dsh_mesh.core._transcript import (
    INBOUND_TYPES,
    ConsumedEntry,
    Record,
    SettlementNoticeEntry,
    ToolResultEntry,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
)


@dataclass
class SessionProgress:
    """What one session's transcript says it still waits for, so far."""

    open_turn: str | None = None
    """The id of a turn started and not yet ended."""
    last_outcome: TurnOutcome | None = None
    """How its last ended turn ended."""
    unread: dict[int, None] = field(default_factory=dict)
    """Seqs of inbound entries no ``ConsumedEntry`` has delivered yet, in acceptance order."""
    asking: dict[str, None] = field(default_factory=dict)
    """Call ids that asked for a decision and have no result yet."""
    ran: dict[ActivationId, None] = field(default_factory=dict)
    """Activations that started a turn here, in order."""


class TreeProgress:
    """The progress of one tree (or of every tree of a run), fed fact by fact, each session's
    in its transcript order. A session is known from the first fact fed about it."""

    def __init__(self) -> None:
        self._sessions: dict[SessionId, SessionProgress] = {}
        self._noticed: set[tuple[SessionId, ActivationId]] = set()

    def session(self, session: SessionId) -> SessionProgress:
        """``session``'s progress (an empty one for a session nothing was said of yet)."""
        return self._sessions.setdefault(session, SessionProgress())

    @property
    def sessions(self) -> Collection[SessionId]:
        """Every session a fact was fed for."""
        return self._sessions.keys()

    # -- facts ---------------------------------------------------------------------------------

    def turn_started(
        self, session: SessionId, turn_id: str, activation: ActivationId | None
    ) -> None:
        progress = self.session(session)
        progress.open_turn = turn_id
        if activation:
            progress.ran[activation] = None

    def turn_ended(self, session: SessionId, outcome: TurnOutcome | None) -> None:
        progress = self.session(session)
        progress.open_turn = None
        progress.last_outcome = outcome

    def inbound(self, session: SessionId, seq: int) -> None:
        self.session(session).unread[seq] = None

    def consumed(self, session: SessionId, seqs: Collection[int]) -> None:
        unread = self.session(session).unread
        for seq in seqs:
            unread.pop(seq, None)

    def asked(self, session: SessionId, call_id: str) -> None:
        self.session(session).asking[call_id] = None

    def answered(self, session: SessionId, call_id: str) -> None:
        self.session(session).asking.pop(call_id, None)

    def noticed(self, child: SessionId, activation: ActivationId) -> None:
        """A settlement notice for ``child``'s ``activation`` landed (at whichever parent)."""
        self._noticed.add((child, activation))

    def read(self, session: SessionId, record: Record) -> None:
        """Feed one core transcript record of ``session`` (in seq order)."""
        entry = record.entry
        if isinstance(entry, INBOUND_TYPES):
            self.inbound(session, record.seq)
        if isinstance(entry, TurnStartedEntry):
            self.turn_started(session, entry.turn_id, entry.activation_id or None)
        elif isinstance(entry, TurnEndedEntry):
            self.turn_ended(session, entry.outcome)
        elif isinstance(entry, ConsumedEntry):
            self.consumed(session, entry.seqs)
        elif isinstance(entry, ApprovalRequestEntry):
            self.asked(session, entry.call_id)
        elif isinstance(entry, ToolResultEntry):
            self.answered(session, entry.call_id)
        elif isinstance(entry, SettlementNoticeEntry):
            self.noticed(entry.child_session, entry.child_activation)

    # -- questions -----------------------------------------------------------------------------

    def owed(
        self, session: SessionId, held: Mapping[SessionId, ActivationId] | None = None
    ) -> list[ActivationId]:
        """The activations of ``session`` (a child) that ran a turn and have no notice yet;
        with ``held``, the activation holding the session still is left out (it owes its
        notice only when it ends)."""
        keep = None if held is None else held.get(session)
        return [
            activation
            for activation in self.session(session).ran
            if activation != keep and (session, activation) not in self._noticed
        ]

    def waits(
        self,
        session: SessionId,
        *,
        is_child: bool,
        held: Mapping[SessionId, ActivationId] | None = None,
    ) -> list[str]:
        """What ``session`` still waits for, one phrase each; empty when it has settled. A
        child (``is_child``) also waits for the notice of each activation that ran a turn."""
        progress = self.session(session)
        reasons: list[str] = []
        if progress.open_turn is not None:
            reasons.append(f"{session} has turn {progress.open_turn} open")
        if progress.unread:
            reasons.append(f"{session} has {len(progress.unread)} entries unread")
        if progress.asking:
            reasons.append(f"{session} has calls {list(progress.asking)} waiting for a decision")
        if is_child:
            reasons.extend(
                f"no notice yet for {session} activation {activation}"
                for activation in self.owed(session, held)
            )
        return reasons

    def tree_waits(self, root: SessionId) -> list[str]:
        """What the tree rooted at ``root`` still waits for: every session fed is taken to be
        of it, and every one but ``root`` a child."""
        reasons: list[str] = []
        for session in self._sessions:
            reasons.extend(self.waits(session, is_child=session != root))
        return reasons
