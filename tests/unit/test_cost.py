"""Cost in money: each call priced at the model that made it; a call without a price counted,
never hidden in a total that looks complete."""

from __future__ import annotations

import pytest

from dsh_mesh.core import (
    AssistantStepEntry,
    CompactionEntry,
    Cost,
    Entry,
    ModelPrice,
    SessionUsage,
    TaskEntry,
    Usage,
    session_cost,
    usage_cost,
)

PRICES = {
    "big:m": ModelPrice(input_usd_per_mtok=10.0, output_usd_per_mtok=30.0),
    "small:m": ModelPrice(
        input_usd_per_mtok=1.0, cached_input_usd_per_mtok=0.5, output_usd_per_mtok=2.0
    ),
}


def step(input_tokens: int, output_tokens: int, cached: int = 0) -> AssistantStepEntry:
    usage = Usage(
        input_tokens=input_tokens, output_tokens=output_tokens, cached_input_tokens=cached
    )
    return AssistantStepEntry(text="", tool_calls=(), usage=usage)


def test_steps_at_the_sessions_model_a_summary_at_its_own() -> None:
    summary = CompactionEntry(
        summary="s", from_seq=1, through_seq=2, model="small:m", usage=Usage(input_tokens=1000)
    )
    entries: list[Entry] = [TaskEntry(content="t"), step(1000, 100, cached=400), summary]
    cost = session_cost(entries, "big:m", PRICES)
    assert cost.usd == pytest.approx((1000 * 10 + 100 * 30) / 1e6 + 1000 * 1.0 / 1e6)
    assert cost.unpriced_calls == 0
    # cached input at its own price where the model has one
    assert session_cost([step(1000, 0, cached=400)], "small:m", PRICES).usd == pytest.approx(
        (600 * 1.0 + 400 * 0.5) / 1e6
    )


def test_a_call_without_a_price_is_counted_not_hidden() -> None:
    cost = session_cost([step(10, 10), step(10, 10)], "free:m", PRICES)
    assert cost == Cost(0.0, 2)
    assert cost.describe() == "unpriced (2 calls)"
    assert Cost(0.0123, 1).describe() == "$0.0123 + 1 unpriced"
    assert Cost(12.5).describe() == "$12.50"
    usage = SessionUsage(model_calls=3, input_tokens=2000, output_tokens=100)
    assert usage_cost(usage, "free:m", PRICES) == Cost(0.0, 3)
    assert usage_cost(usage, "big:m", PRICES).usd == pytest.approx((20000 + 3000) / 1e6)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_price_is_a_finite_number_of_dollars(bad: float) -> None:
    with pytest.raises(ValueError, match="finite number of dollars"):
        ModelPrice(input_usd_per_mtok=bad, output_usd_per_mtok=1.0)
