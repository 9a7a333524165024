"""``python -m dsh_mesh.demo [--in-process]``."""

from __future__ import annotations

import argparse
import asyncio

from dsh_mesh.demo._cluster import print_run, run_cluster_demo
from dsh_mesh.demo._in_process import main as in_process_main


def main() -> None:
    """Run the cluster demo (default) or the in-process one."""
    parser = argparse.ArgumentParser(prog="python -m dsh_mesh.demo")
    parser.add_argument("--in-process", action="store_true", help="run inside one process")
    if parser.parse_args().in_process:
        in_process_main()
        return
    print_run(asyncio.run(run_cluster_demo()))


main()
