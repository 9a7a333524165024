"""The suite's own rules (issue 32): pytest names the slowest tests of every run, and helpers
shared between test modules live in a ``conftest.py`` or in ``dsh_mesh.testing``, never in
another test module."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_run_prints_its_25_slowest_tests() -> None:
    # `make test` runs plain `python -m pytest`: the addopts of pyproject.toml are its options.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--durations=25" in config["addopts"]
    assert "-m pytest\n" in (ROOT / "Makefile").read_text()
