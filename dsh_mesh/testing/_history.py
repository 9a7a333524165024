"""The history checker: did a whole run keep the mesh's promise?

An acknowledged message is delivered exactly once, in order, to the one live activation of its
target, whatever failed. The checker judges a run from three records that no single component
can fake for another:

- the **sends**: every message the workload asked the mesh to accept, with what the asker heard
  back (:class:`Send`). Agents' own ``send_message`` calls come from their transcripts (the tool
  call and its recorded result, :func:`agent_sends`); prompts and probes from the driver's log;
- the **writes**: each node's store history (``--history-file``, :class:`WriteEvent`), saying
  which activation each durable entry was fenced on;
- the **transcripts**: the durable end state, read from etcd after the run.

:func:`check` then counts, over the whole run (a :class:`Verdict`):

- *lost*: an acknowledged message missing from its target's transcript, or there but never
  consumed into a step;
- *duplicated*: a message in its target's transcript more times than it was acknowledged (or left
  in doubt), an inbound entry consumed into more than one step, two notices for one activation;
- *order violations*: two acknowledged messages on one sender-to-target edge accepted in the
  other order than they were sent;
- *notice violations*: a settlement notice accepted before a message its child's activation had
  acknowledged to the same parent;
- *overlapping activations*: a session whose durable writes interleave two activations (one wrote
  again after another had written);
- *wrong reasons*: a refusal with a reason the request could not have earned;
- *phantoms*: an agent message in a transcript that no one sent;
- *unanswered calls*: a tool call of an assistant step without exactly one result, once anything
  but inbound entries follows that step (a session whose host died mid-step may end with its
  last step's calls open; its next activation answers them before anything else,
  :func:`calls_without_one_answer`);
- *untrue boundaries*: a ``ConsumedEntry`` that reads out of seq order, or leaves unread a Steer
  record durable before it (:func:`boundary_violations`);
- *untrue compactions*: a ``CompactionEntry`` that summarised away what the contract keeps: a
  call in its range whose result is not, a boundary's read in its range that no step showed,
  an unread inbound entry in its range that it does not keep pending, a task it does not keep
  verbatim, or a range that does not follow the previous one's (:func:`compaction_violations`);
- *blind resends*: a message stored twice at its target, once for each of two ``send_message``
  calls of one sender, the second made before the sender was shown the first one's result (the
  double send a model makes when it never learns whether its first send landed,
  :func:`blind_resends`);
- *duplicated unsafe executions*: a ``replay="unsafe"`` probe tool call that ran more than once
  (the probe's own log, :mod:`dsh_mesh.testing.probe_tools`, counts executions by idempotency
  key); *unrecorded executions*: a probe run whose call no transcript records; *untrue results*:
  a probe call answered as done that never ran (:func:`check_tool_runs`). Safe calls run again
  after a host death are counted, never held against the run;
- *unapproved runs*: a call of a tool that waits for approval that ran with no decision allowing
  it; *untrue decisions*: a request decided twice, or a decision on no request
  (:mod:`dsh_mesh.testing._approval_history`);
- *invalid texts* (issue 30): an entry the log store holds as bytes that are not valid UTF-8
  JSON, or with a string holding a lone surrogate; a result of the workload's edge tools stored
  other than promised: invalid characters not replaced with their note, a huge output not cut at
  its limit, an echo changed, a call of a server that died mid-call answered as done
  (:mod:`dsh_mesh.testing._edges`);
- *unexpected deaths* (issue 30): a node process that ended without the fault driver ending it;
- the liveness counts (issue 33), given the run's :class:`~dsh_mesh.testing.EndState`:
  *unnoticed activations*, *stalled trees*, *unread sessions* and *rebound replies lost*
  (:mod:`dsh_mesh.testing._liveness`).

A message whose outcome the asker never learned (its node died mid-call) may have landed once or
not at all; it is never counted lost, but a second copy is still a duplicate.
"""

from __future__ import annotations

import enum
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsh_mesh.core import (
    INBOUND_TYPES,
    AgentMessageEntry,
    ApprovalDecisionEntry,
    AssistantStepEntry,
    CompactionEntry,
    ConsumedEntry,
    HumanPromptEntry,
    InvalidArgument,
    Record,
    RejectionReason,
    SessionId,
    SettlementNoticeEntry,
    TaskEntry,
    ToolResultEntry,
    TurnStartedEntry,
    parse_bounded,
)
from dsh_mesh.testing._approval_history import ApprovalTally, approval_violations
from dsh_mesh.testing._edges import (
    EdgeTally,
    StoredEntry,
    edge_violations,
    stored_text_violations,
)
from dsh_mesh.testing._liveness import (
    EndState,
    rebound_replies_lost,
    unfinished_trees,
    unnoticed_activations,
    unread_sessions,
)
from dsh_mesh.testing.probe_tools import ProbeRun

HUMAN = "human"
"""The sender of a prompt."""


class Outcome(enum.Enum):
    """What the asker heard back."""

    ACKED = "acked"
    REJECTED = "rejected"
    UNKNOWN = "unknown"
    """No answer that decides it (the call or the asker's host died): landed once or not at all."""


@dataclass(frozen=True, kw_only=True)
class Send:
    """One message (or prompt) the workload asked the mesh to accept, and its outcome."""

    sender: str
    """The sending session, or :data:`HUMAN` for a prompt."""
    target: SessionId
    content: str
    outcome: Outcome
    reason: RejectionReason | None = None
    """Why it was refused (``REJECTED`` only)."""
    allowed: frozenset[RejectionReason] = frozenset()
    """The reasons a refusal of this request may rightly give."""
    writer: str | None = None
    """The sender's activation that recorded the outcome, when known (agent sends)."""
    position: float = 0
    """When the sender sent it, in its own order (a transcript position, or a clock)."""
    done: float | None = None
    """When the sender heard back, on the same scale; ``None``: at ``position`` (a sender that
    waits for each answer before it sends again). Only a message sent after an earlier one was
    acknowledged must land after it: two in flight at once may land either way."""


@dataclass(frozen=True, kw_only=True)
class WriteEvent:
    """One durable write a node reported: ``seq`` of ``session``, fenced on ``writer``."""

    node: str
    time: float
    session: SessionId
    seq: int
    writer: str | None
    entry: str


@dataclass(frozen=True, kw_only=True)
class NodeHistory:
    """What the nodes' history files hold."""

    writes: tuple[WriteEvent, ...] = ()
    activations: int = 0
    """Activations won over the run."""
    fenced_writes: int = 0
    """Writes refused because their activation was no longer current (the fence at work)."""


@dataclass
class Verdict:
    """The checker's figures and every violation it found, one line each."""

    operations: int = 0
    acked: int = 0
    rejected: int = 0
    unknown: int = 0
    delivered: int = 0
    """Inbound entries consumed into a step."""
    lost: int = 0
    duplicated: int = 0
    order_violations: int = 0
    notice_violations: int = 0
    overlapping_activations: int = 0
    wrong_reasons: int = 0
    phantoms: int = 0
    unanswered_calls: int = 0
    untrue_boundaries: int = 0
    untrue_compactions: int = 0
    compactions: int = 0
    """Compactions in the run's transcripts."""
    blind_resends: int = 0
    tool_runs: int = 0
    """Executions of the probe tools (their log's lines)."""
    unsafe_duplicates: int = 0
    unrecorded_runs: int = 0
    untrue_results: int = 0
    safe_reruns: int = 0
    """Safe probe calls that ran more than once (again after a host death): allowed."""
    approvals: ApprovalTally = field(default_factory=ApprovalTally)
    unapproved_runs: int = 0
    untrue_decisions: int = 0
    edges: EdgeTally = field(default_factory=EdgeTally)
    """Every tool call, and what the edge calls came to."""
    invalid_texts: int = 0
    unexpected_deaths: int = 0
    unattributed_writes: int = 0
    """Durable entries no node reported writing (their node was killed in between): counted,
    never held against the run."""
    activations: int = 0
    fenced_writes: int = 0
    unnoticed_activations: int = 0
    """Child activations that ran a turn without exactly one notice at their parent."""
    stalled_trees: int = 0
    """Trees whose round did not finish within the bound after the faults."""
    unread_sessions: int = 0
    """Sessions no activation holds that hold inbound entries no turn read."""
    rebound_refusals: int = 0
    """Children's replies refused ``PARENT_REBOUND`` (each send, landed later or not)."""
    rebound_replies_lost: int = 0
    """Children's replies refused ``PARENT_REBOUND`` whose content never reached the parent."""
    rebound_replies_lost_with_their_run: int = 0
    """Such replies whose turn ended ``lost`` before its model stepped again: the run's loss,
    told by its ``lost`` notice; counted, not held against the run."""
    settle_bound: float | None = None
    """The bound (seconds) the run waited after its faults; ``None``: liveness not checked."""
    violations: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """No violation of any kind."""
        return not self.violations

    def summary(
        self,
        *,
        faults: Mapping[str, int] | None = None,
        failovers: Sequence[float] = (),
        ttl: float | None = None,
    ) -> str:
        """The verdict and its figures, as the soak and the short fault run print them."""
        lines = [f"history check: {'CLEAN' if self.clean else 'VIOLATED'}"]
        lines.append(
            f"  operations {self.operations}: acknowledged {self.acked}, refused {self.rejected},"
            f" in doubt {self.unknown}; delivered into a step {self.delivered}"
        )
        if faults is not None:
            total = sum(faults.values())
            kinds = ", ".join(f"{name} {count}" for name, count in sorted(faults.items()))
            lines.append(f"  faults injected {total}: {kinds or 'none'}")
        lines.append(
            f"  lost {self.lost}, duplicated {self.duplicated},"
            f" order violations {self.order_violations},"
            f" overlapping activations {self.overlapping_activations},"
            f" notices before messages {self.notice_violations},"
            f" wrong reasons {self.wrong_reasons}, phantoms {self.phantoms}"
        )
        lines.append(
            f"  tool calls without exactly one answer {self.unanswered_calls},"
            f" untrue step boundaries {self.untrue_boundaries}, blind resends {self.blind_resends}"
        )
        lines.append(
            f"  compactions {self.compactions}: untrue compactions {self.untrue_compactions}"
        )
        lines.append(
            f"  tool executions {self.tool_runs}: unsafe executions duplicated"
            f" {self.unsafe_duplicates}, safe calls re-run {self.safe_reruns},"
            f" executions without a recorded call {self.unrecorded_runs},"
            f" results of calls that never ran {self.untrue_results}"
        )
        approvals = self.approvals
        lines.append(
            f"  approval requests {approvals.requests}: allowed {approvals.allowed}, denied"
            f" {approvals.denied}, denied by the mesh {approvals.by_mesh};"
            f" gated calls run unallowed {self.unapproved_runs},"
            f" untrue decisions {self.untrue_decisions}"
        )
        edges = self.edges
        lines.append(
            f"  tool calls {edges.tool_calls}: results stored with invalid characters replaced"
            f" {edges.replaced}, cut at their limit {edges.cut}; MCP calls {edges.mcp_calls},"
            f" answered with an error {edges.mcp_errors}; invalid texts {self.invalid_texts}"
        )
        lines.append(f"  node processes that died unbidden {self.unexpected_deaths}")
        if self.settle_bound is not None:
            lines.append(
                f"  liveness, no outside nudge, within {self.settle_bound:g} s of the faults' end:"
                f" activations without exactly one notice {self.unnoticed_activations},"
                f" stalled trees {self.stalled_trees},"
                f" sessions left with unread entries {self.unread_sessions},"
                f" replies refused PARENT_REBOUND that never landed {self.rebound_replies_lost}"
                f" (of {self.rebound_refusals} refused; lost with their run, told by its lost"
                f" notice: {self.rebound_replies_lost_with_their_run})"
            )
        lines.append(
            f"  activations {self.activations}, writes refused by the fence {self.fenced_writes},"
            f" unattributed writes {self.unattributed_writes}"
        )
        if failovers:
            against = f" (lease TTL {ttl:g} s)" if ttl is not None else ""
            lines.append(
                f"  failover p50 {statistics.median(failovers):.2f} s,"
                f" max {max(failovers):.2f} s over {len(failovers)}{against}"
            )
        lines.extend(f"  ! {violation}" for violation in self.violations[:50])
        if len(self.violations) > 50:
            lines.append(f"  ... and {len(self.violations) - 50} more")
        return "\n".join(lines)

    def _violate(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.violations.append(f"{kind.replace('_', ' ')}: {text}")


SEND_TOOL = "send_message"
UNSAFE_PROBE = "probe_unsafe"
PROBE_TOOLS = frozenset({UNSAFE_PROBE, "probe_safe"})
_CALLS_PER_STEP = 1000


def agent_sends(
    transcripts: Mapping[SessionId, Sequence[Record]],
    writers: Mapping[tuple[SessionId, int], str | None] | None = None,
    *,
    allowed: frozenset[RejectionReason] = frozenset(),
) -> list[Send]:
    """Every ``send_message`` call in ``transcripts``, with the outcome its tool result recorded
    (a call with no result, or closed as not completed, is in doubt). ``writers`` (from
    :func:`load_node_history`) names the activation that recorded each result."""
    writers = writers or {}
    return [
        send
        for session, records in transcripts.items()
        for send in _sends_of(session, records, writers, allowed)
    ]


def _sends_of(
    session: SessionId,
    records: Sequence[Record],
    writers: Mapping[tuple[SessionId, int], str | None],
    allowed: frozenset[RejectionReason],
) -> list[Send]:
    """One session's ``send_message`` calls. A result answers the latest step that asked for
    its call id: a model (or a script resumed after its host died mid-step) may use one call id
    in two steps, and the earlier one, never answered, is in doubt."""
    sends: list[Send] = []
    asked: dict[str, tuple[Record, int, dict[str, object]]] = {}

    def answered(call_id: str, result: Record | None) -> None:
        step, index, arguments = asked.pop(call_id)
        outcome, reason = _tool_outcome(result)
        sends.append(
            Send(
                sender=session,
                target=SessionId(str(arguments.get("agent_id", ""))),
                content=str(arguments.get("message", "")),
                outcome=outcome,
                reason=reason,
                allowed=allowed,
                writer=None if result is None else writers.get((session, result.seq)),
                position=step.seq * _CALLS_PER_STEP + index,
            )
        )

    for record in records:
        if isinstance(record.entry, AssistantStepEntry):
            for index, call in enumerate(record.entry.tool_calls):
                if call.name != SEND_TOOL:
                    continue
                if call.call_id in asked:
                    answered(call.call_id, None)
                asked[call.call_id] = (record, index, _arguments(call.arguments_json))
        elif isinstance(record.entry, ToolResultEntry) and record.entry.call_id in asked:
            answered(record.entry.call_id, record)
    for call_id in list(asked):
        answered(call_id, None)
    return sends


def _arguments(arguments_json: str) -> dict[str, Any]:
    """A call's arguments, or ``{}`` when they are no JSON object the agent would have run
    (bounded like the agent's parse: a model's arguments may be anything)."""
    try:
        arguments = parse_bounded(arguments_json or "{}")
    except InvalidArgument:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def _tool_outcome(result: Record | None) -> tuple[Outcome, RejectionReason | None]:
    if result is None or not isinstance(result.entry, ToolResultEntry):
        return Outcome.UNKNOWN, None
    try:
        payload = json.loads(result.entry.content)
    except json.JSONDecodeError:
        return Outcome.UNKNOWN, None  # "not completed: ..." or "not run: ..." (a turn ended)
    if isinstance(payload, dict) and "delivered" in payload:
        return Outcome.ACKED, None
    if isinstance(payload, dict) and payload.get("may_have_landed"):
        return Outcome.UNKNOWN, None  # an outage's refusal: the write may have landed
    if isinstance(payload, dict) and "rejected" in payload:
        try:
            return Outcome.REJECTED, RejectionReason(payload["rejected"])
        except ValueError:
            return Outcome.REJECTED, None
    return Outcome.UNKNOWN, None


def load_node_history(paths: Iterable[Path]) -> NodeHistory:
    """Read every node's history file (``--history-file``); a torn last line (a node killed
    mid-write) is skipped."""
    writes: list[WriteEvent] = []
    activations = 0
    fenced = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            op = event.get("op")
            if op == "wrote":
                writes.append(
                    WriteEvent(
                        node=event["node"],
                        time=event["t"],
                        session=SessionId(event["session"]),
                        seq=int(event["seq"]),
                        writer=event["writer"],
                        entry=event["entry"],
                    )
                )
            elif op == "activated":
                activations += 1
            elif op == "fenced":
                fenced += 1
    return NodeHistory(writes=tuple(writes), activations=activations, fenced_writes=fenced)


def writers_of(history: NodeHistory) -> dict[tuple[SessionId, int], str | None]:
    """``(session, seq) -> writer activation`` for every reported write."""
    return {(w.session, w.seq): w.writer for w in history.writes}


def check(
    sends: Sequence[Send],
    transcripts: Mapping[SessionId, Sequence[Record]],
    history: NodeHistory,
    tool_runs: Sequence[ProbeRun] = (),
    *,
    gated: frozenset[str] = frozenset(),
    refusals: Sequence[str] = (),
    stored: Iterable[StoredEntry] = (),
    deaths: Sequence[str] = (),
    end: EndState | None = None,
) -> Verdict:
    """Judge a whole run; see the module docstring for what is counted. ``tool_runs`` are the
    probe tools' executions (their log); ``gated`` the tools whose calls wait for approval;
    ``refusals`` the driver's own requests (decisions) refused with a reason they could not
    have earned, one line each; ``stored`` the log store's entries as it holds them (bytes);
    ``deaths`` the node processes that ended without the driver ending them, one line each;
    ``end`` the mesh's end state, read after the run waited its bound (``None``: the liveness
    counts are not taken)."""
    verdict = Verdict(operations=len(sends))
    verdict.activations = history.activations
    verdict.fenced_writes = history.fenced_writes
    for send in sends:
        if send.outcome is Outcome.ACKED:
            verdict.acked += 1
        elif send.outcome is Outcome.REJECTED:
            verdict.rejected += 1
            if send.reason not in send.allowed:
                verdict._violate(
                    "wrong_reasons",
                    f"{send.sender} -> {send.target} {send.content!r} refused with"
                    f" {send.reason and send.reason.value}",
                )
        else:
            verdict.unknown += 1
    consumed = _consumption(transcripts, verdict)
    _check_copies(sends, transcripts, consumed, verdict)
    _check_order(sends, transcripts, verdict)
    _check_notices(sends, transcripts, verdict)
    _check_writers(transcripts, history, verdict)
    for session, records in transcripts.items():
        for violation in calls_without_one_answer(records):
            verdict._violate("unanswered_calls", f"{session}: {violation}")
        for violation in boundary_violations(records):
            verdict._violate("untrue_boundaries", f"{session}: {violation}")
        verdict.compactions += sum(isinstance(r.entry, CompactionEntry) for r in records)
        for violation in compaction_violations(records):
            verdict._violate("untrue_compactions", f"{session}: {violation}")
    for violation in blind_resends(transcripts):
        verdict._violate("blind_resends", violation)
    check_tool_runs(transcripts, tool_runs, verdict)
    runs = Counter((run.session, run.key) for run in tool_runs)
    for session, records in transcripts.items():
        tally, found = approval_violations(session, records, runs, gated)
        verdict.approvals.add(tally)
        for kind, text in found:
            verdict._violate(kind, text)
    for text in refusals:
        verdict._violate("wrong_reasons", text)
    for session, records in transcripts.items():
        edges, wrong = edge_violations(records)
        verdict.edges.add(edges)
        for text in wrong:
            verdict._violate("invalid_texts", f"{session} {text}")
    for text in stored_text_violations(stored):
        verdict._violate("invalid_texts", text)
    for text in deaths:
        verdict._violate("unexpected_deaths", text)
    if end is not None:
        _check_liveness(sends, transcripts, end, verdict)
    return verdict


def _check_liveness(
    sends: Sequence[Send],
    transcripts: Mapping[SessionId, Sequence[Record]],
    end: EndState,
    verdict: Verdict,
) -> None:
    """The liveness counts of :mod:`dsh_mesh.testing._liveness` on the run's end state."""
    verdict.settle_bound = end.bound
    for text in unnoticed_activations(transcripts, end.parents, end.held):
        verdict._violate("unnoticed_activations", text)
    for root, waits in sorted(unfinished_trees(transcripts, end.parents, end.held).items()):
        shown = "; ".join(waits[:3]) + (f"; and {len(waits) - 3} more" if len(waits) > 3 else "")
        verdict._violate("stalled_trees", f"the tree of {root}: {shown}")
    for text in unread_sessions(transcripts, end.held):
        verdict._violate("unread_sessions", text)
    refused = [
        (send.sender, send.target, send.content, int(send.position) // _CALLS_PER_STEP)
        for send in sends
        if send.outcome is Outcome.REJECTED and send.reason is RejectionReason.PARENT_REBOUND
    ]
    lost, verdict.rebound_replies_lost_with_their_run = rebound_replies_lost(
        refused, transcripts, end.parents
    )
    verdict.rebound_refusals = len(refused)
    for text in lost:
        verdict._violate("rebound_replies_lost", text)


def check_tool_runs(
    transcripts: Mapping[SessionId, Sequence[Record]],
    runs: Sequence[ProbeRun],
    verdict: Verdict,
) -> None:
    """Judge the probe tools' executions against the transcripts: an unsafe call runs at most
    once; every execution belongs to a recorded call (the step is durable before any of its
    calls runs); a call answered as done ran at least once. A call's key is its idempotency key
    (``<step seq>.<index>.<call id>``), as the tool saw it."""
    verdict.tool_runs = len(runs)
    recorded: dict[tuple[str, str], str] = {}
    answered: dict[tuple[str, str], ToolResultEntry] = {}
    for session, records in transcripts.items():
        by_call: dict[str, str] = {}
        for record in records:
            entry = record.entry
            if isinstance(entry, AssistantStepEntry):
                for index, call in enumerate(entry.tool_calls):
                    if call.name in PROBE_TOOLS:
                        key = f"{record.seq}.{index}.{call.call_id}"
                        recorded[(session, key)] = call.name
                        by_call[call.call_id] = key
            elif isinstance(entry, ToolResultEntry) and entry.call_id in by_call:
                answered[(session, by_call[entry.call_id])] = entry
    counts = Counter((run.session, run.key) for run in runs)
    for (ran_in, key), count in sorted(counts.items()):
        name = recorded.get((ran_in, key))
        if name is None:
            verdict._violate("unrecorded_runs", f"{ran_in}: a probe ran under {key}, no call")
        elif count > 1 and name == UNSAFE_PROBE:
            verdict._violate("unsafe_duplicates", f"{ran_in}: {name} {key} ran {count} times")
        elif count > 1:
            verdict.safe_reruns += 1
    for (called_in, key), result in sorted(answered.items()):
        if not result.is_error and counts[(called_in, key)] == 0:
            verdict._violate(
                "untrue_results", f"{called_in}: {result.name} {key} answered done, never ran"
            )


def calls_without_one_answer(records: Sequence[Record]) -> list[str]:
    """The tool calls of ``records`` (one transcript) that do not have exactly one result
    between their step and the next, one line each, and every id two calls of one step share
    (a result could not tell them apart: ADR 0038). The calls of the last step may still be
    open while nothing but inbound entries follows it: the session stopped mid-step, and its
    next activation answers them before it does anything else."""
    violations: list[str] = []
    steps = [n for n, r in enumerate(records) if isinstance(r.entry, AssistantStepEntry)]
    for number, start in enumerate(steps):
        step = records[start]
        assert isinstance(step.entry, AssistantStepEntry)
        end = steps[number + 1] if number + 1 < len(steps) else len(records)
        answers = Counter(
            r.entry.call_id
            for r in records[start + 1 : end]
            if isinstance(r.entry, ToolResultEntry)
        )
        went_on = any(
            not isinstance(r.entry, (*INBOUND_TYPES, ToolResultEntry)) for r in records[start + 1 :]
        )
        shared = Counter(call.call_id for call in step.entry.tool_calls)
        violations.extend(
            f"call id {call_id!r} is shared by {count} calls of the step at seq {step.seq}"
            for call_id, count in shared.items()
            if count > 1
        )
        for call in step.entry.tool_calls:
            count = answers[call.call_id]
            if count > 1 or (count == 0 and went_on):
                violations.append(
                    f"call {call.call_id} ({call.name}) of the step at seq {step.seq} has"
                    f" {count} results"
                )
    return violations


def compaction_violations(records: Sequence[Record]) -> list[str]:
    """The compactions of ``records`` (one whole transcript) that summarised away what the
    contract keeps (docs/context.md), one line each: a call in the range whose result is not
    in it, a boundary's read in the range that no step in it showed to the model, an inbound
    entry of the range that no boundary in it read and that is not kept pending, a task not
    kept verbatim, a range that does not start after the previous one's."""
    violations: list[str] = []
    task = next((r.entry.content for r in records if isinstance(r.entry, TaskEntry)), "")
    start = 1
    for record in records:
        compaction = record.entry
        if not isinstance(compaction, CompactionEntry):
            continue
        where = f"the compaction at seq {record.seq}"
        through = compaction.through_seq
        covered = [r for r in records if r.seq <= through]
        answered = {r.entry.call_id for r in covered if isinstance(r.entry, ToolResultEntry)}
        for step in covered:
            if isinstance(step.entry, AssistantStepEntry):
                for call in step.entry.tool_calls:
                    if call.call_id not in answered:
                        violations.append(f"{where} covers call {call.call_id} without its result")
        # A boundary's read is seen once a step shows it: the range may not end between them.
        last_step = max(
            (r.seq for r in covered if isinstance(r.entry, AssistantStepEntry)), default=0
        )
        unseen = [
            r.seq for r in covered if isinstance(r.entry, ConsumedEntry) and r.seq > last_step
        ]
        if unseen:
            violations.append(f"{where} covers the reads at {unseen}, which no step showed")
        read = {s for r in covered if isinstance(r.entry, ConsumedEntry) for s in r.entry.seqs}
        unread = {r.seq for r in covered if isinstance(r.entry, INBOUND_TYPES)} - read
        if unread != set(compaction.pending):
            violations.append(
                f"{where} keeps {sorted(compaction.pending)} pending; unread in its range:"
                f" {sorted(unread)}"
            )
        if compaction.task != task:
            violations.append(f"{where} keeps the task {compaction.task[:60]!r}, not {task[:60]!r}")
        if compaction.from_seq != start or through >= record.seq:
            violations.append(
                f"{where} covers {compaction.from_seq}..{through}; expected from {start},"
                " before itself"
            )
        start = through + 1
    return violations


def boundary_violations(records: Sequence[Record]) -> list[str]:
    """The step boundaries of ``records`` (one transcript) that say something untrue, one line
    each: a ``ConsumedEntry`` whose seqs are not increasing (not acceptance order), or one that
    leaves unread a Steer record with a lower seq (durable before it) that no earlier one read.
    Human prompts wait for their own turns and are not held to it (docs/adr/0007). A turn's
    first read, of approval decisions alone, is no boundary: a turn going on from a call that
    waited reads its decision first, and what else arrived at the boundary after the call's
    result."""
    violations: list[str] = []
    read: set[int] = set()
    steer: list[int] = []
    decisions: set[int] = set()
    turn_started = False
    for record in records:
        entry = record.entry
        if isinstance(entry, TurnStartedEntry):
            turn_started = True
        elif isinstance(entry, ConsumedEntry):
            first_of_turn, turn_started = turn_started, False
            read.update(entry.seqs)
            if list(entry.seqs) != sorted(entry.seqs):
                violations.append(f"seq {record.seq} reads {list(entry.seqs)} out of seq order")
            if first_of_turn and decisions.issuperset(entry.seqs):
                continue  # going on from a call that waited: no boundary (contract rule 9)
            unread = [seq for seq in steer if seq not in read]
            if unread:
                violations.append(f"seq {record.seq} leaves {unread}, durable before it, unread")
        elif isinstance(entry, INBOUND_TYPES) and not isinstance(entry, HumanPromptEntry):
            steer.append(record.seq)
            if isinstance(entry, ApprovalDecisionEntry):
                decisions.add(record.seq)
    return violations


def blind_resends(transcripts: Mapping[SessionId, Sequence[Record]]) -> list[str]:
    """Messages stored twice at their target for two ``send_message`` calls of one sender with
    the same target and content, the later call made before the earlier one's result was
    recorded (so the sender's model could not have known whether the first had landed)."""
    stored: Counter[tuple[SessionId, str, str]] = Counter()
    for target, records in transcripts.items():
        for record in records:
            if isinstance(record.entry, AgentMessageEntry):
                stored[target, record.entry.source.sender_session_id, record.entry.content] += 1
    violations: list[str] = []
    for sender, records in transcripts.items():
        answered_at = {
            r.entry.call_id: r.seq for r in records if isinstance(r.entry, ToolResultEntry)
        }
        earlier: dict[tuple[str, str], list[int | None]] = defaultdict(list)
        for record in records:
            if not isinstance(record.entry, AssistantStepEntry):
                continue
            for call in record.entry.tool_calls:
                if call.name != SEND_TOOL:
                    continue
                arguments = _arguments(call.arguments_json)
                key = (str(arguments.get("agent_id", "")), str(arguments.get("message", "")))
                blind = any(seen is None or seen > record.seq for seen in earlier[key])
                copies = stored[SessionId(key[0]), sender, key[1]]
                if blind and copies > 1:
                    violations.append(
                        f"{sender} -> {key[0]} {key[1]!r}: sent again at seq {record.seq}"
                        f" before the first send's result, stored {copies} times"
                    )
                earlier[key].append(answered_at.get(call.call_id))
    return violations


def _consumption(
    transcripts: Mapping[SessionId, Sequence[Record]], verdict: Verdict
) -> dict[tuple[SessionId, int], int]:
    """How many steps each inbound entry was consumed into; more than one is a duplicate."""
    consumed: dict[tuple[SessionId, int], int] = Counter()
    for session, records in transcripts.items():
        inbound = {r.seq for r in records if isinstance(r.entry, INBOUND_TYPES)}
        for record in records:
            if isinstance(record.entry, ConsumedEntry):
                for seq in record.entry.seqs:
                    consumed[session, seq] += 1
                    if seq not in inbound:
                        verdict._violate(
                            "phantoms", f"{session} consumed seq {seq}, which is not inbound"
                        )
        for seq in inbound:
            count = consumed[session, seq]
            if count:
                verdict.delivered += 1
            if count > 1:
                verdict._violate("duplicated", f"{session} seq {seq} consumed {count} times")
    return consumed


def _key(entry: AgentMessageEntry | HumanPromptEntry) -> tuple[str, str]:
    if isinstance(entry, HumanPromptEntry):
        return HUMAN, entry.content
    return entry.source.sender_session_id, entry.content


def _check_copies(
    sends: Sequence[Send],
    transcripts: Mapping[SessionId, Sequence[Record]],
    consumed: Mapping[tuple[SessionId, int], int],
    verdict: Verdict,
) -> None:
    """Each message is in its target's transcript as many times as it may be: at least once per
    acknowledgement, at most once per acknowledgement or doubt; and each copy was consumed."""
    asked: dict[tuple[SessionId, str, str], list[Send]] = defaultdict(list)
    for send in sends:
        asked[send.target, send.sender, send.content].append(send)
    copies: dict[tuple[SessionId, str, str], list[int]] = defaultdict(list)
    for session, records in transcripts.items():
        for record in records:
            if isinstance(record.entry, AgentMessageEntry | HumanPromptEntry):
                sender, content = _key(record.entry)
                copies[session, sender, content].append(record.seq)
    for key, group in asked.items():
        target, sender, content = key
        acked = sum(s.outcome is Outcome.ACKED for s in group)
        doubtful = sum(s.outcome is Outcome.UNKNOWN for s in group)
        found = copies.get(key, [])
        what = f"{sender} -> {target} {content!r}"
        if len(found) < acked:
            verdict._violate("lost", f"{what}: acknowledged {acked}, in transcript {len(found)}")
        if len(found) > acked + doubtful:
            heard = ", ".join(
                s.outcome.value if s.reason is None else f"{s.outcome.value} {s.reason.value}"
                for s in group
            )
            verdict._violate(
                "duplicated",
                f"{what}: in transcript {len(found)} times (seqs {found}), but the sender heard:"
                f" {heard}",
            )
        for seq in found:
            if not consumed.get((target, seq)):
                verdict._violate("lost", f"{what}: seq {seq} was never consumed into a step")
    for key, found in copies.items():
        target, sender, content = key
        if key not in asked and sender != HUMAN:
            verdict._violate(
                "phantoms", f"{sender} -> {target} {content!r} at seqs {found} was never sent"
            )


def _seq_of(
    transcripts: Mapping[SessionId, Sequence[Record]],
) -> dict[tuple[SessionId, str, str], int]:
    first: dict[tuple[SessionId, str, str], int] = {}
    for session, records in transcripts.items():
        for record in records:
            if isinstance(record.entry, AgentMessageEntry | HumanPromptEntry):
                sender, content = _key(record.entry)
                first.setdefault((session, sender, content), record.seq)
    return first


def _check_order(
    sends: Sequence[Send], transcripts: Mapping[SessionId, Sequence[Record]], verdict: Verdict
) -> None:
    """On each sender-to-target edge, acknowledged messages land in the order they were sent."""
    seq_of = _seq_of(transcripts)
    edges: dict[tuple[str, SessionId], list[Send]] = defaultdict(list)
    for send in sends:
        if send.outcome is Outcome.ACKED:
            edges[send.sender, send.target].append(send)
    for (sender, target), group in edges.items():
        # Only a message told apart from every other on its edge has one place to be judged.
        once = Counter(s.content for s in group)
        landed = [
            (s.position, s.position if s.done is None else s.done, seq_of[key], s.content)
            for s in group
            if (key := (target, sender, s.content)) in seq_of and once[s.content] == 1
        ]
        by_done = sorted(landed, key=lambda item: item[1])
        before: tuple[int, str] = (0, "")
        answered = 0
        for position, _, seq, content in sorted(landed):
            while answered < len(by_done) and by_done[answered][1] <= position:
                before = max(before, (by_done[answered][2], by_done[answered][3]))
                answered += 1
            if seq < before[0]:
                verdict._violate(
                    "order_violations",
                    f"{sender} -> {target}: {before[1]!r} was acknowledged before {content!r} was"
                    f" sent, but landed at {before[0]} > {seq}",
                )


def _check_notices(
    sends: Sequence[Send], transcripts: Mapping[SessionId, Sequence[Record]], verdict: Verdict
) -> None:
    """A child's acknowledged messages reach its parent before the notice of the activation that
    sent them; one notice per activation."""
    seq_of = _seq_of(transcripts)
    by_writer: dict[tuple[str, SessionId, str], list[Send]] = defaultdict(list)
    for send in sends:
        if send.outcome is Outcome.ACKED and send.writer is not None:
            by_writer[send.sender, send.target, send.writer].append(send)
    for parent, records in transcripts.items():
        seen: Counter[tuple[SessionId, str]] = Counter()
        for record in records:
            notice = record.entry
            if not isinstance(notice, SettlementNoticeEntry):
                continue
            activation = (notice.child_session, notice.child_activation)
            seen[activation] += 1
            if seen[activation] == 2:
                verdict._violate(
                    "duplicated", f"{parent}: a second notice for {notice.child_activation}"
                )
            for send in by_writer.get((notice.child_session, parent, notice.child_activation), []):
                landed = seq_of.get((parent, send.sender, send.content))
                if landed is not None and landed > record.seq:
                    verdict._violate(
                        "notice_violations",
                        f"{parent}: notice for {notice.child_activation} at {record.seq} before"
                        f" its message {send.content!r} at {landed}",
                    )


def _check_writers(
    transcripts: Mapping[SessionId, Sequence[Record]], history: NodeHistory, verdict: Verdict
) -> None:
    """Writes of one session never interleave two activations, and every reported write is
    in the transcript (a write a node was told was durable and is not there was lost)."""
    reported: dict[SessionId, dict[int, WriteEvent]] = defaultdict(dict)
    for event in history.writes:
        earlier = reported[event.session].get(event.seq)
        if earlier is not None and earlier.writer != event.writer:
            verdict._violate(
                "overlapping_activations",
                f"{event.session} seq {event.seq} reported by {earlier.writer} on {earlier.node}"
                f" and by {event.writer} on {event.node}",
            )
        reported[event.session][event.seq] = event
    for session, records in transcripts.items():
        writes = reported.get(session, {})
        durable = {r.seq: r for r in records}
        for seq, reported_write in writes.items():
            record = durable.get(seq)
            if record is None or type(record.entry).__name__ != reported_write.entry:
                verdict._violate(
                    "lost",
                    f"{session} seq {seq} ({reported_write.entry}) reported durable, not found",
                )
        ended: set[str] = set()
        current: str | None = None
        for record in records:
            write = writes.get(record.seq)
            if write is None:
                verdict.unattributed_writes += 1
                continue
            if write.writer != current:
                if current is not None:
                    ended.add(current)
                current = write.writer
                if current in ended:
                    verdict._violate(
                        "overlapping_activations",
                        f"{session} seq {record.seq}: activation {current} wrote again after"
                        " another had written",
                    )
