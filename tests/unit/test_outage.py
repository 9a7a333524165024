"""Saying an outage once (``registry/_outage.py``, ADR 0048): a retried failure is logged when
it begins, then at most once a ``every`` while it lasts, and once when it ends; the wait before
the next try doubles up to its cap."""

from __future__ import annotations

import logging

import pytest

from dsh_mesh.registry._outage import Outage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failure_is_said_once_then_every_so_often_then_once_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    outage = Outage(logging.getLogger("t"), "watch on x", first_delay=0.2, every=30, clock=clock)
    caplog.set_level(logging.WARNING, logger="t")
    delays = []
    for _ in range(40):  # a try a second, for 40 s
        delays.append(outage.failed(OSError("refused")))
        clock.now += 1
    assert [r.getMessage() for r in caplog.records] == [
        "watch on x broke: refused",
        "watch on x still broken after 30 s (31 tries): refused",
    ]
    assert outage.last == "refused"
    assert delays[:4] == [0.2, 0.4, 0.8, 1.0] and set(delays[4:]) == {1.0}
    outage.ended()
    assert caplog.records[-1].getMessage() == "watch on x works again after 40.0 s (40 tries)"
    assert outage.last is None
    # A new failure is said again, and its waits start short again.
    assert outage.failed(OSError("reset")) == 0.2
    assert caplog.records[-1].getMessage() == "watch on x broke: reset"


def test_a_single_failed_try_is_not_told_as_a_recovery(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage(logging.getLogger("t"), "watch on x", first_delay=0.2, clock=Clock())
    caplog.set_level(logging.WARNING, logger="t")
    outage.ended()  # nothing failed: nothing said
    outage.failed(OSError("refused"))
    outage.ended()
    assert [r.getMessage() for r in caplog.records] == ["watch on x broke: refused"]
