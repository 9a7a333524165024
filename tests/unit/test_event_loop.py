"""The node process's event loop (ADR 0047): the standard loop by default, uvloop on request,
an unknown name refused before anything runs."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import uvloop

from dsh_mesh.node import load_config, parse_args, run_event_loop
from dsh_mesh.node._loop import loop_factory

FLAGS = ["--log-store", "sqlite:log.db", "--cluster-token", "t" * 32, "--plaintext"]


async def _loop_type() -> type[asyncio.AbstractEventLoop]:
    return type(asyncio.get_running_loop())


def test_a_node_runs_the_standard_loop_unless_told_to_run_uvloop() -> None:
    assert not issubclass(run_event_loop(_loop_type()), uvloop.Loop)
    assert run_event_loop(_loop_type(), choice="uvloop") is uvloop.Loop
    assert loop_factory("asyncio") is None


def test_the_event_loop_setting_comes_from_flags_and_environment_and_is_checked() -> None:
    assert load_config(parse_args(FLAGS), {}).event_loop == "asyncio"
    assert load_config(parse_args(FLAGS), {"DSH_EVENT_LOOP": "uvloop"}).event_loop == "uvloop"
    flagged = parse_args([*FLAGS, "--event-loop", "uvloop"])
    assert load_config(flagged, {"DSH_EVENT_LOOP": "asyncio"}).event_loop == "uvloop"
    with pytest.raises(ValueError, match="event_loop must be one of asyncio, uvloop"):
        load_config(parse_args([*FLAGS, "--event-loop", "trio"]), {})
    with pytest.raises(ValueError, match="event_loop must be one of"):
        loop_factory("trio")


def test_a_node_given_an_unknown_loop_says_so_in_one_line_and_exits_2() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "dsh_mesh.node", *FLAGS, "--event-loop", "trio"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "dsh-mesh-node: error: event_loop must be one of asyncio, uvloop"
    ]
