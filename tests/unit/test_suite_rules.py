"""The suite's own rules (issue 32): pytest names the slowest tests of every run, and helpers
shared between test modules live in a ``conftest.py`` or in ``dsh_mesh.testing``, never in
another test module."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_run_prints_its_25_slowest_tests() -> None:
    # `make test` runs plain `python -m pytest`: the addopts of pyproject.toml are its options.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--durations=25" in config["addopts"]
    assert "-m pytest\n" in (ROOT / "Makefile").read_text()


def _test_modules() -> list[Path]:
    return sorted((ROOT / "tests").rglob("test_*.py"))


def _imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_no_test_module_imports_another_test_module() -> None:
    # A helper two test modules share lives in a conftest.py, a support module (a name not
    # starting with test_) or dsh_mesh.testing: a test module is only ever collected.
    crossed = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _test_modules()
        for module in _imported_modules(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert crossed == []


HAND_WRITTEN_BASES = {"InMemorySessionStore", "MemoryLogStore"}
LOG_STORE_METHODS = {"raise_fence", "append", "since", "horizon"}


def test_faults_are_injected_through_the_faulty_stores_of_dsh_mesh_testing() -> None:
    # One fault-injecting store per store protocol (dsh_mesh.testing.FaultySessionStore and
    # FaultyLogStore), not a subclass or a wrapper written by hand in each test module.
    hand_written = []
    for path in _test_modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases}
            methods = {f.name for f in node.body if isinstance(f, ast.AsyncFunctionDef)}
            if bases & HAND_WRITTEN_BASES or methods >= LOG_STORE_METHODS:
                hand_written.append(f"{path.relative_to(ROOT)}::{node.name}")
    assert hand_written == []
