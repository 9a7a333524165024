"""A node on protobuf's pure-Python implementation says so when it starts (ADR 0047, section
13): it works, at about twice the CPU a message, and the operator learns why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import sys
import dsh_mesh.node._main as program

def loop(main, *, choice):
    main.close()  # nothing is served: the probe only reads what the node says at its start

program.run_event_loop = loop
sys.exit(program.main(sys.argv[1:]))
"""
FLAGS = ["--log-store", "sqlite:log.db", "--cluster-token", "t" * 32, "--plaintext"]


@pytest.mark.parametrize("implementation", ["upb", "python"])
def test_a_node_warns_at_start_unless_protobuf_runs_upb(
    tmp_path: Path, implementation: str
) -> None:
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": implementation}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *FLAGS],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
        env=env,
    )
    assert done.returncode == 0, done.stderr
    warned = "protobuf runs its python implementation, not upb" in done.stderr
    assert warned == (implementation == "python"), done.stderr
    assert "Logging error" not in done.stderr
