"""Options shared by every test directory."""

from __future__ import annotations

import pytest


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
