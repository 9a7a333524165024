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
