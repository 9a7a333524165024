"""A stdio MCP server for the fault runs (issue 30): tools that answer slowly, hugely, or not at
all because the server exits in the middle of the call.

- ``echo(text)``: ``text`` back after a pause of 50 to 450 ms (a window in which the fault
  driver's kill lands mid-call);
- ``huge(size)``: ``large`` answers 512 KiB of text (past any output limit), ``oversized`` 6 MiB
  (past the bound on one message too, which the node cuts while it reads);
- ``die()``: the server exits (status 3) in the middle of the call.

While a call runs, the server holds a marker file ``busy.<pid>.<n>`` in the directory named by
``DSH_FAULT_MCP_DIR`` (none when it is unset), so the fault driver can find a server with a call
in flight and kill it then (:func:`servers_mid_call`). The nodes launch it as a script
(``python <this file>``), not with ``-m``: a server started again after each death then loads
only the MCP SDK, not the whole testing package. Nothing here imports the SDK until the server
runs, so the fault driver reads :func:`servers_mid_call` cheaply.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

BUSY_ENV = "DSH_FAULT_MCP_DIR"
"""Names the directory of the busy markers (in the nodes' environment, which the server gets)."""
SCRIPT = Path(__file__)
"""What the nodes run (``python <SCRIPT>``); a process is a fault server if its command names it."""
DIE_STATUS = 3
HUGE_SIZES = {"large": 512, "oversized": 6 * 1024}
"""KiB a ``huge`` call answers, by its ``size``."""


def build(busy_dir: Path | None) -> MCPServer:
    """The server, marking its calls in flight in ``busy_dir`` (None: not at all)."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("dsh-faults")
    calls = itertools.count()

    def mark() -> Path | None:
        if busy_dir is None:
            return None
        marker = busy_dir / f"busy.{os.getpid()}.{next(calls)}"
        marker.touch()
        return marker

    def unmark(marker: Path | None) -> None:
        if marker is not None:
            marker.unlink(missing_ok=True)

    @server.tool()
    async def echo(text: str) -> str:
        """Say ``text`` back, after a moment."""
        marker = mark()
        try:
            await asyncio.sleep(random.uniform(0.05, 0.45))
            return text
        finally:
            unmark(marker)

    @server.tool()
    async def huge(size: str) -> str:
        """Answer a lot of text: ``large`` (512 KiB) or ``oversized`` (6 MiB)."""
        marker = mark()
        try:
            return "m" * (HUGE_SIZES.get(size, 1) * 1024)
        finally:
            unmark(marker)

    @server.tool()
    async def die() -> str:
        """Exit the server's process in the middle of the call."""
        unmark(mark())  # an exit runs no finally: leave no marker of a dead process behind
        sys.stdout.flush()
        os._exit(DIE_STATUS)

    return server


def servers_mid_call(busy_dir: Path) -> list[int]:
    """The pids of fault servers with a call in flight now, by their markers in ``busy_dir``.
    A marker whose process is gone, or is no fault server (its pid taken by another process),
    is removed and not counted, so a caller never signals a process that is not one."""
    pids: list[int] = []
    for marker in sorted(busy_dir.glob("busy.*")):
        try:
            pid = int(marker.name.split(".")[1])
        except (IndexError, ValueError):
            continue
        if not is_fault_server(pid):
            marker.unlink(missing_ok=True)
        elif pid not in pids:
            pids.append(pid)
    return pids


def is_fault_server(pid: int) -> bool:
    """Whether process ``pid`` runs this server (its command line names :data:`SCRIPT`)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return os.fsencode(SCRIPT) in command or os.fsencode(SCRIPT.name) in command


def forget(busy_dir: Path, pid: int) -> None:
    """Remove the markers of ``pid`` (a server that was killed leaves them behind)."""
    for marker in busy_dir.glob(f"busy.{pid}.*"):
        marker.unlink(missing_ok=True)


def main() -> int:
    """Serve over stdio until stdin closes."""
    directory = os.environ.get(BUSY_ENV)
    build(Path(directory) if directory else None).run("stdio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
