"""What the test servers (etcd, PostgreSQL) share about their child processes: fresh loopback
ports, reaping a child, and the tail of its log for an error message; and what runs below a
process (read from ``/proc``), for tests and benches that check a process tree."""

from __future__ import annotations

import contextlib
import os
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


def process_tree(pid: int) -> dict[int, tuple[int, str]]:
    """Every process below ``pid`` (children, theirs, ...), as pid -> (parent pid, command
    line with spaces for its NULs). One reading of ``/proc``; a process that ends meanwhile
    is left out."""
    processes: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        processes[int(entry)] = (parent, command)
    below: dict[int, tuple[int, str]] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, command) in processes.items():
            if ppid == parent and child not in below:
                below[child] = (ppid, command)
                frontier.append(child)
    return below
