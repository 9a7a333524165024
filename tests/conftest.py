"""Options shared by every test directory, and the check of a session store's creation both
the in-memory (unit) and the etcd (integration) store must pass."""

from __future__ import annotations

import pytest

from dsh_mesh.core import (
    Activation,
    ActivationId,
    HumanPromptEntry,
    NodeId,
    Record,
    SessionHeader,
    SessionId,
    SessionKind,
    SessionSpec,
    TaskEntry,
)
from dsh_mesh.runtime import SessionStore


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--etcd-endpoint",
        metavar="HOST:PORT",
        default=None,
        help=(
            "run integration tests against this already running etcd instead of starting one; "
            "tests that crash or restart etcd still start their own private server"
        ),
    )


VERDICTS = pytest.StashKey[list[str]]()
"""The history checker's summaries of the fault runs in this session, for the final report."""


def pytest_configure(config: pytest.Config) -> None:
    config.stash[VERDICTS] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """End the run with the checker's verdict and figures of every fault run it made."""
    summaries = terminalreporter.config.stash.get(VERDICTS, [])
    if summaries:
        terminalreporter.section("fault runs: the history checker's verdict")
        for summary in summaries:
            terminalreporter.write_line(summary)


def root_header(session: SessionId, preset: str = "p") -> SessionHeader:
    """A root's header, of preset ``preset``."""
    return SessionHeader(
        session_id=session,
        kind=SessionKind.ROOT,
        parent_session=None,
        spec=SessionSpec(preset=preset, model="m"),
    )


async def created_whole(store: SessionStore, session: SessionId) -> None:
    """``create_header`` with entries stores them as seqs 1..n with the header, and the next
    append (by the activation won after it) is seq n + 1."""
    entries = (TaskEntry(content="Do it."), HumanPromptEntry(content="And this."))
    await store.create_header(root_header(session), entries)
    assert await store.get_header(session) == root_header(session)
    assert await store.read(session) == [
        Record(seq=1, entry=entries[0]),
        Record(seq=2, entry=entries[1]),
    ]
    activation = Activation(
        session_id=session, activation_id=ActivationId(f"a-{session}"), node_id=NodeId("n")
    )
    assert await store.try_activate(activation) == activation
    later = HumanPromptEntry(content="Later.")
    record, known = await store.append(session, later, writer=activation.activation_id)
    assert (record.seq, known) == (3, None)
    assert [r.seq for r in await store.read(session)] == [1, 2, 3]
    await store.release(activation)
