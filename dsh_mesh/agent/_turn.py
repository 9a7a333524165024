"""One turn's own state: made when the turn starts, dropped when it ends.

What belongs to one turn and nothing after it: its id, the task running its steps and the
signal its tool calls abort on, whether an interrupt is being carried out (and why), the model
calls and tokens counted against its limits, the call running now, and the standard-tool call
an interrupt stopped mid-way. Nothing is reset by hand at a turn's end: the next turn is a new
object.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dsh_mesh.core import AbortSignal, TokensExhausted, TurnId, TurnOutcome, Usage
from dsh_mesh.tools import ToolOutput, TurnLimits


@dataclass(eq=False, kw_only=True)
class Turn:
    """The state of one running turn (see the module's docstring)."""

    turn_id: TurnId
    limits: TurnLimits
    signal: AbortSignal = field(default_factory=AbortSignal)
    steps: asyncio.Task[TurnOutcome] | None = None
    """The task running the turn's steps, once they started."""
    cancellable: bool = True
    """From the turn's start until its steps end: an interrupt then cancels it."""
    interrupting: bool = False
    interrupt_detail: str = "interrupted"
    model_calls: int = 0
    tokens: int = 0
    running_call: str | None = None
    """The id of the tool call the current step is running, if any."""
    interrupted_call: tuple[str, asyncio.Future[ToolOutput]] | None = None
    """The standard-tool call an interrupt stopped mid-way, still finding its answer."""
    output_json: str = ""
    """The answer's value, once a final answer matched the session's output schema."""
    answers_rejected: int = 0
    """How many final answers of the turn did not match the session's output schema."""

    def interrupt(self, detail: str) -> None:
        """Cancel the turn's steps (recorded as cancelled, with ``detail``). Idempotent while
        the cancellation is in flight; before the steps started, they are cancelled as soon
        as they start, so an interrupt is never lost."""
        if self.interrupting:
            return
        self.interrupting, self.interrupt_detail = True, detail
        if self.steps is not None:
            self.steps.cancel()

    def count_model_call(self) -> None:
        """One more model call; :class:`TokensExhausted` when the turn's limit is reached."""
        limit = self.limits.max_model_calls
        if limit is not None and self.model_calls >= limit:
            raise TokensExhausted(
                f"the turn made {self.model_calls} model calls; its limit is {limit}"
                " (max_model_calls_per_turn)"
            )
        self.model_calls += 1

    def count_tokens(self, usage: Usage) -> None:
        """The tokens of one model call of the turn (a compaction's included)."""
        self.tokens += usage.input_tokens + usage.output_tokens

    def check_budget(self) -> None:
        """:class:`TokensExhausted` once the turn has used its token budget."""
        budget = self.limits.turn_token_budget
        if budget is not None and self.tokens >= budget:
            raise TokensExhausted(f"the turn used {self.tokens} tokens; its budget is {budget}")
