"""A node process's garbage collector (ADR 0047, section 10): its youngest generation is
collected every 10,000 allocations, not CPython's 700, so a message's short-lived objects die
young instead of being promoted and walked again by every full collection."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsh_mesh.node._collector import YOUNG_THRESHOLD, tune_collector


@pytest.fixture
def thresholds() -> Iterator[None]:
    kept = gc.get_threshold()
    yield
    gc.set_threshold(*kept)


@pytest.mark.usefixtures("thresholds")
def test_tuning_raises_the_young_threshold_and_keeps_the_older_generations() -> None:
    gc.set_threshold(700, 11, 12)
    tune_collector()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12)
    assert YOUNG_THRESHOLD == 10_000


_PROBE = """
import gc, sys
import dsh_mesh.node._main as program

def loop(main, *, choice):
    main.close()  # nothing is served: the probe only reads the collector's settings
    print(gc.get_threshold()[0])

program.run_event_loop = loop
sys.exit(program.main(sys.argv[1:]))
"""


def test_the_node_program_tunes_its_collector_before_it_serves(tmp_path: Path) -> None:
    flags = ["--log-store", "sqlite:log.db", "--cluster-token", "t" * 32, "--plaintext"]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(YOUNG_THRESHOLD)]
