"""What the node program sets up and says before it serves (ADR 0047): its garbage
collector's young threshold (section 10), a warning when protobuf does not run upb (section
13), and no INFO line per HTTP request (issue 36). Each case starts the program in a process
of its own, whose loop serves nothing."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsh_mesh.node._collector import YOUNG_THRESHOLD, tune_collector

_PROBE = """
import gc, logging, sys
import dsh_mesh.node._main as program

def loop(main, *, choice):
    main.close()  # nothing is served: the probe reads what the program set and said
    print(gc.get_threshold()[0], logging.getLogger("httpx").getEffectiveLevel())

program.run_event_loop = loop
sys.exit(program.main(sys.argv[1:]))
"""
FLAGS = ["--log-store", "sqlite:log.db", "--cluster-token", "t" * 32, "--plaintext"]


def _started(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *FLAGS],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    assert "Logging error" not in done.stderr
    return done


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


def test_the_node_program_tunes_its_collector_before_it_serves(tmp_path: Path) -> None:
    assert _started(tmp_path).stdout.split()[0] == str(YOUNG_THRESHOLD)


def test_the_node_program_logs_no_line_per_http_request(tmp_path: Path) -> None:
    # httpx's one INFO line per model call was 57% of a node's log (issue 36).
    done = _started(tmp_path)
    assert done.stdout.split()[1] == str(logging.WARNING)


@pytest.mark.parametrize("implementation", ["upb", "python"])
def test_a_node_warns_at_start_unless_protobuf_runs_upb(
    tmp_path: Path, implementation: str
) -> None:
    done = _started(tmp_path, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=implementation)
    warned = "protobuf runs its python implementation, not upb" in done.stderr
    assert warned == (implementation == "python"), done.stderr
