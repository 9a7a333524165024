"""What one activation's run will report when it ends: its settlement (docs/contract.md,
ADR 0003).

One owner: how many turns the run took, and the last one's outcome, detail and trace. The
host reports the :class:`Settlement` to the parent as a settlement notice; a run that took
no turn reports none.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsh_mesh.core import SettlementOutcome, TurnOutcome


@dataclass(frozen=True, kw_only=True)
class Settlement:
    """How an Activation's run ended, as the manager reports it to the parent."""

    outcome: SettlementOutcome
    terminal_output: str
    detail: str = ""
    trace: str = ""
    """The ``traceparent`` of the final turn's span ("" when tracing is off)."""
    output_json: str = ""
    """The final turn's answer as its output schema's value (ADR 0052); ``""`` when the
    session names no schema or the turn did not complete."""


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


def settlement_outcome(turn: TurnOutcome) -> SettlementOutcome:
    """What a run whose last turn ended with ``turn`` reports."""
    return _SETTLEMENT_OF_TURN[turn]


class RunRecord:
    """The turns of one activation's run, as its settlement reports them."""

    def __init__(self) -> None:
        self.turns_run = 0
        self._outcome = TurnOutcome.COMPLETED
        self._detail = ""
        self._trace = ""
        self._output_json = ""

    def started(self, trace: str) -> None:
        """A turn started, traced as ``trace`` (its span's ``traceparent``)."""
        self._trace = trace

    def ended(self, outcome: TurnOutcome, detail: str, output_json: str = "") -> None:
        """The turn ended with ``outcome`` (and, completed, the answer's value)."""
        self.turns_run += 1
        self._outcome, self._detail, self._output_json = outcome, detail, output_json

    def settlement(self, terminal_output: str) -> Settlement | None:
        """What the run reports, with the last step's text; None when it took no turn."""
        if self.turns_run == 0:
            return None
        return Settlement(
            outcome=settlement_outcome(self._outcome),
            terminal_output=terminal_output,
            detail=self._detail,
            trace=self._trace,
            output_json=self._output_json,
        )
