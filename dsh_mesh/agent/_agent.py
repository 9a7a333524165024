"""The agent loop: turns, steps, step boundaries, Steer, Queue, interrupt and settlement.

One :class:`Agent` is the in-memory object of one Activation. Its driver (:meth:`Agent.run`)
takes turns while its inbox has work and settles when its host says it may.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from dsh_mesh import telemetry
from dsh_mesh.agent._approval_wait import ApprovalWait, AwaitingApproval, DecisionWrites
from dsh_mesh.agent._approvals import (
    denied,
    edited,
)
from dsh_mesh.agent._gate import BoundaryGate
from dsh_mesh.agent._inbox import Inbox
from dsh_mesh.agent._tool_calls import ToolCalls
from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.agent._turn import Turn
from dsh_mesh.agent._window import ContextWindow, Writes
from dsh_mesh.core import (
    EXPIRED_APPROVAL_REASON,
    INBOUND_TYPES,
    AbortSignal,
    Activation,
    AgentRef,
    ApprovalDecision,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    ConsumedEntry,
    DeliveryKind,
    DetachedWork,
    Entry,
    IdFactory,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SettlementOutcome,
    TokensExhausted,
    ToolCall,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    recorded_step,
    unended_turn,
)
from dsh_mesh.models import (
    FinishReason,
    ModelProvider,
)
from dsh_mesh.tools import (
    ApprovalPolicy,
    ContextPolicy,
    ToolOutput,
    ToolSet,
    TurnLimits,
    is_idempotent_by_key,
    outcome_unknown,
)

T = TypeVar("T")


class AgentState(enum.Enum):
    """Where an Agent is in its life: idle (no turn), running (a turn in progress), settled
    (its Activation's run ended; it never runs again)."""

    IDLE = "idle"
    RUNNING = "running"
    SETTLED = "settled"
    """The activation has ended (or is ending); nothing more is admitted to this object."""


@dataclass(frozen=True, kw_only=True)
class Settlement:
    """How an Activation's run ended, as the manager reports it to the parent."""

    outcome: SettlementOutcome
    terminal_output: str
    detail: str = ""
    trace: str = ""
    """The ``traceparent`` of the final turn's span ("" when tracing is off)."""


_SETTLEMENT_OF_TURN = {
    TurnOutcome.COMPLETED: SettlementOutcome.COMPLETED,
    TurnOutcome.ERROR: SettlementOutcome.ERROR,
    TurnOutcome.CANCELLED: SettlementOutcome.CANCELLED,
    TurnOutcome.TOKEN_EXHAUSTION: SettlementOutcome.TOKEN_EXHAUSTION,
    TurnOutcome.LOST: SettlementOutcome.LOST,
    # Only a root's run may end while a call waits for approval (passivated): it sends no
    # notice. A child's run goes on until the call is decided.
    TurnOutcome.AWAITING_APPROVAL: SettlementOutcome.COMPLETED,
}


class AgentHost(Protocol):
    """What an agent needs from the continuation manager that hosts it."""

    async def append(self, agent: Agent, entry: Entry) -> Record:
        """Durably append ``entry`` to the agent's transcript under its activation (fenced)."""
        ...

    def may_settle(self, agent: Agent) -> bool:
        """True when nothing can still reach the agent: no waking send is pending (and no child
        it must stay available for is live). Called synchronously right before settling."""
        ...

    async def sends_in_inbox(self, agent: Agent) -> None:
        """Return once every send reserved for the agent has its record in the inbox (none is
        still on its way)."""
        ...

    async def left_over_turn_lost(self, agent: Agent, activation: Activation) -> None:
        """The agent's earlier ``activation`` left a turn unended (its host stopped): tell the
        parent, if any, that it was lost (once per activation, whoever else tells it)."""
        ...

    async def read_after(self, agent: Agent, seq: int) -> Sequence[Record]:
        """The agent's durable transcript after ``seq`` (for a boundary in doubt)."""
        ...

    def admitted(self, agent: Agent, records: Sequence[Record]) -> None:
        """The driver consumed ``records``; their waking-send reservations end here."""
        ...

    def changed(self) -> None:
        """Some agent's state changed (for waiters)."""
        ...

    async def settled(self, agent: Agent, settlement: Settlement | None) -> None:
        """The activation ended; ``None`` when it ended without running a turn."""
        ...

    async def closed(self, agent: Agent) -> bool:
        """Whether the agent's session is in a subtree stopped and closed: it must not start
        a turn (asked before each one)."""
        ...


class Agent:
    """The in-memory object of one Activation.

    ``deliver`` is synchronous so that inbox insertion is one atomic step on the event loop.
    ``run`` is the driver; its owner (the manager's task group) cancels it to shut it down.
    """

    def __init__(
        self,
        *,
        header: SessionHeader,
        activation: Activation,
        records: Sequence[Record],
        tools: ToolSet,
        system_prompt: str,
        provider: ModelProvider,
        host: AgentHost,
        ids: IdFactory,
        limits: TurnLimits | None = None,
        context: ContextPolicy | None = None,
        approvals: ApprovalPolicy | None = None,
        tool_executor: Executor | None = None,
    ) -> None:
        self.header = header
        self.activation = activation
        self.tools = tools
        self.system_prompt = system_prompt
        self.limits = limits or TurnLimits()
        self.context = context or ContextPolicy()
        self.approvals = approvals or ApprovalPolicy()
        self._transcript = LocalTranscript(records)
        self._in_doubt = False
        self._doubts = 0
        """How often :meth:`doubt` was called: a read clears the doubt only if none came
        while it read (its snapshot may predate that accept's record)."""
        self._writes = DetachedWork()
        """Writes started by a turn: each runs to its end even if the turn is interrupted
        meanwhile, and the turn's close waits for them (:meth:`_finish_writes`), so nothing
        lands after the turn's end."""
        self._recovering = False
        """Answering what an earlier activation left open (no turn: see steers_into_a_turn)."""
        self._provider = provider
        self._host = host
        self._ids = ids
        self._inbox = Inbox()
        self._gate = BoundaryGate()
        self._state = AgentState.IDLE
        self._work = asyncio.Event()
        self._released = asyncio.Event()
        self._turn: Turn | None = None
        """The running turn's own state (None between turns)."""
        self._turns_run = 0
        self._last_outcome = TurnOutcome.COMPLETED
        self._last_turn_trace = ""
        self._links: list[str] = []
        self._last_detail = ""
        self._passivating = False
        self._halted = False
        """Its subtree was stopped and closed: no turn starts; the activation ends."""
        self._calls = ToolCalls(
            caller=AgentRef(session_id=header.session_id, activation_id=activation.activation_id),
            tools=tools,
            transcript=self._transcript,
            append=self._append,
            executor=tool_executor,
        )
        self._approval_wait = ApprovalWait(
            tools=tools,
            policy=self.approvals,
            transcript=self._transcript,
            writes=DecisionWrites(
                append=self._append,
                append_durable=lambda entry: self._writes.run(self._host.append(self, entry)),
                deliver=self.deliver,
                accepting=self._gate.accepting,
                catch_up=lambda: self._catch_up(0),
                doubt=self.doubt,
            ),
        )
        self._window = ContextWindow(
            session_id=header.session_id,
            model=header.spec.model,
            system_prompt=system_prompt,
            tools=tools,
            limits=self.limits,
            policy=self.context,
            provider=provider,
            transcript=self._transcript,
            writes=Writes(
                append=self._append,
                at_boundary=self._at_boundary,
                catch_up=self._catch_up,
                append_durable=lambda entry: self._host.append(self, entry),
            ),
        )

    # -- identity and state -------------------------------------------------------------------

    @property
    def session_id(self) -> SessionId:
        return self.header.session_id

    @property
    def ref(self) -> AgentRef:
        return AgentRef(
            session_id=self.header.session_id, activation_id=self.activation.activation_id
        )

    @property
    def state(self) -> AgentState:
        return self._state

    @property
    def records(self) -> tuple[Record, ...]:
        return tuple(self._transcript.records)

    @property
    def steers_into_a_turn(self) -> bool:
        """Whether a Steer record delivered now is read inside a running turn (at its next
        step boundary) rather than starting one. False while the agent only answers what an
        earlier activation left open: that is no turn, and what arrives starts the next."""
        if self._state is AgentState.RUNNING:
            return not self._recovering
        # A call waiting for approval: the turn goes on from it, and reads what came at the
        # boundary after that call's step.
        return self._state is AgentState.IDLE and self._waiting_call() is not None

    @property
    def inbox_depth(self) -> int:
        return len(self._inbox)

    @property
    def turns_run(self) -> int:
        return self._turns_run

    @property
    def at_rest(self) -> bool:
        """Idle with nothing to do: an empty inbox, or a call waiting for a person's decision
        (what waits in the inbox waits for that) and no interrupt of it to carry out."""
        if self._state is not AgentState.IDLE or self._approval_wait.cancel_reason is not None:
            return False
        return self.inbox_depth == 0 or self.waiting_request() is not None

    async def wait_released(self) -> None:
        """Return once this activation has ended and its host has finished settling it."""
        await self._released.wait()

    # -- delivery -------------------------------------------------------------------------------

    def holds(self, seq: int) -> bool:
        """Whether the record ``seq`` of the transcript is in this object's local copy, or
        within a compaction's range (compacted, or kept in the copy)."""
        return self._transcript.holds(seq)

    @property
    def whole_transcript(self) -> bool:
        """Whether the local copy is the session's whole transcript: nothing was compacted."""
        return self._transcript.whole

    def record(self, record: Record) -> None:
        """Keep a durably written record in the local transcript (in seq order)."""
        self._transcript.add(record)

    def doubt(self) -> None:
        """An accept to this agent failed without knowing whether its append landed (its
        answer was lost): the next step boundary reads the transcript past what it holds and
        takes any inbound record it finds, so it leaves none behind (docs/adr/0007)."""
        self._in_doubt = True
        self._doubts += 1
        self._work.set()  # a call waiting for approval may have its decision among what landed

    @contextlib.asynccontextmanager
    async def accepting(self) -> AsyncIterator[None]:
        """Hold off this agent's step boundary while one inbound record is appended and
        delivered: the host wraps every accept in it, so a ``ConsumedEntry`` never has a lower
        seq than a Steer record it did not read (docs/adr/0007)."""
        async with self._gate.accepting():
            yield

    def deliver(self, record: Record) -> DeliveryKind:
        """Insert an accepted inbound record. Synchronous: the caller already made it durable.

        A running agent reads it at its next step boundary; an idle one starts a turn.
        """
        if self._state is AgentState.SETTLED:
            raise RuntimeError(f"{self.session_id}: delivery to a settled activation")
        self.record(record)
        self._inbox.put(record)
        self._work.set()
        return DeliveryKind.STEERED if self.steers_into_a_turn else DeliveryKind.STARTED_TURN

    def poke(self) -> None:
        """Ask the driver to re-check whether it may settle."""
        self._work.set()

    def passivate(self) -> None:
        """End this activation once the agent is idle and may settle, even if it is a root
        (which otherwise stays resident): its host needs the memory. Durable state stays; the
        next message or prompt cold-resumes the session. A root sends no notice."""
        self._passivating = True
        self._work.set()

    def interrupt(self, detail: str = "interrupted") -> TurnId | None:
        """Cancel the current turn (recorded as cancelled, with ``detail``). Returns its id, or
        None when idle. Idempotent while the cancellation is in flight; never touches the
        inbox."""
        turn = self._turn
        if turn is None or not turn.cancellable:
            if self._state is AgentState.IDLE and self._waiting_call() is not None:
                # The turn waits at a call for approval: it is cancelled from there, and the
                # request is answered as denied (the driver writes both, once).
                if self._approval_wait.cancel_reason is None:
                    self._approval_wait.cancel_reason = detail
                    self._work.set()
                return self._transcript.last_ended_turn()
            return None
        turn.interrupt(detail)
        return turn.turn_id

    def halt(self, detail: str) -> TurnId | None:
        """Its subtree was stopped and closed: cancel the running turn (recorded as cancelled
        with ``detail``), start no other, and end this activation as soon as it may settle
        (a root too). What waits in the inbox stays durable, for an activation after the
        subtree is reopened. Returns the cancelled turn's id, or None when idle. Idempotent."""
        self._halted = True
        self._work.set()
        return self.interrupt(detail)

    @property
    def halted(self) -> bool:
        """Whether :meth:`halt` was called (or a turn found the subtree closed)."""
        return self._halted

    # -- the driver -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Drive turns until the activation settles. Cancel the task to stop it abruptly.

        First, before any model call, it finishes what an earlier activation left open: every
        call of the transcript's last step gets its one answer and an unended turn is recorded
        as lost (:meth:`_finish_left_over_turn`)."""
        await self._finish_left_over_turn()
        while True:
            waiting = self._waiting_call()
            if waiting is not None:
                if self._in_doubt:
                    await self._resolve_doubt()
                    continue
                if self._approval_wait.cancel_reason is not None or self._halted:
                    await self._cancel_waiting(
                        waiting, self._approval_wait.cancel_reason or "stopped"
                    )
                    continue
                if await self._approval_wait.deny_if_expired(waiting, EXPIRED_APPROVAL_REASON):
                    continue
            if len(self._inbox) and not self._halted and waiting is None:
                if await self._host.closed(self):  # closed before this turn (or activation)
                    self._halted = True
                    continue
                await self._take_turn(self._inbox.take_turn_input())
                continue
            if waiting is not None and self._inbox.has_decision(waiting.call_id):
                await self._take_turn(self._inbox.take_decisions(), going_on=True)
                continue
            if self._halted and len(self._inbox):
                # Nothing here reads them: their holds end, and they stay durable, unread, for
                # the first activation after the subtree is reopened.
                self._host.admitted(self, self._inbox.take_all())
            may_end = self.header.kind is not SessionKind.ROOT or self._passivating or self._halted
            if waiting is not None and self.header.kind is not SessionKind.ROOT:
                may_end = False  # a child's run goes on once the call is decided
            if may_end and self._host.may_settle(self):
                self._state = AgentState.SETTLED
                self._host.changed()
                try:
                    await self._host.settled(self, self._settlement())
                finally:
                    self._released.set()
                return
            self._work.clear()
            timeout = None if waiting is None else self._approval_wait.until_expiry(waiting)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._work.wait()

    # -- approvals (docs/approvals.md) ----------------------------------------------------------

    def needs_approval(self, call: ToolCall) -> bool:
        """Whether ``call`` (of the last step) runs only once a person allowed it."""
        return self._approval_wait.needs_approval(call)

    def _waiting_call(self) -> ToolCall | None:
        """The call the last turn stopped at, waiting for a decision, when no turn runs: the
        first call of the last step without a result (every other turn answers them all)."""
        if self._state is not AgentState.IDLE:
            return None
        return self._transcript.asked_call()

    def waiting_request(self) -> ApprovalRequestEntry | None:
        """The request a call of this idle agent waits on, undecided; None when none does."""
        call = self._waiting_call()
        return None if call is None else self._transcript.undecided(call.call_id)

    def deciding(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold off every other decision on this agent's requests, and its step boundary, while
        one decision is checked (:meth:`check_decision`), appended and delivered."""
        return self._approval_wait.deciding()

    async def check_decision(self, decision: ApprovalDecisionEntry) -> bool:
        """Refuse a decision that answers no request waiting now (``ApprovalStale``) or edits
        the arguments into something the tool's schema refuses (``InvalidArgument``); call it
        within :meth:`deciding`. True when it repeats the decision taken, word for word."""
        return await self._approval_wait.check(decision)

    async def _cancel_waiting(self, call: ToolCall, detail: str) -> None:
        """An interrupt (or a stop) of a turn that waits at ``call``: its request is denied,
        then the turn goes on from that call only to end cancelled, answering each open call
        "not run". Another interrupt meanwhile changes nothing (see :meth:`interrupt`)."""
        await self._approval_wait.deny(call, f"the turn was cancelled ({detail})")
        try:
            await self._take_turn(self._inbox.take_decisions(), going_on=True, interrupted=detail)
        finally:
            self._approval_wait.cancel_reason = None

    async def _resolve_doubt(self) -> None:
        """While a call waits: take what landed unseen (a decision may be among it)."""
        with await self._gate.held():
            await self._take_landed()

    async def _finish_left_over_turn(self) -> None:
        """Answer, durably, every call of the last step that an earlier activation left without
        a result (its host died, was fenced or cut off mid-step), then end that activation's
        unended turn as ``lost``. A call of a tool that is idempotent by key (the standard
        tools) is carried out again under the call's own key: the repeat finds what the first
        try did (the acceptance, the child) or does it now, so the answer is exact and the
        effect happens once. Any other call is answered "outcome unknown", never run again.

        A call that waits for approval stays open, and so do the calls after it: the turn
        goes on from there once it is decided. A call that needed approval and never had a
        decision read never ran: it is answered "not run" if no request was written for it."""
        open_turn = unended_turn(self._transcript.records)
        step_seq, open_calls = self._transcript.last_step()
        if not open_calls and open_turn is None:
            return
        if open_turn is None and self._transcript.asked_call() is not None:
            return  # a call waiting for approval: the driver goes on from it
        # Running, for whoever waits on this agent: what it writes now belongs to that turn.
        self._state = AgentState.RUNNING
        self._recovering = True
        self._host.changed()
        signal = AbortSignal()
        never_ran = False
        for index, call in open_calls:
            tool = self.tools.get(call.name)
            started: float | None = None
            if call.refused:
                output = ToolOutput(content=call.refused, is_error=True)
            elif never_ran:
                output = ToolOutput(
                    content="not run: its host stopped before this call started", is_error=True
                )
            elif self.needs_approval(call) and not self._transcript.decision_read(call.call_id):
                if self._transcript.asked(call.call_id) is not None:
                    break  # it waits for (or has) a decision: the turn goes on from it
                # Asked for by no request: its host stopped before it; the calls after it in
                # the step run only after it, so none of them ran either.
                never_ran = True
                output = ToolOutput(
                    content="not run: its host stopped before this call was approved",
                    is_error=True,
                )
            elif tool is not None and is_idempotent_by_key(tool):
                started = time.monotonic()
                output = await self._calls.invoke(call, signal, step_seq=step_seq, index=index)
            else:
                output = outcome_unknown(call)
            await self._calls.answer(call, output, started=started)
        if open_turn is not None:
            await self._append(
                TurnEndedEntry(
                    turn_id=open_turn.turn_id,
                    outcome=TurnOutcome.LOST,
                    detail="its host stopped before the turn ended",
                )
            )
            earlier = open_turn.activation_id
            if earlier and earlier != self.activation.activation_id:
                await self._host.left_over_turn_lost(
                    self,
                    Activation(
                        session_id=self.session_id,
                        activation_id=earlier,
                        node_id=open_turn.node_id,
                    ),
                )
        self._state = AgentState.IDLE
        self._recovering = False
        self._host.changed()

    def _settlement(self) -> Settlement | None:
        if self._turns_run == 0:
            return None
        return Settlement(
            outcome=_SETTLEMENT_OF_TURN[self._last_outcome],
            terminal_output=self._transcript.terminal_output(),
            detail=self._last_detail,
            trace=self._last_turn_trace,
        )

    async def _append(self, entry: Entry) -> Record:
        # Shielded: once a write starts it finishes and is kept locally, even if the turn is
        # interrupted meanwhile. So the local transcript never lags the durable one.
        async def write() -> Record:
            record = await self._host.append(self, entry)
            self.record(record)
            return record

        return await self._writes.run(write())

    async def _finish_writes(self) -> None:
        """Wait for every write an interrupted turn left running: the step or result being
        written must be in the local transcript before the turn's open calls are closed."""
        await self._writes.wait()

    async def _read_waiting(self, first: Sequence[Record] = (), *, steered: bool = True) -> bool:
        """The read of a step boundary (or of a turn's start, with the turn's ``first``
        records): every Steer record waiting, in seq order, made durable as one
        ``ConsumedEntry``. It holds the gate against accepts, so no Steer record durable before
        that entry is left unread. False when there was nothing to read."""

        async def read() -> list[Record]:
            if self._in_doubt:
                await self._take_landed()
            # Going on from a call waiting for approval reads only decisions (a decision that
            # landed unseen, just taken, among them); the rest waits for the boundary.
            waiting = self._inbox.take_steered() if steered else self._inbox.take_decisions()
            records = sorted([*first, *waiting], key=lambda r: r.seq)
            if records:
                record = await self._host.append(
                    self, ConsumedEntry(seqs=tuple(r.seq for r in records))
                )
                self.record(record)
                self._host.admitted(self, records)
            return records

        records = await self._at_boundary(read)
        # The next step reads these: its span links to the spans that sent them.
        self._links.extend(getattr(r.entry, "trace", "") for r in records)
        return bool(records)

    async def _at_boundary(self, write: Callable[[], Awaitable[T]]) -> T:
        """Run ``write`` with the gate held against accepts: every inbound record durable
        before what it writes is then in the inbox (docs/adr/0007). Shielded like any write
        (see :meth:`_append`); the gate opens when its entry is durable, or failed."""
        held = await self._gate.held()

        async def written() -> T:
            with held:
                return await write()

        return await self._writes.run(written())

    async def _catch_up(self, through: int) -> None:
        """Take what landed unseen, when in doubt or when a seq up to ``through`` is missing."""
        if self._in_doubt or self._transcript.held_through < through:
            await self._take_landed()

    async def _take_landed(self) -> None:
        """Deliver to this agent every inbound record that landed without its accept knowing
        (the answer was lost). The doubt ends only once the read succeeded, and only if no
        other doubt came while it read: a decision takes what landed with other accepts still
        appending (:meth:`deciding`), and their lost answers are read next time."""
        doubts = self._doubts
        for record in await self._host.read_after(self, self._transcript.held_through):
            if self.holds(record.seq):
                continue
            if isinstance(record.entry, INBOUND_TYPES):
                self.deliver(record)
            else:
                self.record(record)
        if self._doubts == doubts:
            self._in_doubt = False

    async def _take_turn(
        self, first: list[Record], *, going_on: bool = False, interrupted: str | None = None
    ) -> None:
        turn_id = self._ids.turn_id()
        with telemetry.span(
            "dsh.turn",
            attributes={
                "dsh.session.id": self.session_id,
                "dsh.activation.id": self.activation.activation_id,
                "dsh.turn.id": turn_id,
            },
        ) as turn_span:
            self._last_turn_trace = turn_span.traceparent
            turn = Turn(turn_id=turn_id, limits=self.limits)
            if interrupted is not None:
                turn.interrupt(interrupted)  # its steps are cancelled as soon as they start
            outcome = await self._run_turn(
                turn, first, going_on=going_on, trace=turn_span.traceparent
            )
            turn_span.set("dsh.turn.outcome", outcome.value)

    async def _run_turn(
        self, turn: Turn, first: list[Record], *, going_on: bool = False, trace: str = ""
    ) -> TurnOutcome:
        """One turn, from ``first`` (its inbound records). ``going_on``: the turn goes on from
        the call the last one stopped at, waiting for approval; ``first`` are the decisions,
        read now, and what else waits is read at the step's boundary, after its results."""
        self._turn = turn
        self._state = AgentState.RUNNING
        self._host.changed()
        await self._append(
            TurnStartedEntry(
                turn_id=turn.turn_id,
                node_id=self.activation.node_id,
                activation_id=self.activation.activation_id,
                trace=trace,
            )
        )
        await self._read_waiting(first, steered=not going_on)
        turn.steps = asyncio.create_task(
            self._steps(turn, going_on=going_on), name=f"turn {turn.turn_id}"
        )
        if turn.interrupting:
            turn.steps.cancel()  # interrupted while the turn was starting
        detail = ""
        try:
            outcome = await turn.steps
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not turn.interrupting or (current is not None and current.cancelling()):
                raise
            outcome = TurnOutcome.CANCELLED
            detail = turn.interrupt_detail
        except AwaitingApproval as waiting:
            outcome, detail = TurnOutcome.AWAITING_APPROVAL, str(waiting)
        except TokensExhausted as exhausted:
            outcome, detail = TurnOutcome.TOKEN_EXHAUSTION, str(exhausted)
        except Exception as failure:  # a failed model call ends the turn, never the driver
            outcome, detail = TurnOutcome.ERROR, f"{type(failure).__name__}: {failure}"
        finally:
            turn.signal.abort("turn ended")
            turn.cancellable = False
        await self._finish_writes()
        if outcome is not TurnOutcome.AWAITING_APPROVAL:
            await self._calls.close_open(turn, outcome)
        await self._append(TurnEndedEntry(turn_id=turn.turn_id, outcome=outcome, detail=detail))
        self._turns_run += 1
        self._last_outcome, self._last_detail = outcome, detail
        self._turn = None
        self._state = AgentState.IDLE
        self._host.changed()
        return outcome

    async def _steps(self, turn: Turn, *, going_on: bool = False) -> TurnOutcome:
        if going_on:
            step_seq, open_calls = self._transcript.last_step()
            with telemetry.span("dsh.step", attributes={"dsh.session.id": self.session_id}):
                outcome = await self._calls_and_boundary(turn, step_seq, open_calls, asked=True)
            if outcome is not None:
                return outcome
        for index in itertools.count():
            links, self._links = self._links, []
            with telemetry.span(
                "dsh.step",
                attributes={"dsh.session.id": self.session_id, "dsh.step.index": index},
                links=links,
            ):
                outcome = await self._step(turn)
            if outcome is not None:
                return outcome
        raise AssertionError("unreachable")  # pragma: no cover

    async def _step(self, turn: Turn) -> TurnOutcome | None:
        """One model call and the tool calls it asked for, then the step boundary. Returns the
        turn's outcome when the turn is over, None when another step follows. First, if the
        context has reached its policy's mark, room is made (docs/context.md)."""
        turn.count_model_call()
        window = self._window
        response = await window.call(await window.make_room(turn.count_tokens), turn.count_tokens)
        # Recorded bounded and with one id per call (ADR 0038): what runs, is asked for
        # approval and is answered below is the step as recorded, never the raw answer.
        recorded = recorded_step(response.text, response.tool_calls, response.usage)
        step = await self._append(recorded)
        if response.finish_reason is FinishReason.LENGTH:
            raise TokensExhausted("the model stopped at its token limit")
        turn.count_tokens(response.usage)
        turn.check_budget()
        calls = list(enumerate(recorded.tool_calls))
        return await self._calls_and_boundary(
            turn, step.seq, calls, asked=bool(recorded.tool_calls)
        )

    async def _calls_and_boundary(
        self,
        turn: Turn,
        step_seq: int,
        calls: Sequence[tuple[int, ToolCall]],
        *,
        asked: bool,
    ) -> TurnOutcome | None:
        """Run ``calls`` of the step ``step_seq`` in order, each answered once, then the step
        boundary. Raises :class:`AwaitingApproval` at a call that waits for a decision."""
        for index, call in calls:
            if call.refused:  # never run, never asked for (ADR 0038)
                await self._calls.answer(call, ToolOutput(content=call.refused, is_error=True))
                continue
            decision = await self._approval_wait.decision_for(call, step_seq)
            if decision is not None and decision.decision is ApprovalDecision.DENY:
                await self._calls.answer(call, denied(decision))
                continue
            ran = call
            if decision is not None and decision.decision is ApprovalDecision.EDIT:
                ran = dataclasses.replace(call, arguments_json=decision.arguments_json)
            with telemetry.span(
                f"execute_tool {call.name}",
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": call.name,
                    "gen_ai.tool.call.id": call.call_id,
                },
            ) as tool_span:
                turn.running_call = call.call_id
                started = time.monotonic()
                output = await self._calls.invoke(
                    ran, turn.signal, step_seq=step_seq, index=index, turn=turn
                )
                turn.running_call = None
                tool_span.set("dsh.tool.error", output.is_error)
            if ran is not call:
                assert decision is not None
                output = edited(decision, output)
            await self._calls.answer(call, output, started=started)
        # Step boundary: every tool result of this step is recorded.
        if not asked:
            # Before the turn ends, let sends admitted while it ran land: they were told
            # "steered", so they extend this turn rather than start another.
            await self._host.sends_in_inbox(self)
        if not await self._read_waiting() and not asked:
            return TurnOutcome.COMPLETED
        return None
