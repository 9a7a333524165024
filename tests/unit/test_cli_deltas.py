"""``dsh-mesh watch --deltas`` (ADR 0053): the text of a step being written is appended to one
line as it arrives, and the stored step follows on its own line; ``--json`` prints one object
per delta."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncGenerator
from typing import Any, cast

from dsh_mesh.cli import parse_args
from dsh_mesh.cli._commands import Console, _watch
from dsh_mesh.client import (
    AssistantStep,
    MeshClient,
    SessionEvent,
    TextDelta,
    TranscriptEntry,
)
from dsh_mesh.core import SessionId, TurnId, Usage

ROOT = SessionId("s-1")
CHILD = SessionId("s-2")
TURN = TurnId("t-1")


def delta(text: str, *, session: SessionId = ROOT, dropped: int = 0) -> SessionEvent:
    return SessionEvent(
        session_id=session,
        event_seq=16,
        delta=TextDelta(turn_id=TURN, text=text, dropped=dropped),
    )


def step(text: str, *, session: SessionId = ROOT) -> SessionEvent:
    body = AssistantStep(text=text, tool_calls=(), usage=Usage())
    entry = TranscriptEntry(seq=4, recorded_at=None, body=body)
    return SessionEvent(session_id=session, event_seq=17, entry=entry)


class Watching:
    """A client whose watch yields ``events``, and that keeps what it was asked."""

    def __init__(self, events: list[SessionEvent]) -> None:
        self.events = events
        self.asked: dict[str, Any] = {}

    async def watch(self, session: str, **options: Any) -> AsyncGenerator[SessionEvent, None]:
        self.asked = {"session": session, **options}
        for event in self.events:
            yield event


async def watched(argv: list[str], events: list[SessionEvent]) -> tuple[str, Watching]:
    out = io.StringIO()
    client = Watching(events)
    code = await _watch(
        cast(MeshClient, client), parse_args(argv), Console(out=out, err=io.StringIO())
    )
    assert code == 0
    return out.getvalue(), client


def test_deltas_is_opt_in() -> None:
    assert parse_args(["watch", "s-1", "--deltas"]).deltas is True
    assert parse_args(["watch", "s-1"]).deltas is False


async def test_deltas_are_appended_to_one_line_then_the_stored_step_follows() -> None:
    events = [
        delta("The answer"),
        delta(" is\n"),
        delta("42.", dropped=2),
        step("The answer is\n42."),
    ]
    out, client = await watched(["watch", "s-1", "--deltas"], events)
    assert client.asked["deltas"] is True
    writing, stored = out.splitlines()
    assert writing.split()[:4] == ["16", ROOT, "-", "writing"]
    assert writing.endswith("The answer is\\n[2 lost]42.")
    assert stored.split()[:4] == ["17", ROOT, "#4", "step"]


async def test_another_sessions_delta_starts_its_own_line() -> None:
    events = [delta("a"), delta("b", session=CHILD), delta("c"), step("ac")]
    out, _ = await watched(["watch", "s-1", "--tree", "--deltas"], events)
    lines = out.splitlines()
    assert [line.split()[1] for line in lines] == [ROOT, CHILD, ROOT, ROOT]
    assert [line.rsplit(" ", 1)[-1] for line in lines[:3]] == ["a", "b", "c"]


async def test_json_prints_one_object_per_delta() -> None:
    out, _ = await watched(["watch", "s-1", "--deltas", "--json"], [delta("x"), step("x")])
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["delta"] == {"turn_id": TURN, "text": "x", "dropped": 0}
    assert first["entry"] is None
    assert second["delta"] is None and second["entry"]["body"]["type"] == "assistant_step"
