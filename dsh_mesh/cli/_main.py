"""The ``dsh-mesh`` entry point: parse, find the cluster, run the command, turn failures into
one ``error: ...`` line and an exit status."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from dsh_mesh.cli._certs import run_certs
from dsh_mesh.cli._commands import Console, UsageError, run_command
from dsh_mesh.cli._config import (
    ConfigError,
    Connection,
    read_state,
    read_toml,
    resolve_connection,
    resolve_preset,
    state_home,
)
from dsh_mesh.cli._parser import parse_args
from dsh_mesh.cli._render import error_line
from dsh_mesh.core import MeshError

EXIT_OK = 0
EXIT_MESH_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def use_color(choice: str, stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether to colour ``stream``: ``always`` / ``never``, or for ``auto`` a terminal when
    ``NO_COLOR`` is not set (https://no-color.org) and ``TERM`` is not ``dumb``."""
    if choice == "always":
        return True
    if choice == "never":
        return False
    if environ.get("NO_COLOR") or environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dsh-mesh`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status:
    0 done, 1 the mesh refused or failed, 2 bad usage or no cluster found, 130 interrupted."""
    args = parse_args(argv)
    environ = os.environ
    console = Console(
        out=sys.stdout, err=sys.stderr, color=use_color(args.color, sys.stdout, environ)
    )
    try:
        if args.command == "up":
            return _up(args, console, environ)
        if args.command == "certs":
            return run_certs(args, console)
        state = read_state(state_home(args.home, environ))
        if args.command == "prune":
            from dsh_mesh.cli._prune import run_prune  # the node's config and log stores

            return asyncio.run(run_prune(args, state, console, environ))
        if args.command == "spawn":
            args.preset = resolve_preset(args.preset, environ, state)
        toml = read_toml(Path(args.config)) if args.config else None
        connection: Connection | None
        try:
            connection = resolve_connection(
                node_flag=args.node,
                token_flag=args.cluster_token,
                environ=environ,
                state=state,
                toml=toml,
                tls_flags=(args.tls_cert, args.tls_key, args.tls_ca),
            )
        except ConfigError:
            if args.command != "status" or state is not None:
                raise
            connection = None
        return asyncio.run(run_command(args, connection, state, console))
    except (ConfigError, UsageError) as error:
        console.note(f"error: {error}")
        return EXIT_USAGE
    except MeshError as error:
        console.note(error_line(error))
        return EXIT_MESH_ERROR
    except KeyboardInterrupt:
        # A watch is meant to be stopped this way; anything else was cut short.
        return EXIT_OK if args.command == "watch" else EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`dsh-mesh watch ... | head`): not an error. Point stdout at
        # devnull so the interpreter's final flush does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _up(args: argparse.Namespace, console: Console, environ: Mapping[str, str]) -> int:
    # Only `up` loads the node and the local cluster's code: every other command starts in
    # half the time without them (a watch or an interrupt is often typed in a hurry).
    from dsh_mesh.cli._up import StartFailed, run_up

    try:
        return run_up(args, console, environ)
    except StartFailed as error:
        console.note(f"error: cannot start the cluster: {error}")
        return EXIT_MESH_ERROR
