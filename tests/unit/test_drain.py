"""A drain releases its activations concurrently and within a budget (issue 34, ADR 0046): a
node with thousands of resident agents stops in seconds, not one release after another; what
it could not release in time, or failed to, ends with its lease."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any, cast

import pytest

from dsh_mesh.core import Activation, RegistryUnavailable
from dsh_mesh.models import Reply
from dsh_mesh.runtime import _residency as residency_module
from dsh_mesh.testing import FaultySessionStore, Proceed, StoreCall, in_process_mesh
from tests.unit.conftest import presets

AGENTS = 200
RELEASE_S = 0.05


class Releases:
    """What the store's releases did: how many ran at once, and which succeeded."""

    def __init__(self, store: FaultySessionStore, *, hang: bool = False, fail: bool = False):
        self.released: list[Activation] = []
        self.in_flight = self.most_in_flight = 0

        async def slow(call: StoreCall, proceed: Proceed) -> Any:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.sleep(3600 if hang else RELEASE_S)
                if fail:
                    raise RegistryUnavailable("etcd is away")
                answer = await proceed()
                self.released.append(cast(Activation, call.arguments["activation"]))
                return answer
            finally:
                self.in_flight -= 1

        store.faults.around("release", slow, times=None)


async def drained(*, hang: bool = False, fail: bool = False) -> tuple[float, Releases]:
    """Seconds a drain of ``AGENTS`` idle agents took, releases as asked."""
    store = FaultySessionStore()
    async with in_process_mesh(presets(), store=store) as mesh:
        mesh.scripted.program("lead", *[Reply(text="done") for _ in range(AGENTS)])
        for _ in range(AGENTS):
            await mesh.manager.create_root("", preset="lead")
        await mesh.manager.quiescent()
        releases = Releases(store, hang=hang, fail=fail)
        started = time.perf_counter()
        await mesh.manager.drain(timedelta(0))
        return time.perf_counter() - started, releases


async def test_a_drain_releases_its_activations_concurrently() -> None:
    took, releases = await drained()
    assert len(releases.released) == AGENTS
    assert releases.most_in_flight == residency_module.RELEASES_IN_FLIGHT
    assert took < AGENTS * RELEASE_S / 4  # one after another would take 10 s


async def test_a_drain_gives_up_on_releases_past_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(residency_module, "DRAIN_RELEASE_BUDGET", timedelta(seconds=0.3))
    took, releases = await drained(hang=True)
    assert releases.released == [] and took < 5


async def test_a_drain_goes_on_past_releases_that_fail() -> None:
    took, releases = await drained(fail=True)
    assert releases.released == [] and took < AGENTS * RELEASE_S / 4
