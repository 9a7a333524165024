"""The history checker's liveness counts: did every tree heal itself, with no outside nudge?

A fault run (issue 33, point 6) opens a tree's rounds only by prompting its root, as a user
would: nothing prompts a stalled agent awake. After the faults stop it waits a stated bound
(:func:`settle_bound`) for every tree to finish its round, then reads the mesh's
:class:`EndState` and counts, beside the safety counts:

- *activations without exactly one notice*: a child activation that ran at least one turn (a
  ``TurnStartedEntry`` carries its id) without exactly one settlement notice for it at its
  parent (contract rule 8). An activation that ran no turn owes none; the activation that still
  holds its session at the end owes none yet (:func:`unnoticed_activations`);
- *stalled trees*: a tree whose round did not finish within the bound: one of its sessions left
  a turn open, holds an entry no turn read, has a call still waiting for a decision, or one of
  its child activations has no notice yet (:func:`unfinished_trees`);
- *sessions left with unread entries*: an inbound entry (agent message, settlement notice,
  human prompt, approval decision, task) that no turn consumed, at a session no activation
  holds (:func:`unread_sessions`);
- *replies refused PARENT_REBOUND that never landed*: a child's ``send_message`` to its parent
  refused ``PARENT_REBOUND`` whose content never reached the parent, then or later, as a
  message or in the child's final answer (its settlement notice: where a model puts a reply its
  parent, gone again, could not take), unless the refusal was the last thing its turn saw
  before it ended ``lost`` (the sender's host died before its model could send again; the
  parent's ``lost`` notice says so) (:func:`rebound_replies_lost`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dsh_mesh.core import (
    ActivationId,
    AgentMessageEntry,
    AssistantStepEntry,
    Record,
    SessionId,
    SettlementNoticeEntry,
    ToolResultEntry,
    TreeProgress,
    TurnEndedEntry,
    TurnOutcome,
    TurnStartedEntry,
    pending_inbound,
)
from dsh_mesh.node import NodeConfig


@dataclass(frozen=True, kw_only=True)
class EndState:
    """What the mesh holds when a run is read, beside the transcripts: each session's parent
    (``None`` for a root), the activation that holds each session still held, and the bound
    (seconds) the run waited after its faults for every tree to finish its round."""

    parents: Mapping[SessionId, SessionId | None]
    held: Mapping[SessionId, ActivationId]
    bound: float


SWEEP_INTERVAL = NodeConfig.sweep_interval.total_seconds()
"""Seconds between two sweeps of a dead lease's activations by a live node (the nodes'
``sweep_interval`` default, ADR 0043)."""
ROUND_MARGIN = 30.0
"""Seconds a tree's round takes on a loaded machine once nothing fails, with room: a round is
a few dozen scripted steps across three nodes, and a leaf's call left undecided waits out its
approval timeout (5 s) before the mesh denies it."""


def settle_bound(ttl: float) -> float:
    """How long a fault run waits after its faults for every tree to finish its round: a dead
    node's lease lapses (``ttl``), a live node sweeps what it held (:data:`SWEEP_INTERVAL`),
    and the round runs (:data:`ROUND_MARGIN`)."""
    return ttl + SWEEP_INTERVAL + ROUND_MARGIN


def root_of(session: SessionId, parents: Mapping[SessionId, SessionId | None]) -> SessionId:
    """The root of ``session``'s tree (a session with no known parent is its own)."""
    seen = {session}
    while (parent := parents.get(session)) is not None and parent not in seen:
        seen.add(parent)
        session = parent
    return session


def _notices(
    transcripts: Mapping[SessionId, Sequence[Record]],
) -> Counter[tuple[SessionId, SessionId, ActivationId]]:
    """``(parent, child, child activation) -> notices`` over every transcript."""
    found: Counter[tuple[SessionId, SessionId, ActivationId]] = Counter()
    for parent, records in transcripts.items():
        for record in records:
            if isinstance(record.entry, SettlementNoticeEntry):
                found[parent, record.entry.child_session, record.entry.child_activation] += 1
    return found


def _owed(
    session: SessionId, records: Sequence[Record], held: Mapping[SessionId, ActivationId]
) -> list[ActivationId]:
    """The activations of ``session`` that ran a turn and owe their notice: all but the one
    holding it still."""
    ran = {
        r.entry.activation_id
        for r in records
        if isinstance(r.entry, TurnStartedEntry) and r.entry.activation_id
    }
    return sorted(a for a in ran if a != held.get(session))


def unnoticed_activations(
    transcripts: Mapping[SessionId, Sequence[Record]],
    parents: Mapping[SessionId, SessionId | None],
    held: Mapping[SessionId, ActivationId],
) -> list[str]:
    """Each child activation that ran a turn, no longer holds its session and has not exactly
    one notice at its parent, one line each."""
    notices = _notices(transcripts)
    violations: list[str] = []
    for child, records in transcripts.items():
        parent = parents.get(child)
        if parent is None:
            continue
        for activation in _owed(child, records, held):
            count = notices[parent, child, activation]
            if count != 1:
                violations.append(
                    f"{child} activation {activation} ran a turn; {parent} holds {count} notices"
                    " for it"
                )
    return violations


def unread_sessions(
    transcripts: Mapping[SessionId, Sequence[Record]], held: Mapping[SessionId, ActivationId]
) -> list[str]:
    """Each session no activation holds that holds inbound entries no turn consumed."""
    violations: list[str] = []
    for session, records in transcripts.items():
        unread = pending_inbound(records)
        if unread and session not in held:
            kinds = ", ".join(f"{r.seq} {type(r.entry).__name__}" for r in unread[:5])
            violations.append(f"{session}, absent, never read {len(unread)} entries: {kinds}")
    return violations


def unfinished_trees(
    transcripts: Mapping[SessionId, Sequence[Record]],
    parents: Mapping[SessionId, SessionId | None],
    held: Mapping[SessionId, ActivationId],
) -> dict[SessionId, list[str]]:
    """The trees whose round has not finished, by root, with what each still waits for
    (:class:`~dsh_mesh.core.TreeProgress`, the question the SDK's ``run`` asks of one tree):
    a turn left open, an entry no turn read, a call waiting for a decision, a child
    activation's notice (but the one holding its session still). A fault run polls it until it
    is empty or its bound passes."""
    progress = TreeProgress()
    for session, records in transcripts.items():
        for record in records:
            progress.read(session, record)
    waiting: dict[SessionId, list[str]] = {}
    for session in transcripts:
        is_child = parents.get(session) is not None
        reasons = progress.waits(session, is_child=is_child, held=held)
        if reasons:
            waiting.setdefault(root_of(session, parents), []).extend(reasons)
    return waiting


def rebound_replies_lost(
    refused: Iterable[tuple[str, SessionId, str, int]],
    transcripts: Mapping[SessionId, Sequence[Record]],
    parents: Mapping[SessionId, SessionId | None],
) -> tuple[list[str], int]:
    """Each reply of a child to its parent refused ``PARENT_REBOUND`` (``refused``: each such
    send's sender, target, content and the seq of the step that asked it) whose content is
    nowhere in the parent's transcript: neither that send nor a later one of the same words
    landed, nor did the child's final answer carry them in a settlement notice (where a reply
    goes that its parent, gone again, could not take), and the sender's model had its chance
    to send again. Also returns how many such replies were lost with their run instead
    (:func:`_lost_after`): counted, not held against the run. Each lost one names what its
    sender's transcript shows after the refusal, for the reader of a failed run."""
    landed = {
        (parent, r.entry.source.sender_session_id, r.entry.content)
        for parent, records in transcripts.items()
        for r in records
        if isinstance(r.entry, AgentMessageEntry)
    }
    answers: dict[tuple[str, str], list[str]] = {}
    for parent, records in transcripts.items():
        for r in records:
            if isinstance(r.entry, SettlementNoticeEntry):
                key = (parent, r.entry.child_session)
                answers.setdefault(key, []).append(r.entry.terminal_output)
    lost: list[str] = []
    with_their_run = 0
    for sender, target, content, step in refused:
        if parents.get(SessionId(sender)) != target or (target, sender, content) in landed:
            continue
        if any(content in answer for answer in answers.get((target, sender), ())):
            continue
        sent_from = transcripts.get(SessionId(sender), ())
        if _lost_after(sent_from, step):
            with_their_run += 1
        else:
            lost.append(
                f"{sender} -> {target} {content!r}: refused PARENT_REBOUND, never landed;"
                f" then {_what_followed(sent_from, step)}"
            )
    return lost, with_their_run


def _what_followed(records: Sequence[Record], step: int, most: int = 8) -> str:
    """The first ``most`` entries after seq ``step``, each in a few words."""
    shown: list[str] = []
    for record in records:
        if record.seq <= step:
            continue
        if len(shown) == most:
            shown.append("...")
            break
        entry = record.entry
        if isinstance(entry, AssistantStepEntry):
            called = ", ".join(c.name for c in entry.tool_calls)
            shown.append(f"step {called}" if called else f"answer {entry.text[:60]!r}")
        elif isinstance(entry, ToolResultEntry):
            shown.append(f"result {entry.content[:80]!r}")
        elif isinstance(entry, TurnEndedEntry):
            shown.append(f"turn ended {entry.outcome.value}")
        else:
            shown.append(type(entry).__name__.removesuffix("Entry").lower())
    return "; ".join(shown) or "nothing"


def _lost_after(records: Sequence[Record], step: int) -> bool:
    """Whether the turn of the step at seq ``step`` ended ``lost`` before its model stepped
    again: its host died first, so what the model would have sent again is lost with the run,
    and its parent's ``lost`` notice says so (contract rule 8)."""
    for record in records:
        if record.seq <= step:
            continue
        if isinstance(record.entry, AssistantStepEntry):
            return False
        if isinstance(record.entry, TurnEndedEntry):
            return record.entry.outcome is TurnOutcome.LOST
    return False
