"""The benchmark report: its figures, its machine-checked JSON form and the printed table.

``bench/report.json``::

    {
      "figures": [                      # one entry per target of the suite
        {"name": str, "value": number, "unit": str,
         "floor": number | null,        # the floor measured in the same run, in ``unit``;
                                        # null for an absolute figure
         "target": number,              # the ratio value/floor to reach, or the absolute value
                                        # to reach where floor is null
         "better": "lower" | "higher"}
      ],
      "measurements": [...],            # every other figure, same fields, "target": null
      "curves": {key: {"title", "x", "y", "log_x", "series": {label: [[x, y], ...]}}},
      "run": {...}                      # sizes, durations, machine; free-form
    }
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Better = Literal["lower", "higher"]
FIGURE_KEYS = ("name", "value", "unit", "floor", "target", "better")


@dataclass(frozen=True)
class Figure:
    """One measured figure. ``floor`` (same unit) is what it is compared with; ``target`` is
    the ratio ``value / floor`` to reach, or the absolute value when ``floor`` is None; a
    figure without a target is a measurement shown for context."""

    name: str
    value: float
    unit: str
    floor: float | None = None
    target: float | None = None
    better: Better = "lower"

    @property
    def ratio(self) -> float | None:
        """``value / floor``; None for an absolute figure."""
        if self.floor is None or self.floor == 0:
            return None
        return self.value / self.floor

    @property
    def compared(self) -> float:
        """What the target is compared with: the ratio, or the value itself."""
        ratio = self.ratio
        return self.value if ratio is None else ratio

    @property
    def met(self) -> bool | None:
        """Whether the target is reached; None when there is no target."""
        if self.target is None:
            return None
        if self.better == "lower":
            return self.compared <= self.target
        return self.compared >= self.target

    def as_json(self) -> dict[str, Any]:
        """The figure's report entry (exactly :data:`FIGURE_KEYS`)."""
        return {
            "name": self.name,
            "value": _rounded(self.value),
            "unit": self.unit,
            "floor": None if self.floor is None else _rounded(self.floor),
            "target": self.target,
            "better": self.better,
        }


@dataclass
class Curve:
    """One plot panel: series of (x, y) points."""

    title: str
    x: str
    y: str
    log_x: bool = False
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, label: str, x: float, y: float) -> None:
        """Append the point (x, y) to series ``label``."""
        self.series.setdefault(label, []).append((x, y))

    def as_json(self) -> dict[str, Any]:
        """The curve's report entry."""
        return {
            "title": self.title,
            "x": self.x,
            "y": self.y,
            "log_x": self.log_x,
            "series": {
                label: [[x, _rounded(y)] for x, y in points]
                for label, points in self.series.items()
            },
        }


@dataclass
class Report:
    """Everything one run of the suite measured."""

    figures: list[Figure] = field(default_factory=list)
    curves: dict[str, Curve] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)

    def add(self, *figures: Figure) -> None:
        """Record figures (targets and measurements alike)."""
        self.figures.extend(figures)

    def curve(self, key: str, title: str, x: str, y: str, *, log_x: bool = False) -> Curve:
        """The curve ``key``, created on first use."""
        if key not in self.curves:
            self.curves[key] = Curve(title=title, x=x, y=y, log_x=log_x)
        return self.curves[key]

    @property
    def targets(self) -> list[Figure]:
        """The figures that carry a target."""
        return [f for f in self.figures if f.target is not None]

    def as_json(self) -> dict[str, Any]:
        """The report's JSON document."""
        return {
            "figures": [f.as_json() for f in self.targets],
            "measurements": [f.as_json() for f in self.figures if f.target is None],
            "curves": {key: curve.as_json() for key, curve in self.curves.items()},
            "run": self.run,
        }

    def write(self, path: Path) -> dict[str, Any]:
        """Write the JSON document to ``path`` after checking it; returns it."""
        document = self.as_json()
        problems = check_report(document)
        if problems:
            raise ValueError("the report breaks its schema: " + "; ".join(problems))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")
        return document


def check_report(document: Any, *, expected_targets: int | None = None) -> list[str]:
    """Every way ``document`` breaks the report schema (empty when it conforms). With
    ``expected_targets``, ``figures`` must hold exactly that many entries."""
    if not isinstance(document, Mapping):
        return ["the report is not a JSON object"]
    figures = document.get("figures")
    if not isinstance(figures, list):
        return ["'figures' is not a list"]
    problems: list[str] = []
    if expected_targets is not None and len(figures) != expected_targets:
        problems.append(f"'figures' has {len(figures)} entries, not {expected_targets}")
    problems += _check_entries(figures, "figures", with_target=True)
    measurements = document.get("measurements", [])
    if not isinstance(measurements, list):
        problems.append("'measurements' is not a list")
    else:
        problems += _check_entries(measurements, "measurements", with_target=False)
    names = [f.get("name") for f in (*figures, *measurements) if isinstance(f, Mapping)]
    duplicates = sorted({str(n) for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"duplicate figure names: {duplicates}")
    curves = document.get("curves", {})
    if not isinstance(curves, Mapping):
        problems.append("'curves' is not an object")
    else:
        for key, curve in curves.items():
            problems += _check_curve(str(key), curve)
    return problems


def _check_entries(entries: Sequence[Any], where: str, *, with_target: bool) -> list[str]:
    problems: list[str] = []
    for index, entry in enumerate(entries):
        at = f"{where}[{index}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{at} is not an object")
            continue
        if sorted(entry) != sorted(FIGURE_KEYS):
            problems.append(f"{at} has keys {sorted(entry)}, not {sorted(FIGURE_KEYS)}")
            continue
        if not isinstance(entry["name"], str) or not entry["name"]:
            problems.append(f"{at}.name is not a non-empty string")
        if not isinstance(entry["unit"], str) or not entry["unit"]:
            problems.append(f"{at}.unit is not a non-empty string")
        if not _finite(entry["value"]) or entry["value"] < 0:
            problems.append(
                f"{at}.value is not a finite non-negative number: {entry['value']!r}"
                f" ({entry['name']!r})"
            )
        floor = entry["floor"]
        if floor is not None and (not _finite(floor) or floor <= 0):
            problems.append(f"{at}.floor is neither null nor a finite positive number")
        target = entry["target"]
        if with_target and (not _finite(target) or target <= 0):
            problems.append(f"{at}.target is not a finite positive number")
        if not with_target and target is not None:
            problems.append(f"{at}.target is not null")
        if entry["better"] not in ("lower", "higher"):
            problems.append(f"{at}.better is not 'lower' or 'higher'")
    return problems


def _check_curve(key: str, curve: Any) -> list[str]:
    if not isinstance(curve, Mapping) or not isinstance(curve.get("series"), Mapping):
        return [f"curves.{key} has no 'series' object"]
    problems = []
    for label, points in curve["series"].items():
        if not isinstance(points, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(_finite(v) for v in p) for p in points
        ):
            problems.append(f"curves.{key}.series.{label} is not a list of [x, y] numbers")
    return problems


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _rounded(value: float) -> float:
    return float(f"{value:.6g}")


def format_table(figures: Sequence[Figure]) -> str:
    """The figures as a table: name, value, unit, floor, ratio, target, met?"""
    header = ("figure", "value", "unit", "floor", "ratio", "target", "met?")
    rows = [header]
    for f in figures:
        ratio = f.ratio
        target = ""
        if f.target is not None:
            sign = "<=" if f.better == "lower" else ">="
            target = f"{sign} {_number(f.target)}" + ("x" if f.floor is not None else "")
        met = {None: "", True: "yes", False: "NO"}[f.met]
        rows.append(
            (
                f.name,
                _number(f.value),
                f.unit,
                "" if f.floor is None else _number(f.floor),
                "" if ratio is None else f"{ratio:.2f}x",
                target,
                met,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"
