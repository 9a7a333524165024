"""``python -m dsh_mesh.demo [--in-process]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from dsh_mesh.demo._cluster import print_run, run_cluster_demo
from dsh_mesh.demo._in_process import main as in_process_main
from dsh_mesh.demo._real import (
    MODEL_ENV,
    demo_model,
    endpoint_of,
    print_real_run,
    run_real_demo,
)
from dsh_mesh.demo._view import keeping


def main() -> None:
    """Run the cluster demo (default), on a real model when ``DSH_DEMO_MODEL`` names one, or
    the in-process one. Says which model it uses."""
    parser = argparse.ArgumentParser(prog="python -m dsh_mesh.demo")
    parser.add_argument("--in-process", action="store_true", help="run inside one process")
    parser.add_argument(
        "--model",
        default=demo_model(),
        help=f"a model spec such as openai:<model> (default: ${MODEL_ENV}; none: scripted)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the run, keep the cluster up and serve its web view until Ctrl-C",
    )
    args = parser.parse_args()
    if args.in_process:
        print("model      scripted (the in-process demo always is)")
        in_process_main()
        return
    if args.model:
        print(f"model      {args.model}: {endpoint_of(args.model)}")
        print_real_run(asyncio.run(run_real_demo(args.model)))
        return
    print(
        f"model      scripted (no real endpoint configured; set {MODEL_ENV}=openai:<model> and "
        "OPENAI_BASE_URL, e.g. http://127.0.0.1:11434/v1 for Ollama, to run on a real one)"
    )
    if args.keep:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run_cluster_demo(linger=keeping()))
        return
    print_run(asyncio.run(run_cluster_demo()))
    print(
        "\nTo look at a run in the browser: `make demo DEMO_ARGS=--keep` keeps the cluster up"
        " and prints the web view's address (`dsh-mesh ui`, docs/ui.md)."
    )


main()
