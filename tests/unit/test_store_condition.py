"""A log store's condition, what a node's health says of it: degraded while its last refusal is
younger than the window, with the refusal's reason and words; clear after."""

from __future__ import annotations

from datetime import timedelta

from dsh_mesh.core import RegistryUnavailable, StoreRefused
from dsh_mesh.runtime import StoreCondition


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_store_that_never_refused_is_not_degraded() -> None:
    assert StoreCondition().degraded() is None


def test_a_refusal_degrades_the_store_for_the_window_and_says_why() -> None:
    clock = Clock()
    condition = StoreCondition(window=timedelta(seconds=15), clock=clock)
    refusal = StoreRefused("permission denied for table entries", metadata={"code": "42501"})
    assert condition.refused(refusal) is refusal
    assert condition.degraded() == "STORE_REFUSED: permission denied for table entries"
    clock.now += 14.9
    assert condition.degraded() is not None
    clock.now += 0.1
    assert condition.degraded() is None


def test_the_latest_refusal_is_the_one_reported() -> None:
    clock = Clock()
    condition = StoreCondition(clock=clock)
    condition.refused(StoreRefused("permission denied"))
    clock.now += 5
    condition.refused(RegistryUnavailable("read-only transaction"))
    assert condition.degraded() == "REGISTRY_UNAVAILABLE: read-only transaction"


def test_an_accepted_write_clears_the_refusal_before_the_window_ends() -> None:
    clock = Clock()
    condition = StoreCondition(clock=clock)
    condition.refused(RegistryUnavailable("database is locked"))
    clock.now += 1
    condition.accepted()
    assert condition.degraded() is None
