"""The driver of one agent: its run loop, turns, interrupt, halt and settlement.

One :class:`Agent` is the in-memory object of one Activation. Its driver (:meth:`Agent.run`)
takes turns while its inbox has work and settles when its host says it may. It composes the
owners of its state (ADR 0042): the local transcript, what comes in and the step boundary, one
object per turn, the steps, the tool calls, the approval wait, the context window and the run's
record. None of them is handed the agent, and only the run loop changes the agent's own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from typing import Protocol

from dsh_mesh import telemetry
from dsh_mesh.agent._approval_wait import ApprovalWait, AwaitingApproval, DecisionWrites
from dsh_mesh.agent._boundary import Boundary
from dsh_mesh.agent._settlement import RunRecord, Settlement
from dsh_mesh.agent._steps import Steps
from dsh_mesh.agent._tool_calls import ToolCalls
from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.agent._turn import Turn
from dsh_mesh.agent._window import ContextWindow, Writes
from dsh_mesh.core import (
    EXPIRED_APPROVAL_REASON,
    Activation,
    AgentRef,
    AnswerInvalid,
    ApprovalDecisionEntry,
    ApprovalRequestEntry,
    DeliveryKind,
    Entry,
    IdFactory,
    LightEvent,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    TokensExhausted,
    ToolCall,
    TurnEndedEntry,
    TurnId,
    TurnOutcome,
    TurnStartedEntry,
    unended_turn,
)
from dsh_mesh.models import ModelProvider
from dsh_mesh.tools import ApprovalPolicy, ContextPolicy, ToolSet, TurnLimits


class AgentState(enum.Enum):
    """Where an Agent is in its life: idle (no turn), running (a turn in progress), settled
    (its Activation's run ended; it never runs again)."""

    IDLE = "idle"
    RUNNING = "running"
    SETTLED = "settled"
    """The activation has ended (or is ending); nothing more is admitted to this object."""


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

    async def check_answer(self, text: str, schema_json: str, *, seconds: float) -> str:
        """The value of the final answer ``text`` when it matches the output schema
        ``schema_json`` (:func:`~dsh_mesh.core.answer_value`), checked where a hostile schema
        cannot stall the node, within ``seconds``; raises :class:`AnswerInvalid` otherwise."""
        ...

    def children_live(self, agent: Agent) -> bool:
        """Whether a child of the agent's session is live (its notice yet to come)."""
        ...

    def text_sink(self, agent: Agent, turn_id: TurnId) -> Callable[[str], None]:
        """Where the pieces of the text of the steps ``agent`` writes in ``turn_id`` go, as the
        model generates them: to whoever watches right now, never stored (ADR 0053). Made once
        per turn; called for every piece, synchronously: it must not block."""
        ...


class Agent:
    """The in-memory object of one Activation.

    ``deliver`` is synchronous so that inbox insertion is one atomic step on the event loop.
    ``run`` is the driver; its owner (the manager's task group) cancels it to shut it down.
    """

    __slots__ = (  # a hundred thousand of these may be resident on one node (ADR 0047)
        "_approval_wait",
        "_boundary",
        "_halted",
        "_host",
        "_idle_since",
        "_ids",
        "_passivating",
        "_provider",
        "_recovering",
        "_released",
        "_run",
        "_state",
        "_tool_executor",
        "_transcript",
        "_turn",
        "_work",
        "activation",
        "approvals",
        "context",
        "header",
        "limits",
        "system_prompt",
        "tools",
    )

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
        self._recovering = False
        """Answering what an earlier activation left open (no turn: see steers_into_a_turn)."""
        self._provider = provider
        self._host = host
        self._ids = ids
        self._state = AgentState.IDLE
        self._idle_since = time.monotonic()
        """When the agent last became idle (``time.monotonic``): made, or its last turn ended."""
        self._work = LightEvent()
        self._released = LightEvent()
        self._turn: Turn | None = None
        """The running turn's own state (None between turns)."""
        self._run = RunRecord()
        self._passivating = False
        self._halted = False
        """Its subtree was stopped and closed: no turn starts; the activation ends."""
        self._boundary = Boundary(
            transcript=self._transcript,
            host=_HostCalls(self, host),
        )
        self._approval_wait = ApprovalWait(
            tools=tools,
            policy=self.approvals,
            transcript=self._transcript,
            writes=DecisionWrites(
                append=self._boundary.append,
                append_durable=self._boundary.append_shielded,
                deliver=self.deliver,
                accepting=self._boundary.accepting,
                catch_up=lambda: self._boundary.catch_up(0),
                doubt=self.doubt,
            ),
        )
        self._tool_executor = tool_executor

    def _tool_calls(self) -> ToolCalls:
        """Its tool calls, made for one turn (or one answer of what an earlier activation left
        open) and dropped with it: an idle agent holds none of a turn's parts (ADR 0047)."""
        return ToolCalls(
            caller=lambda: self.ref,
            tools=self.tools,
            transcript=self._transcript,
            append=self._boundary.append,
            executor=self._tool_executor,
        )

    def _steps(self, calls: ToolCalls, turn_id: TurnId) -> Steps:
        """One turn's steps: its context window and ``calls``, made for the turn (as is the
        callable that hands its text on as it is generated)."""
        window = ContextWindow(
            session_id=self.header.session_id,
            model=self.header.spec.model,
            system_prompt=self.system_prompt,
            tools=self.tools,
            limits=self.limits,
            policy=self.context,
            provider=self._provider,
            transcript=self._transcript,
            output_schema=self.header.spec.output_schema,
            writes=Writes(
                append=self._boundary.append,
                at_boundary=self._boundary.at_boundary,
                catch_up=self._boundary.catch_up,
                append_durable=lambda entry: self._host.append(self, entry),
            ),
            on_text=self._host.text_sink(self, turn_id),
        )
        return Steps(
            session_id=self.header.session_id,
            transcript=self._transcript,
            window=window,
            calls=calls,
            approvals=self._approval_wait,
            boundary=self._boundary,
            sends_in_inbox=lambda: self._host.sends_in_inbox(self),
            output_schema=self.header.spec.output_schema,
            check_answer=self._host.check_answer,
            children_live=lambda: self._host.children_live(self),
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
        return len(self._boundary.inbox)

    @property
    def turns_run(self) -> int:
        return self._run.turns_run

    @property
    def idle_since(self) -> float | None:
        """The ``time.monotonic()`` since which this agent has been idle with nothing unread:
        no turn running, an empty inbox, no doubt about an answer that may have landed, no
        call waiting for a person's decision, no interrupt to carry out, not halted. ``None``
        while any of that is not so. The node passivates an agent idle past its
        ``idle_passivate_after`` (docs/adr/0044); waking sends are the host's to count."""
        if (
            self._state is not AgentState.IDLE
            or self.inbox_depth
            or self._boundary.in_doubt
            or self._approval_wait.cancel_reason is not None
            or self._halted
            or self._waiting_call() is not None
        ):
            return None
        return self._idle_since

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
        self._boundary.doubt()
        self._work.set()  # a call waiting for approval may have its decision among what landed

    @contextlib.asynccontextmanager
    async def accepting(self) -> AsyncIterator[None]:
        """Hold off this agent's step boundary while one inbound record is appended and
        delivered: the host wraps every accept in it, so a ``ConsumedEntry`` never has a lower
        seq than a Steer record it did not read (docs/adr/0007)."""
        async with self._boundary.accepting():
            yield

    def deliver(self, record: Record) -> DeliveryKind:
        """Insert an accepted inbound record. Synchronous: the caller already made it durable.

        A running agent reads it at its next step boundary; an idle one starts a turn.
        """
        if self._state is AgentState.SETTLED:
            raise RuntimeError(f"{self.session_id}: delivery to a settled activation")
        self.record(record)
        self._boundary.inbox.put(record)
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
                if self._boundary.in_doubt:
                    await self._boundary.resolve_doubt()
                    continue
                if self._approval_wait.cancel_reason is not None or self._halted:
                    await self._cancel_waiting(
                        waiting, self._approval_wait.cancel_reason or "stopped"
                    )
                    continue
                if await self._approval_wait.deny_if_expired(waiting, EXPIRED_APPROVAL_REASON):
                    continue
            if len(self._boundary.inbox) and not self._halted and waiting is None:
                if await self._host.closed(self):  # closed before this turn (or activation)
                    self._halted = True
                    continue
                await self._take_turn(self._boundary.inbox.take_turn_input())
                continue
            if waiting is not None and self._boundary.inbox.has_decision(waiting.call_id):
                await self._take_turn(self._boundary.inbox.take_decisions(), going_on=True)
                continue
            if self._halted and len(self._boundary.inbox):
                # Nothing here reads them: their holds end, and they stay durable, unread, for
                # the first activation after the subtree is reopened.
                self._host.admitted(self, self._boundary.inbox.take_all())
            may_end = self.header.kind is not SessionKind.ROOT or self._passivating or self._halted
            if waiting is not None and self.header.kind is not SessionKind.ROOT:
                may_end = False  # a child's run goes on once the call is decided
            if may_end and self._host.may_settle(self):
                self._state = AgentState.SETTLED
                self._host.changed()
                try:
                    await self._host.settled(
                        self, self._run.settlement(self._transcript.terminal_output())
                    )
                finally:
                    self._released.set()
                return
            self._work.clear()
            if waiting is None:
                await self._work.wait()  # an idle agent holds no timer
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._approval_wait.until_expiry(waiting)):
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
            await self._take_turn(
                self._boundary.inbox.take_decisions(), going_on=True, interrupted=detail
            )
        finally:
            self._approval_wait.cancel_reason = None

    async def _finish_left_over_turn(self) -> None:
        """Answer, durably, every call of the last step that an earlier activation left without
        a result (:meth:`ToolCalls.answer_left_over`), then end that activation's unended turn
        as ``lost`` and tell the parent. A call waiting for approval stays open: the turn goes
        on from it once it is decided."""
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
        await self._tool_calls().answer_left_over(step_seq, open_calls, self.needs_approval)
        if open_turn is not None:
            await self._boundary.append(
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
        self._idle_since = time.monotonic()
        self._recovering = False
        self._host.changed()

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
            self._run.started(turn_span.traceparent)
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
        # A request to passivate was for the idle agent it saw: this one has work again, and
        # is asked anew once it has been idle long enough (or the memory is short again).
        self._passivating = False
        self._host.changed()
        await self._boundary.append(
            TurnStartedEntry(
                turn_id=turn.turn_id,
                node_id=self.activation.node_id,
                activation_id=self.activation.activation_id,
                trace=trace,
            )
        )
        await self._boundary.read_waiting(first, steered=not going_on)
        calls = self._tool_calls()
        turn.steps = asyncio.create_task(
            self._steps(calls, turn.turn_id).run(turn, going_on=going_on),
            name=f"turn {turn.turn_id}",
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
        except AnswerInvalid as invalid:
            outcome, detail = TurnOutcome.ERROR, str(invalid)
        except Exception as failure:  # a failed model call ends the turn, never the driver
            outcome, detail = TurnOutcome.ERROR, f"{type(failure).__name__}: {failure}"
        finally:
            turn.signal.abort("turn ended")
            turn.cancellable = False
        await self._boundary.finish_writes()
        if outcome is not TurnOutcome.AWAITING_APPROVAL:
            await calls.close_open(turn, outcome)
        output = turn.output_json if outcome is TurnOutcome.COMPLETED else ""
        await self._boundary.append(
            TurnEndedEntry(turn_id=turn.turn_id, outcome=outcome, detail=detail, output_json=output)
        )
        self._run.ended(outcome, detail, output)
        self._turn = None
        self._state = AgentState.IDLE
        self._idle_since = time.monotonic()
        self._host.changed()
        return outcome


class _HostCalls:
    """The host's calls for one agent's boundary (:class:`HostCalls`): one small object, not
    a closure per call, as every resident agent holds one (ADR 0047)."""

    __slots__ = ("_agent", "_host")

    def __init__(self, agent: Agent, host: AgentHost) -> None:
        self._agent = agent
        self._host = host

    async def append(self, entry: Entry) -> Record:
        return await self._host.append(self._agent, entry)

    async def read_after(self, seq: int) -> Sequence[Record]:
        return await self._host.read_after(self._agent, seq)

    def admitted(self, records: Sequence[Record]) -> None:
        self._host.admitted(self._agent, records)

    def deliver(self, record: Record) -> DeliveryKind:
        return self._agent.deliver(record)
