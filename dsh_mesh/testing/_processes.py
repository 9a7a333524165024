"""What the test servers (etcd, PostgreSQL) share about their child processes: fresh loopback
ports, reaping a child, and the tail of its log for an error message."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOG_TAIL_LINES = 40


def free_ports(count: int) -> tuple[int, ...]:
    """Ports the kernel just handed out for port 0. Holding all sockets open until every port
    is chosen keeps them distinct; another process may still take one before the server binds
    it, which the server's start notices and retries."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            ports.append(int(sock.getsockname()[1]))
        return tuple(ports)


def kill_and_reap(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` unless it has exited, and wait for it: nothing is left unreaped."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    process.wait()


def log_tail(path: Path) -> str:
    """The last lines of ``path``, introduced for an error message ("" when unreadable)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    tail = "\n".join(lines[-LOG_TAIL_LINES:])
    return f"\n--- last lines of {path}:\n{tail}"
