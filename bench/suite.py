"""The benchmark suite: ``python -m bench`` (``make bench``), ``python -m bench --quick``.

One real etcd for the whole run. First the floors (a bare grpc.aio echo between two processes,
one etcd transaction), then each section on node processes of its own cluster, every figure next
to the floor measured in the same run. Writes ``bench/report.json`` (schema:
``bench/_report.py``) and ``bench/report.png``, and prints a table of every figure with its ratio
to its floor and, for the targets, whether it is met. Exits 1 when a section failed (the report
is still written, without its figures); ``--check`` also exits 2 when a target is missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from bench._common import FULL, QUICK, Bed, Sizes
from bench._report import Report, format_table
from bench.context import measure_context
from bench.control import measure_control
from bench.floors import measure_floors
from bench.long_resume import measure_long_resume
from bench.memory import measure_memory
from bench.namespaces import measure_namespace_check
from bench.peers import measure_peers
from bench.provider import measure_provider
from bench.resume import measure_clean_resume, measure_crash_resume
from bench.storage import measure_storage
from bench.streaming import measure_streaming
from bench.tools import measure_tools
from bench.view import measure_view
from bench.warm import (
    measure_cross_node,
    measure_node_scaling,
    measure_postgres_hot_path,
    measure_registered_sessions,
    measure_same_node,
)
from dsh_mesh.node import run_event_loop
from dsh_mesh.testing import EtcdServer

HERE = Path(__file__).resolve().parent
TARGETS = 33
"""Figures with a target in a complete report (one per target of the issue): six for the warm
sends, the resumes and idle memory, one for the drain of the idle agents (``memory``, ADR
0046), one for long transcripts' resume (``long-resume``), six
for the control plane's reads at 100,000 resident agents (``control``: a tree's listing and
feed, the root's first page, the first page of every session, of one namespace and of roots
with their count; issue 34), five for the tools (``tools``), three for the web view's render
time, event latency and root list among 100,000 roots (``view``) and two for a root's
fail-over where a client waits, median and slowest (``crash``, ADR 0043), and five beside the
in-memory peers, AutoGen's gRPC runtime and Ray (``peers``, issue 35: warm p50 and throughput
against the faster peer, throughput against the bare echo, CPU per message against AutoGen's,
creating an agent on another node), and four for agents streaming from a model server at scale
(``streaming``, issue 35: steps a second and CPU per token against bare httpx, at 1,000 and
10,000 agents)."""

SECTIONS: dict[str, Callable[[Bed], Awaitable[None]]] = {
    "same-node": measure_same_node,
    "cross-node": measure_cross_node,
    "peers": measure_peers,
    "streaming": measure_streaming,
    "postgres": measure_postgres_hot_path,
    "nodes": measure_node_scaling,
    "cold-resume": measure_clean_resume,
    "long-resume": measure_long_resume,
    "crash": measure_crash_resume,
    "storage": measure_storage,
    "provider": measure_provider,
    "tools": measure_tools,
    "namespaces": measure_namespace_check,
    "context": measure_context,
    "view": measure_view,
    # The ones that fill etcd run last, so they cannot slow the others down.
    "sessions": measure_registered_sessions,
    "control": measure_control,
    "memory": measure_memory,
}


async def run(sizes: Sizes, sections: list[str]) -> tuple[Report, list[str]]:
    """Measure the floors, then ``sections`` in order; returns the report and the errors."""
    report = Report()
    errors: list[str] = []
    timings: dict[str, float] = {}
    report.run.update(
        sizes=sizes.name,
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        machine=platform.machine(),
        section_seconds=timings,
        settings=dataclasses.asdict(sizes),
    )
    log_root = Path(tempfile.mkdtemp(prefix="dsh-bench-"))
    with EtcdServer() as etcd_server:
        bed = Bed(
            etcd_endpoint=etcd_server.endpoint,
            etcd_pid=etcd_server.pid,
            sizes=sizes,
            report=report,
            log_root=log_root,
        )
        try:
            started = time.perf_counter()
            _progress("floors")
            await measure_floors(bed)
            timings["floors"] = round(time.perf_counter() - started, 1)
            for name in sections:
                _progress(name)
                started = time.perf_counter()
                try:
                    await SECTIONS[name](bed)
                except Exception as error:
                    errors.append(f"{name}: {type(error).__name__}: {error}")
                    traceback.print_exc()
                timings[name] = round(time.perf_counter() - started, 1)
        finally:
            bed.close()  # the PostgreSQL server, if a section started one
    report.run["errors"] = errors
    if errors:
        errors.append(f"node logs kept in {log_root}")
    else:
        shutil.rmtree(log_root, ignore_errors=True)
    return report, errors


def _progress(section: str) -> None:
    print(f"bench: {section} ...", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the suite; write the report and the plot; print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke run)")
    parser.add_argument("--out", type=Path, default=HERE / "report.json", help="report path")
    parser.add_argument("--plot", type=Path, default=HERE / "report.png", help="PNG path")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SECTIONS),
        help="run only this section (repeatable; the floors always run)",
    )
    parser.add_argument("--check", action="store_true", help="exit 2 when a target is missed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    sizes = QUICK if args.quick else FULL
    sections = [name for name in SECTIONS if args.only is None or name in args.only]
    started = time.perf_counter()
    # On the loop a node process runs on: node-a, the sender's node, runs in this process.
    report, errors = run_event_loop(run(sizes, sections))
    report.run["total_seconds"] = round(time.perf_counter() - started, 1)
    report.write(args.out)
    from bench._plot import write_png  # matplotlib is slow to import: only once needed

    write_png(
        report.curves,
        args.plot,
        title=f"dsh-mesh bench ({sizes.name}, {report.run['started_at']}, "
        f"{report.run['cpus']} CPUs)",
    )
    print("Targets (floors measured in this run):")
    print(format_table(report.targets))
    print("\nEvery other figure:")
    print(format_table([f for f in report.figures if f.target is None]))
    met = sum(bool(f.met) for f in report.targets)
    print(
        f"\n{met} of {len(report.targets)} targets met; "
        f"{report.run['total_seconds']} s; wrote {args.out} and {args.plot}"
    )
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors:
        return 1
    if args.check and (met < len(report.targets) or len(report.targets) < TARGETS):
        return 2
    return 0
