"""The tool calls of one agent: each call run, and each answered exactly once
(docs/tools.md, ADR 0029).

It runs a call (a user tool under its limits, cancelled by an interrupt; a standard tool never
abandoned half-way: an interrupt lets it find its own answer), records the one result of a
call, and, when a turn ends, answers every call of its last step still without one. The state
of the turn it runs in is the :class:`~dsh_mesh.agent._turn.Turn`'s; it is never handed the
agent.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor

from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.agent._turn import Turn
from dsh_mesh.core import (
    MAX_ARGUMENTS_DEPTH,
    MAX_STEP_BYTES,
    AbortSignal,
    AgentRef,
    Entry,
    InvalidArgument,
    Record,
    ToolCall,
    ToolResultEntry,
    TurnOutcome,
    parse_bounded,
)
from dsh_mesh.tools import (
    ToolInvocation,
    ToolOutput,
    ToolSet,
    is_idempotent_by_key,
    is_standard_tool,
    limits_of,
    outcome_unknown,
    run_limited,
)


class ToolCalls:
    """The tool calls of one agent (see the module's docstring)."""

    def __init__(
        self,
        *,
        caller: Callable[[], AgentRef],
        tools: ToolSet,
        transcript: LocalTranscript,
        append: Callable[[Entry], Awaitable[Record]],
        executor: Executor | None = None,
    ) -> None:
        self._caller = caller
        """The agent as a tool's caller now (its exact live activation)."""
        self._tools = tools
        self._transcript = transcript
        self._append = append
        self._executor = executor
        """Where a blocking Python tool's function runs (None: the loop's default executor)."""

    async def invoke(
        self,
        call: ToolCall,
        signal: AbortSignal,
        *,
        step_seq: int,
        index: int,
        turn: Turn | None = None,
    ) -> ToolOutput:
        """Run ``call`` (the ``index``-th of the step at ``step_seq``), aborting on ``signal``;
        its output, never an exception of the tool's. In ``turn``, a standard tool's call an
        interrupt stops keeps finding its answer (:meth:`close_open`)."""
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolOutput(content=f"unknown tool {call.name!r}", is_error=True)
        try:
            # Bounded: a step recorded before ADR 0038, or a person's edit, may be anything.
            arguments = parse_bounded(
                call.arguments_json or "{}", max_depth=MAX_ARGUMENTS_DEPTH, max_bytes=MAX_STEP_BYTES
            )
        except InvalidArgument as bad:
            return ToolOutput(content=f"arguments refused: {bad.detail}", is_error=True)
        if not isinstance(arguments, dict):
            return ToolOutput(content="arguments must be a JSON object", is_error=True)
        invocation = ToolInvocation(
            caller=self._caller(),
            call=call,
            signal=signal,
            step_seq=step_seq,
            index=index,
            executor=self._executor,
        )
        if not is_standard_tool(tool):
            # A user tool: its limits apply, and an interrupt cancels it.
            return await run_limited(tool, invocation, arguments, limits_of(tool))
        # A standard tool's call is never abandoned half-way: an interrupt aborts its signal,
        # and the call answers for itself (stopped before its point of no return, or carried
        # out past it); the turn's close records that answer (close_open).
        answering = asyncio.ensure_future(_answer_of(tool.invoke(invocation, arguments)))
        try:
            return await asyncio.shield(answering)
        except asyncio.CancelledError:
            if turn is not None and turn.interrupting:
                signal.abort("the turn was interrupted")
                turn.interrupted_call = (call.call_id, answering)
            else:
                answering.cancel()
            raise

    async def answer(
        self, call: ToolCall, output: ToolOutput, *, started: float | None = None
    ) -> None:
        """Record ``output`` as the one result of ``call`` (which ran from ``started``, a
        ``time.monotonic()``; None: it did not run here). A call that ran records at least 1 ms
        (rounded up): 0 says it did not run."""
        elapsed = 0 if started is None else max(1, math.ceil((time.monotonic() - started) * 1000))
        await self._append(
            ToolResultEntry(
                call_id=call.call_id,
                name=call.name,
                content=output.content,
                is_error=output.is_error,
                duration_ms=elapsed,
            )
        )

    async def answer_left_over(
        self,
        step_seq: int,
        open_calls: Sequence[tuple[int, ToolCall]],
        needs_approval: Callable[[ToolCall], bool],
    ) -> None:
        """Answer, durably, each of ``open_calls`` of the step ``step_seq`` that an earlier
        activation left without a result (its host died, was fenced or cut off mid-step). A
        call of a tool that is idempotent by key (the standard tools, a user tool declared
        safe to replay) is carried out again under the call's own key: the repeat finds what
        the first try did or does it now, so the answer is exact and the effect happens once.
        Any other call is answered "outcome unknown", never run again.

        A call that waits for approval stays open, and so do the calls after it: the turn
        goes on from there once it is decided. A call that needed approval and never had a
        decision read never ran: it is answered "not run" if no request was written for it."""
        signal = AbortSignal()
        never_ran = False
        for index, call in open_calls:
            tool = self._tools.get(call.name)
            started: float | None = None
            if call.refused:
                output = ToolOutput(content=call.refused, is_error=True)
            elif never_ran:
                output = ToolOutput(
                    content="not run: its host stopped before this call started", is_error=True
                )
            elif needs_approval(call) and not self._transcript.decision_read(call.call_id):
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
                output = await self.invoke(call, signal, step_seq=step_seq, index=index)
            else:
                output = outcome_unknown(call)
            await self.answer(call, output, started=started)

    async def close_open(self, turn: Turn, outcome: TurnOutcome) -> None:
        """Give every tool call of an ended turn a result, so the transcript stays renderable.
        The standard-tool call an interrupt stopped gets its own answer (sent or not, spawned
        or not); a user tool's call that was running is told it was cancelled and may or may
        not have taken effect; a call that never started is told so."""
        finishing, running = turn.interrupted_call, turn.running_call
        # The turn's last step, if it has one: an earlier turn's steps are all answered.
        for _, call in self._transcript.last_step()[1]:
            if finishing is not None and finishing[0] == call.call_id:
                output = await finishing[1]
                finishing = None
            elif call.call_id == running:
                output = ToolOutput(
                    content=f"not completed: the turn ended ({outcome.value}) while this call"
                    " ran, and the call was cancelled; it may or may not have taken effect.",
                    is_error=True,
                )
            else:
                output = ToolOutput(
                    content=f"not run: the turn ended ({outcome.value}) before this call started.",
                    is_error=True,
                )
            await self.answer(call, output)
        if finishing is not None:
            finishing[1].cancel()


async def _answer_of(work: Awaitable[ToolOutput]) -> ToolOutput:
    """A tool's answer; a broken tool fails its call, not the turn."""
    try:
        return await work
    except Exception as failure:
        return ToolOutput(content=f"{type(failure).__name__}: {failure}", is_error=True)
