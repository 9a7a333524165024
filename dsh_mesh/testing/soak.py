"""``python -m dsh_mesh.testing.soak``: the long fault run (``make soak``).

Makes a multi-host bed (root only; its log store in PostgreSQL on a host of its own), runs the
mixed workload on it for ``--minutes`` while injecting every kind of fault (the database's among
them: ``db-kill``, ``etcd-cut``, ``db-read-only``; and ``mcp-kill``), nudging no tree, waits up
to lease TTL + sweep interval + a round's margin for every tree to finish its round, then prints
the history checker's verdict and figures (its liveness counts among them, docs/faults.md) and
exits non-zero unless the history checks clean. ``--ttl`` is the nodes' lease TTL (at 2 s an
etcd outage fences every node); ``--seed`` repeats a run's choices.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import secrets
import sys
import time
from pathlib import Path

from dsh_mesh.testing._bed_network import bed_unavailable_reason
from dsh_mesh.testing._faults import FAULT_KINDS
from dsh_mesh.testing._soak import fault_run
from dsh_mesh.testing._testbed import KEEP_ENV, MultiHostBed


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when the history checks clean."""
    parser = argparse.ArgumentParser(prog="python -m dsh_mesh.testing.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (30)")
    parser.add_argument("--seed", type=int, default=None, help="repeat a run's choices")
    parser.add_argument("--ttl", type=float, default=2.0, help="node lease TTL in seconds (2)")
    parser.add_argument(
        "--faults", default=",".join(FAULT_KINDS), help="comma-separated kinds (all)"
    )
    parser.add_argument(
        "--dump", type=Path, default=None, help="pickle what the checker read to this file"
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    kinds = [kind for kind in args.faults.split(",") if kind]
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULT_KINDS)}")
    reason = bed_unavailable_reason()
    if reason is not None:
        print(f"soak: cannot make a multi-host bed here: {reason}", file=sys.stderr)
        return 2
    began = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - began:7.1f} s] {text}", flush=True)

    say(f"soak: seed {seed}, {args.minutes:g} minutes, faults {', '.join(kinds)}")
    with MultiHostBed(tls=True, database=True) as bed:
        report = asyncio.run(
            fault_run(
                bed, seed=seed, seconds=args.minutes * 60, kinds=kinds, ttl=args.ttl, progress=say
            )
        )
        if args.dump is not None:
            args.dump.write_bytes(pickle.dumps(report.evidence))
        if not report.verdict.clean:
            # Keep the nodes' logs and histories and etcd's data for whoever reads the verdict.
            os.environ[KEEP_ENV] = "1"
            (bed.directory / "violations.txt").write_text("\n".join(report.verdict.violations))
            say(f"violations, logs and node histories kept in {bed.directory}")
    print("\n".join(report.log))
    print(report.summary())
    return 0 if report.verdict.clean else 1


if __name__ == "__main__":
    sys.exit(main())
