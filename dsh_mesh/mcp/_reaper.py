"""Launches a stdio MCP server so that it dies with its node, whatever kills the node.

``python -m dsh_mesh.mcp._reaper <node pid> -- <command> [args...]``: the MCP SDK starts this in
a session (and process group) of its own; it asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``), starts the server in its group, and on SIGTERM, or when the node's pid is
no longer its parent, kills the whole group (the server and anything it started). It exits with
the server's status when the server exits first. The server inherits its stdin and stdout: the
MCP stream is never copied through this process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

_PR_SET_PDEATHSIG = 1


def _kill_group(*_: object) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)  # this process too


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m dsh_mesh.mcp._reaper NODE_PID -- COMMAND [ARGS...]", file=sys.stderr
        )
        return 2
    node = int(argv[0])
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # lead a group of our own, if the launcher did not make one
    signal.signal(signal.SIGTERM, _kill_group)
    signal.signal(signal.SIGHUP, _kill_group)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != node:
        _kill_group()  # the node died before the request above took effect
    server = subprocess.Popen(argv[2:])

    def watch() -> None:  # belt and braces: the death signal is per thread of the parent
        while server.poll() is None:
            if os.getppid() != node:
                _kill_group()
            threading.Event().wait(0.5)

    threading.Thread(target=watch, daemon=True).start()
    return server.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
