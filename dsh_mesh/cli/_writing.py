"""``watch --deltas``: the step being written, shown as its text arrives (ADR 0053).

One line per step being written: its head (``<event_seq> <session> - writing``), then each
delta's text appended to it as it comes, newlines shown as ``\\n`` so that it stays one line.
Any other event (the stored step above all) ends that line first and prints as ``watch`` always
does: the stored step is the record, the line before it only what was seen on the way.
"""

from __future__ import annotations

from collections.abc import Callable

from dsh_mesh.cli._render import paint
from dsh_mesh.client import SessionEvent

LABEL = "writing"


class WritingLine:
    """The open line of a step being written, written through ``put`` (text without a
    newline, flushed). Not thread-safe; one per watch."""

    def __init__(self, put: Callable[[str], None], *, color: bool = False) -> None:
        self._put = put
        self._color = color
        self._open: str | None = None
        """The session whose step the open line shows; None when no line is open."""

    def delta(self, event: SessionEvent) -> None:
        """Append ``event``'s delta to its session's line (opening one, ending another's)."""
        delta = event.delta
        assert delta is not None
        if self._open != event.session_id:
            self.end()
            session = paint(event.session_id, "dim", color=self._color)
            self._put(f"{event.event_seq:>7}  {session}  {'-':<5} {LABEL.ljust(9)} ")
            self._open = event.session_id
        if delta.dropped:
            self._put(paint(f"[{delta.dropped} lost]", "red", color=self._color))
        self._put(delta.text.replace("\r\n", "\n").replace("\n", "\\n"))

    def end(self) -> None:
        """End the open line, if any (before any other event is printed)."""
        if self._open is not None:
            self._put("\n")
            self._open = None
