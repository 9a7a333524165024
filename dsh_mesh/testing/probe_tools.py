"""Probe tools: Python tools with a side effect a test can count, for the tests and fault runs
that prove the replay promise (a ``replay="safe"`` call runs again under the same key after a
host death; an unsafe one never runs twice). Name the module in a presets file::

    [tools]
    modules = ["dsh_mesh.testing.probe_tools"]

Each execution appends one line to the file named by ``DSH_PROBE_LOG`` (in the node's
environment) *before* it does anything else: ``<tool> <session> <idempotency key> <pid>``. One
``write`` of one short line to a file opened for appending is atomic, so node processes on one
machine (or on bed hosts sharing its filesystem) can share the file. When ``DSH_PROBE_GATE``
names a file, an execution then waits until that file exists (its cancellation signal ends the
wait), so a test can kill the host while the call runs. :func:`read_probe_log` reads it back.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from dsh_mesh.tools import ToolContext, tool

LOG_ENV = "DSH_PROBE_LOG"
GATE_ENV = "DSH_PROBE_GATE"


@dataclass(frozen=True, kw_only=True)
class ProbeRun:
    """One execution of a probe tool, as its log line says."""

    tool: str
    session: str
    key: str
    pid: int


def _probe(name: str, context: ToolContext) -> str:
    log = os.environ.get(LOG_ENV)
    if log:
        line = f"{name} {context.session_id} {context.idempotency_key} {os.getpid()}\n"
        descriptor = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)
    gate = os.environ.get(GATE_ENV)
    if gate:
        while not Path(gate).exists() and not context.signal.aborted:
            time.sleep(0.02)
            context.progress()
    return f"{name} ran ({context.idempotency_key})"


@tool(replay="unsafe")
def probe_unsafe(context: ToolContext) -> str:
    """Do something that must happen at most once (a probe: it records each execution)."""
    return _probe("probe_unsafe", context)


@tool(replay="safe")
def probe_safe(context: ToolContext) -> str:
    """Do something that is safe to repeat under one key (a probe: it records each
    execution)."""
    return _probe("probe_safe", context)


@tool(timeout_s=3600)
def pause(seconds: float) -> str:
    """Block the calling thread for ``seconds`` (a probe of blocking tools: it cannot be
    stopped, as a blocking call in a worker thread cannot)."""
    time.sleep(seconds)
    return f"paused {seconds:g} s"


GARBLED_TEXT = "caf\udce9 \ud800 end"
"""What :func:`garbled` returns: "café" in Latin-1 decoded with ``surrogateescape`` (as a file
name that is not UTF-8 comes back from ``os.listdir``), and a lone high surrogate."""


@tool(replay="safe")
def garbled() -> str:
    """List a directory whose file names are not valid UTF-8 (a probe: its text is not valid
    Unicode)."""
    return GARBLED_TEXT


def read_probe_log(path: Path) -> list[ProbeRun]:
    """Every execution ``path`` records, in order (none when it does not exist)."""
    if not path.exists():
        return []
    runs = []
    for line in path.read_text().splitlines():
        tool_name, session, key, pid = line.split(" ")
        runs.append(ProbeRun(tool=tool_name, session=session, key=key, pid=int(pid)))
    return runs
