"""The steps of one turn: a model call, its tool calls in order (each answered once; a gated
one waits for its decision), then the step boundary's read (docs/adr/0007).

It holds no state of its own: the turn's is the :class:`~dsh_mesh.agent._turn.Turn`'s, and it
works through the agent's owners (the window, the tool calls, the approval wait, the boundary)
and one callable of its host. It is never handed the agent.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from dsh_mesh import telemetry
from dsh_mesh.agent._approval_wait import ApprovalWait
from dsh_mesh.agent._approvals import denied, edited
from dsh_mesh.agent._boundary import Boundary
from dsh_mesh.agent._tool_calls import ToolCalls
from dsh_mesh.agent._transcript import LocalTranscript
from dsh_mesh.agent._turn import Turn
from dsh_mesh.agent._window import ContextWindow
from dsh_mesh.core import (
    ANSWER_RETRIES,
    AnswerInvalid,
    AnswerRejectedEntry,
    ApprovalDecision,
    SessionId,
    TokensExhausted,
    ToolCall,
    TurnOutcome,
    recorded_step,
)
from dsh_mesh.models import FinishReason
from dsh_mesh.tools import ToolOutput

ANSWER_CHECK_SECONDS = 5.0
"""How long checking one answer against its schema may take (in a worker process) before the
answer counts as not matching: a schema whose ``pattern`` backtracks never stalls the node."""


class CheckAnswer(Protocol):
    """The host's check of a final answer (``AgentHost.check_answer``)."""

    async def __call__(self, text: str, schema_json: str, *, seconds: float) -> str: ...


class Steps:
    """The steps of one agent's turns (see the module's docstring)."""

    def __init__(
        self,
        *,
        session_id: SessionId,
        transcript: LocalTranscript,
        window: ContextWindow,
        calls: ToolCalls,
        approvals: ApprovalWait,
        boundary: Boundary,
        sends_in_inbox: Callable[[], Awaitable[None]],
        output_schema: str,
        check_answer: CheckAnswer,
        children_live: Callable[[], bool],
    ) -> None:
        self._session_id = session_id
        self._output_schema = output_schema
        self._check_answer = check_answer
        self._children_live = children_live
        self._transcript = transcript
        self._window = window
        self._calls = calls
        self._approvals = approvals
        self._boundary = boundary
        self._sends_in_inbox = sends_in_inbox

    async def run(self, turn: Turn, *, going_on: bool = False) -> TurnOutcome:
        """Every step of ``turn`` until it is over; its outcome. ``going_on``: the turn goes on
        from the call the last one stopped at, waiting for approval: that step's open calls
        first. Raises what ends the turn otherwise (:class:`AwaitingApproval`,
        ``TokensExhausted``, a model call's failure, a cancellation)."""
        if going_on:
            step_seq, open_calls = self._transcript.last_step()
            with telemetry.span("dsh.step", attributes={"dsh.session.id": self._session_id}):
                outcome = await self._calls_and_boundary(turn, step_seq, open_calls, asked=True)
            if outcome is not None:
                return outcome
        for index in itertools.count():
            links = self._boundary.take_links()
            with telemetry.span(
                "dsh.step",
                attributes={"dsh.session.id": self._session_id, "dsh.step.index": index},
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
        step = await self._boundary.append(recorded)
        if response.finish_reason is FinishReason.LENGTH:
            raise TokensExhausted("the model stopped at its token limit")
        turn.count_tokens(response.usage)
        turn.check_budget()
        calls = list(enumerate(recorded.tool_calls))
        outcome = await self._calls_and_boundary(
            turn, step.seq, calls, asked=bool(recorded.tool_calls)
        )
        if outcome is TurnOutcome.COMPLETED and self._output_schema and not self._children_live():
            # A turn that ends while children of it work is no final answer: their notices
            # start the next turn, and the answer of the turn that ends without them is.
            return await self._answer(turn, recorded.text)
        return outcome

    async def _answer(self, turn: Turn, text: str) -> TurnOutcome | None:
        """The turn's final answer, ``text``, checked against the session's output schema:
        the turn completes with its value (unless something arrived meanwhile: the turn goes
        on to read it), or the model is told why it does not match and asked again (another
        step), up to :data:`ANSWER_RETRIES` times; then the turn ends with outcome ``error``
        (:class:`AnswerInvalid`). ADR 0052."""
        schema = self._output_schema
        try:
            turn.output_json = await self._check_answer(text, schema, seconds=ANSWER_CHECK_SECONDS)
        except AnswerInvalid as invalid:
            reason = str(invalid)
        else:
            # What was sent while it was checked was told "steered": this turn reads it, and
            # its answer is the one after that.
            await self._sends_in_inbox()
            if await self._boundary.read_waiting():
                turn.output_json = ""
                return None
            return TurnOutcome.COMPLETED
        turn.answers_rejected += 1
        await self._boundary.append(AnswerRejectedEntry(reason=reason, schema=schema))
        if turn.answers_rejected > ANSWER_RETRIES:
            raise AnswerInvalid(
                f"no answer matched the output schema in {turn.answers_rejected} tries; the"
                f" last: {reason}"
            )
        return None

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
            decision = await self._approvals.decision_for(call, step_seq)
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
            await self._sends_in_inbox()
        if not await self._boundary.read_waiting() and not asked:
            return TurnOutcome.COMPLETED
        return None
