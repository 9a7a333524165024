"""The ``dsh-mesh`` command as a test runs it: to the end (:meth:`Cli.run`) or in the background
(:meth:`Cli.start`), its output read line by line with deadlines (:class:`Lines`)."""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

COMMAND = [sys.executable, "-m", "dsh_mesh.cli"]


class Lines:
    """The lines of a child's stream, read by a thread, so a test can wait with a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._stream = stream
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        """After the child exited: let the reader reach EOF, then close the pipe."""
        self._thread.join(timeout=10)
        self._stream.close()

    def rest(self, *, within: float = 10.0) -> list[str]:
        """Every line still to come, until EOF (or ``within`` seconds): what a child that
        failed said."""
        rest: list[str] = []
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)
                break
            rest.append(line)
        return rest

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, *, within: float) -> str:
        """The next line; ``AssertionError`` (with what came so far) at EOF or after
        ``within`` seconds."""
        try:
            line = self._queue.get(timeout=within)
        except queue.Empty:
            raise AssertionError(f"no line within {within}s; so far: {self.seen}") from None
        if line is None:
            self._queue.put(None)
            raise AssertionError(f"the stream ended; so far: {self.seen}")
        self.seen.append(line)
        return line

    def until(self, predicate: Callable[[str], bool], *, within: float) -> list[str]:
        """Lines up to and including the first that satisfies ``predicate``."""
        deadline = time.monotonic() + within
        start = len(self.seen)
        while not predicate(self.next(within=max(deadline - time.monotonic(), 0.01))):
            pass
        return self.seen[start:]


@dataclass
class Cli:
    """The ``dsh-mesh`` command, run with ``env`` in ``cwd``; ``command`` is how it is run
    (default: this Python's ``-m dsh_mesh.cli``; an installed ``dsh-mesh`` script, say)."""

    env: dict[str, str]
    cwd: Path
    command: tuple[str, ...] = tuple(COMMAND)

    def run(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.command, *args],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    @contextlib.contextmanager
    def start(self, *args: str, own_group: bool = False) -> Iterator[Child]:
        """The command running in the background; always ended on exit: SIGTERM (so ``up``
        stops what it started), SIGKILL if stuck; its pipes are drained and closed. With
        ``own_group`` it leads a process group of its own, as a terminal's foreground job
        does, so a test can signal that whole group the way Ctrl-C does."""
        process = subprocess.Popen(
            [*self.command, *args],
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=_interruptible,
            process_group=0 if own_group else None,
        )
        assert process.stdout is not None and process.stderr is not None
        child = Child(process=process, out=Lines(process.stdout), err=Lines(process.stderr))
        try:
            yield child
        except AssertionError as failed:
            # A child that ended early said why on its stderr: keep it with the failure.
            failed.add_note(
                "its stderr: " + "\n".join([*child.err.seen, *child.err.rest(within=5)])
            )
            raise
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            child.out.close()
            child.err.close()


def _interruptible() -> None:
    """In the child, before it runs: SIGINT does what it does at a terminal. A suite started as
    a background job (``make test &`` in a script) inherits SIGINT ignored, and Python then never
    turns it into KeyboardInterrupt: a Ctrl-C sent to the command would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Child:
    """A command running in the background (:meth:`Cli.start`), with its two streams."""

    process: subprocess.Popen[str]
    out: Lines
    err: Lines
