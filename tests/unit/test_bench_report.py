"""The benchmark report's schema (bench/_report.py): what ``make bench`` writes to
bench/report.json is machine-checked, so the checker itself is checked here."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench._common import QUICK, Bed
from bench._report import FIGURE_KEYS, Figure, Report, check_report, format_table
from bench.storage import Stored, record_storage
from bench.suite import TARGETS


def a_report() -> Report:
    """A complete report: one figure per target of the suite, and two measurements."""
    report = Report()
    report.add(
        Figure("warm cross-node send p50", 1.9, "ms", 1.4, 1.3, "lower"),
        Figure("throughput at 64 in flight", 3000.0, "calls/s", 4000.0, 0.7, "higher"),
        Figure("p50 at 100k sessions / at 100", 1.75, "ms", 1.7, 1.1, "lower"),
        Figure("cold resume", 3.0, "ms", 0.8, 5.0, "lower"),
        Figure("SIGKILL until live elsewhere", 2.1, "s", None, 2.5, "lower"),
        Figure("idle resident agent memory", 7.5, "KiB", None, 20.0, "lower"),
        Figure("drain of 50050 idle resident agents", 2.0, "s", None, 10.0, "lower"),
        Figure("cold resume per tool result at 10000 / at 1000", 0.11, "ms", 0.1, 1.2, "lower"),
        Figure("ListAgents of a tree at 100k / at 100", 6.0, "ms", 5.8, 1.1, "lower"),
        Figure("WatchSession first event at 100k / at 100", 5.0, "ms", 4.9, 1.1, "lower"),
        Figure("GetSession first page at 100k / at 100", 2.1, "ms", 2.0, 1.1, "lower"),
        Figure("ListAgents first page at 100k / at 100", 9.0, "ms", 8.5, 1.1, "lower"),
        Figure("ListAgents of a namespace at 100k / at 100", 9.0, "ms", 8.5, 1.1, "lower"),
        Figure("ListAgents of roots at 100k / at 100", 9.0, "ms", 8.5, 1.1, "lower"),
        Figure("Python tool p50 / bare", 2.0, "ms", 1.8, 1.2, "lower"),
        Figure("Python tool throughput / bare", 850.0, "calls/s", 560.0, 0.833, "higher"),
        Figure("MCP tool p50 / bare", 1.5, "ms", 1.4, 1.2, "lower"),
        Figure("MCP tool throughput / bare", 945.0, "calls/s", 993.0, 0.833, "higher"),
        Figure("server processes for 1000 agents", 1.0, "processes", None, 1.0, "lower"),
        Figure("web view: a 100-agent tree rendered", 700.0, "ms", None, 2000.0, "lower"),
        Figure("web view: the root list among 100001 roots", 400.0, "ms", None, 1000.0, "lower"),
        Figure("web view: an event reaches the page, p99", 80.0, "ms", None, 1000.0, "lower"),
        Figure("root fail-over, median", 1.7, "s", None, 2.5, "lower"),
        Figure("root fail-over, slowest", 2.2, "s", None, 3.5, "lower"),
        Figure("peers: warm p50 / the faster peer's", 1.2, "ms", 0.6, 1.0, "lower"),
        Figure("peers: messages/s / the faster peer's", 1800.0, "calls/s", 4000.0, 1.0, "higher"),
        Figure("peers: messages/s / bare echo", 1800.0, "calls/s", 4000.0, 0.7, "higher"),
        Figure("peers: CPU per message / AutoGen's", 0.6, "ms", 0.4, 1.0, "lower"),
        Figure("peers: create an agent on another node", 5.0, "ms", None, 2.0, "lower"),
        Figure("1000 streaming: steps/s / bare httpx", 150.0, "steps/s", 600.0, 0.8, "higher"),
        Figure("1000 streaming: CPU per token / bare httpx", 140.0, "us", 30.0, 1.25, "lower"),
        Figure("10000 streaming: steps/s / bare httpx", 140.0, "steps/s", 250.0, 0.8, "higher"),
        Figure("10000 streaming: CPU per token / bare httpx", 150.0, "us", 90.0, 1.25, "lower"),
        Figure("bare echo p50", 0.6, "ms"),
        Figure("warm same-node send throughput", 5000.0, "calls/s", 4000.0, better="higher"),
    )
    report.curve("latency", "p50", "calls in flight", "ms", log_x=True).add("echo", 1, 0.6)
    report.run["sizes"] = "quick"
    return report


def a_document() -> dict[str, Any]:
    return a_report().as_json()


def test_a_complete_report_conforms_and_lists_only_targets_as_figures() -> None:
    document = a_document()
    # Six of the first suite, the memory section's drain, long-resume's one, control's six,
    # tools' five, the view's three, the crash section's root fail-over two, the peers' five,
    # streaming's four (steps a second and CPU per token, at 1,000 and 10,000 agents).
    assert TARGETS == 33
    assert check_report(document, expected_targets=TARGETS) == []
    assert len(document["figures"]) == TARGETS
    assert all(sorted(f) == sorted(FIGURE_KEYS) for f in document["figures"])
    assert all(f["target"] is not None for f in document["figures"])
    assert [m["target"] for m in document["measurements"]] == [None, None]
    assert document["curves"]["latency"]["series"]["echo"] == [[1, 0.6]]


def test_the_report_round_trips_through_json(tmp_path: Path) -> None:
    path = tmp_path / "out" / "report.json"
    written = a_report().write(path)
    assert json.loads(path.read_text()) == written
    assert check_report(json.loads(path.read_text()), expected_targets=TARGETS) == []


@pytest.mark.parametrize(
    ("figure", "ratio", "met"),
    [
        (Figure("a", 1.7, "ms", 1.4, 1.3, "lower"), 1.7 / 1.4, True),
        (Figure("b", 1.9, "ms", 1.4, 1.3, "lower"), 1.9 / 1.4, False),
        (Figure("c", 1.4, "ms", 1.4, 1.3, "lower"), 1.0, True),
        (Figure("d", 3000, "calls/s", 4000, 0.7, "higher"), 0.75, True),
        (Figure("e", 2000, "calls/s", 4000, 0.7, "higher"), 0.5, False),
        (Figure("f", 2.6, "s", None, 2.5, "lower"), None, False),
        (Figure("g", 7.5, "KiB", None, 20.0, "lower"), None, True),
        (Figure("h", 7.5, "KiB"), None, None),
    ],
)
def test_a_target_is_a_ratio_to_the_floor_or_an_absolute_value(
    figure: Figure, ratio: float | None, met: bool | None
) -> None:
    assert figure.ratio == (None if ratio is None else pytest.approx(ratio))
    assert figure.met is met


def broken(edit: Any) -> list[str]:
    document = copy.deepcopy(a_document())
    edit(document)
    return check_report(document, expected_targets=TARGETS)


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda d: d["figures"].pop(), f"has {TARGETS - 1} entries"),
        (lambda d: d["figures"][0].pop("floor"), "has keys"),
        (lambda d: d["figures"][0].update(extra=1), "has keys"),
        (lambda d: d["figures"][0].update(better="smaller"), "better"),
        (lambda d: d["figures"][0].update(target=None), "target"),
        (lambda d: d["figures"][0].update(target=-1), "target"),
        (lambda d: d["figures"][0].update(floor=0), "floor"),
        (lambda d: d["figures"][0].update(floor="1.4"), "floor"),
        (lambda d: d["figures"][0].update(value=math.nan), "value"),
        (lambda d: d["figures"][0].update(value=True), "value"),
        (lambda d: d["measurements"][0].update(value=-0.5, name="memory"), "-0.5 ('memory')"),
        (lambda d: d["figures"][0].update(unit=""), "unit"),
        (lambda d: d["figures"][0].update(name=""), "name"),
        (lambda d: d["figures"][1].update(name=d["figures"][0]["name"]), "duplicate"),
        (lambda d: d["measurements"][0].update(target=1.0), "target is not null"),
        (lambda d: d.update(figures={}), "not a list"),
        (lambda d: d["curves"]["latency"]["series"].update(echo=[[1]]), "[x, y]"),
    ],
)
def test_every_way_of_breaking_the_schema_is_reported(edit: Any, complaint: str) -> None:
    problems = broken(edit)
    assert any(complaint in problem for problem in problems), problems


def test_not_an_object_is_not_a_report() -> None:
    assert check_report([]) == ["the report is not a JSON object"]


def test_an_invalid_report_is_never_written(tmp_path: Path) -> None:
    report = a_report()
    report.add(Figure("broken", math.inf, "ms", None, 1.0))
    with pytest.raises(ValueError, match="breaks its schema"):
        report.write(tmp_path / "report.json")
    assert not (tmp_path / "report.json").exists()


def test_the_table_shows_each_ratio_target_and_verdict() -> None:
    report = a_report()
    lines = format_table(report.figures).splitlines()
    assert lines[0].split() == ["figure", "value", "unit", "floor", "ratio", "target", "met?"]
    by_name = {line.split("  ")[0].strip(): line for line in lines[2:]}
    assert by_name["warm cross-node send p50"].endswith("1.36x  <= 1.30x    NO")
    assert by_name["throughput at 64 in flight"].endswith("0.75x  >= 0.70x   yes")
    assert by_name["SIGKILL until live elsewhere"].rstrip().endswith("<= 2.50   yes")
    assert by_name["bare echo p50"].rstrip().endswith("ms")


def test_storage_per_step_cancels_what_a_session_costs_once(tmp_path: Path) -> None:
    bed = Bed(etcd_endpoint="-", etcd_pid=None, sizes=QUICK, report=Report(), log_root=tmp_path)
    added = {  # what a session costs once, plus 5,000 bytes per step in the log store
        10: Stored(log=20_000 + 10 * 5_000, etcd=2_900, revision=3, etcd_in_use=4096),
        1000: Stored(log=20_000 + 1000 * 5_000, etcd=2_898, revision=3, etcd_in_use=4096),
    }
    record_storage(bed, "SQLite", 10, 1000, added)
    figures = {f.name: f.value for f in bed.report.figures}
    step = "storage (SQLite log store), a step with a 4 KB tool output"
    assert figures[f"{step}: log-store bytes per step"] == pytest.approx(5_000)
    assert figures[f"{step}: etcd bytes per step (keys + values)"] == 0  # -2 / 990: none
    assert figures[f"{step}: etcd writes per step"] == 0
    agent = "storage (SQLite log store), one agent after 1000 steps"
    assert figures[f"{agent}: log-store bytes"] == 20_000 + 1000 * 5_000
    assert check_report(bed.report.as_json()) == []
