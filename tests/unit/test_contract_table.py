"""docs/contract.md names, for every contract rule, the tests that state it, and is kept true:
every listed test exists and carries ``@pytest.mark.contract(rule)``, every marked test is listed,
and every rule 1-11 has at least one test."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = range(1, 12)


def marked_tests() -> dict[int, set[str]]:
    """rule -> test ids (``path::name``) found by reading the test sources."""
    found: dict[int, set[str]] = defaultdict(set)
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for decorator in node.decorator_list:
                if (
                    isinstance(decorator, ast.Call)
                    and ast.unparse(decorator.func) == "pytest.mark.contract"
                    and isinstance(decorator.args[0], ast.Constant)
                ):
                    rule = decorator.args[0].value
                    assert isinstance(rule, int)
                    found[rule].add(f"{path.relative_to(ROOT).as_posix()}::{node.name}")
    return found


def listed_tests() -> dict[int, set[str]]:
    listed: dict[int, set[str]] = defaultdict(set)
    for line in (ROOT / "docs" / "contract.md").read_text().splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|[^|]*\|(.*)\|\s*$", line)
        if row:
            listed[int(row.group(1))].update(re.findall(r"`([^`]+::[^`]+)`", row.group(2)))
    return listed


def test_every_rule_has_a_test() -> None:
    marked = marked_tests()
    assert [rule for rule in RULES if not marked.get(rule)] == []


def test_contract_table_matches_the_marked_tests() -> None:
    marked, listed = marked_tests(), listed_tests()
    for rule in RULES:
        assert listed.get(rule, set()) == marked.get(rule, set()), f"rule {rule}"


def render_table() -> str:
    """The table rows, for regenerating docs/contract.md by hand."""
    marked = marked_tests()
    return "\n".join(
        f"| {rule} | | {'<br>'.join(f'`{t}`' for t in sorted(marked.get(rule, ())))} |"
        for rule in RULES
    )
