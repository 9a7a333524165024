"""A small run of the benchmark suite (``python -m bench --quick``: every section, tiny sizes, on
its own etcd, PostgreSQL and node processes): it completes, its report conforms to the
machine-checked schema with one figure per target, and the plot is written. Nothing here asserts
a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench._report import check_report
from bench.suite import SECTIONS, TARGETS

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)  # the run's own limit (below) decides
def test_a_quick_run_writes_a_conforming_report_and_a_plot(tmp_path: Path) -> None:
    report_path, plot_path = tmp_path / "report.json", tmp_path / "report.png"
    command = [sys.executable, "-m", "bench", "--quick"]
    run = subprocess.run(
        [*command, "--out", str(report_path), "--plot", str(plot_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # about a minute alone; more on a machine busy with other tests
        check=False,
    )
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"

    document = json.loads(report_path.read_text())
    assert check_report(document, expected_targets=TARGETS) == []
    assert document["run"]["errors"] == []
    assert set(document["run"]["section_seconds"]) == {"floors", *SECTIONS}
    assert document["measurements"], "the context figures are missing"
    curves = {"latency", "throughput", "nodes", "sessions", "memory"}
    curves |= {"long-resume", "long-resume-memory", "storage", "control"}
    assert curves <= set(document["curves"])
    for figure in document["figures"]:
        assert figure["name"] in run.stdout  # the table printed every target

    png = plot_path.read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
