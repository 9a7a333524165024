"""The report's curves as one PNG (matplotlib, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # (after the backend is chosen)

from bench._report import Curve


def write_png(curves: Mapping[str, Curve], path: Path, *, title: str) -> None:
    """Draw every curve in its own panel of one figure and save it to ``path``."""
    panels = list(curves.values())
    columns = 3 if len(panels) > 4 else 2
    rows = max(1, math.ceil(len(panels) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.2 * rows), squeeze=False)
    for index, ax in enumerate(axes.flat):
        if index >= len(panels):
            ax.set_visible(False)
            continue
        curve = panels[index]
        for label, points in curve.series.items():
            xs = [x for x, _ in points]
            ys = [y for _, y in points]
            if label.startswith(("floor", "target")):
                ax.plot(xs, ys, "--", marker=".", label=label)
            else:
                ax.plot(xs, ys, "-", marker="o", label=label)
        if curve.log_x:
            ax.set_xscale("log")
            ticks = sorted({x for points in curve.series.values() for x, _ in points})
            ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        else:
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(curve.title, fontsize=10)
        ax.set_xlabel(curve.x)
        ax.set_ylabel(curve.y)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if curve.series:
            ax.legend(fontsize=7)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
