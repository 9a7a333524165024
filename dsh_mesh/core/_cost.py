"""Cost in money: what a model call's tokens cost at its model's price, summed over calls.

A price is in US dollars per million tokens, three figures as providers quote them: input
tokens the prompt cache did not serve, input tokens it served (usually cheaper), output
tokens. Each call is priced at the model that made it: a step at its session's model, a
compaction's summary at the model that wrote it. A call whose model has no price costs
nothing here and is counted as unpriced, so a total never passes for complete when it is not.
Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dsh_mesh.core._chat import Usage
from dsh_mesh.core._transcript import AssistantStepEntry, CompactionEntry, Entry
from dsh_mesh.core._usage import SessionUsage

PER = 1_000_000
"""Tokens a price is quoted for."""


@dataclass(frozen=True, kw_only=True)
class ModelPrice:
    """One model's price, in US dollars per million tokens. ``cached_input_usd_per_mtok``
    ``None``: cached input costs as much as the rest."""

    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_input_usd_per_mtok: float | None = None

    def __post_init__(self) -> None:
        for name in ("input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of dollars, at least 0")

    @property
    def cached_input(self) -> float:
        """Dollars per million cached input tokens."""
        if self.cached_input_usd_per_mtok is None:
            return self.input_usd_per_mtok
        return self.cached_input_usd_per_mtok

    def cost(self, usage: Usage) -> float:
        """What one call with ``usage`` cost, in dollars."""
        cached = min(usage.cached_input_tokens, usage.input_tokens)
        fresh = usage.input_tokens - cached
        return (
            fresh * self.input_usd_per_mtok
            + cached * self.cached_input
            + usage.output_tokens * self.output_usd_per_mtok
        ) / PER


@dataclass(frozen=True)
class Cost:
    """Dollars spent by some calls, and how many more calls had no price."""

    usd: float = 0.0
    unpriced_calls: int = 0

    def plus(self, other: Cost) -> Cost:
        return Cost(self.usd + other.usd, self.unpriced_calls + other.unpriced_calls)

    def describe(self) -> str:
        """``$0.0123``; ``$0.0123 + 2 calls unpriced``; ``unpriced (2 calls)``."""
        if self.unpriced_calls and not self.usd:
            calls = "1 call" if self.unpriced_calls == 1 else f"{self.unpriced_calls} calls"
            return f"unpriced ({calls})"
        text = f"${self.usd:.4f}" if self.usd < 1 else f"${self.usd:,.2f}"
        if self.unpriced_calls:
            text += f" + {self.unpriced_calls} unpriced"
        return text


def call_cost(usage: Usage, model: str, prices: Mapping[str, ModelPrice]) -> Cost:
    """One call's cost at ``model``'s price (unpriced when it has none)."""
    price = prices.get(model)
    return Cost(0.0, 1) if price is None else Cost(price.cost(usage))


def usage_cost(usage: SessionUsage, model: str, prices: Mapping[str, ModelPrice]) -> Cost:
    """The cost of a session's calls summed in ``usage``, every one priced at ``model`` (a
    price is linear: the cost of the sum is the sum of the costs)."""
    price = prices.get(model)
    if price is None:
        return Cost(0.0, usage.model_calls)
    total = Usage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_input_tokens=usage.cached_input_tokens,
    )
    return Cost(price.cost(total))


def entry_cost(entry: Entry, model: str, prices: Mapping[str, ModelPrice]) -> Cost | None:
    """The cost of ``entry`` if it is a model call (a step, at its session's ``model``; a
    compaction, at the model that wrote its summary), else ``None``."""
    if isinstance(entry, AssistantStepEntry):
        return call_cost(entry.usage, model, prices)
    if isinstance(entry, CompactionEntry):
        return call_cost(entry.usage, entry.model or model, prices)
    return None


def session_cost(entries: Iterable[Entry], model: str, prices: Mapping[str, ModelPrice]) -> Cost:
    """The cost of every model call among ``entries`` of a session whose model is
    ``model``."""
    total = Cost()
    for entry in entries:
        cost = entry_cost(entry, model, prices)
        if cost is not None:
            total = total.plus(cost)
    return total
