"""Draw the Grafana dashboard's panels as one PNG, from the data its own queries returned in a test run.

    TESSERA_DASHBOARD_DATA=/tmp/dashboard.json python -m pytest tests/integration/test_dashboard.py
    python docs/render_dashboard.py /tmp/dashboard.json docs/telemetry-dashboard.png

The first command runs every panel's PromQL against a real Prometheus scraping a simulated agent (see the test)
and keeps each query's range; this script only draws that data, a panel per query set, the way Grafana would show
it (time series as lines, stats as numbers, bar gauges as bars, tables as rows). It needs matplotlib, which is
not a dependency of the agent: ``pip install matplotlib``.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

COLUMNS = 3
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a"]


def scaled(value: float, unit: str) -> tuple[float, str]:
    if unit == "bytes":
        return value / (1 << 30), "GiB"
    if unit == "percentunit":
        return value * 100, "%"
    if unit == "percent":
        return value, "%"
    if unit == "h":
        return value * 60, "GPU-min"  # the run lasts seconds: minutes read better than hours
    return value, ""


def draw(ax: Any, panel: dict[str, Any]) -> None:
    ax.set_facecolor(PANEL)
    ax.set_title(panel["title"], color=TEXT, fontsize=10, loc="left")
    for spine in ax.spines.values():
        spine.set_color(GRID)
    ax.tick_params(colors=TEXT, labelsize=7)
    ax.set_axisbelow(True)
    series, unit, kind = panel["series"], panel["unit"], panel["type"]
    if kind == "timeseries":
        start = min(point[0] for s in series for point in s["points"])
        for n, entry in enumerate(series):
            values = [scaled(v, unit)[0] for _, v in entry["points"]]
            times = [t - start for t, _ in entry["points"]]
            ax.plot(times, values, color=COLORS[n % len(COLORS)], linewidth=1.5, label=entry["legend"].strip())
        ax.set_xlabel("seconds", color=TEXT, fontsize=7)
        ax.set_ylabel(scaled(0, unit)[1], color=TEXT, fontsize=7)
        ax.grid(color=GRID, linewidth=0.5)
        ax.legend(fontsize=6, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, loc="upper left")
    elif kind == "bargauge":
        labels = [textwrap.shorten(s["legend"], 34) for s in series]
        values = [scaled(s["points"][-1][1], unit)[0] for s in series]
        ax.barh(labels, values, color=[COLORS[n % len(COLORS)] for n in range(len(values))])
        ax.invert_yaxis()
        ax.set_xlabel(scaled(0, unit)[1], color=TEXT, fontsize=7)
        ax.grid(axis="x", color=GRID, linewidth=0.5)
    elif kind == "stat":
        ax.set_xticks([])
        ax.set_yticks([])
        for n, entry in enumerate(series):
            value, suffix = scaled(entry["points"][-1][1], unit)
            y = 0.75 - n * 0.45 / max(1, len(series) - 1) if len(series) > 1 else 0.5
            ax.text(0.5, y, f"{value:g}{suffix}", color=COLORS[n % len(COLORS)], fontsize=22, ha="center", va="center")
            ax.text(0.5, y - 0.17, entry["legend"], color=TEXT, fontsize=7, ha="center", va="center")
    elif kind == "table":
        ax.set_xticks([])
        ax.set_yticks([])
        header = ("namespace/pod", "resource", "GPU", "profile")
        rows = [header] + [
            (f"{s['labels'].get('namespace')}/{s['labels'].get('pod')}", s["labels"].get("resource", ""),
             s["labels"].get("gpu", ""), s["labels"].get("GPU_I_PROFILE", "") or "-")
            for s in series
        ]  # fmt: skip
        for n, row in enumerate(rows):
            for column, (x, cell) in enumerate(zip((0.02, 0.36, 0.78, 0.88), row, strict=True)):
                weight = "bold" if n == 0 else "normal"
                ax.text(x, 0.9 - n * 0.12, cell, color=TEXT if column else COLORS[0], fontsize=7, weight=weight)


def main(data_path: str, png_path: str) -> None:
    panels = json.loads(Path(data_path).read_text())["panels"]
    rows = -(-len(panels) // COLUMNS)
    figure, axes = plt.subplots(rows, COLUMNS, figsize=(6 * COLUMNS, 3.2 * rows), facecolor=BACKGROUND)
    for ax, panel in zip(axes.flat, panels, strict=False):
        draw(ax, panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle("Tessera: GPUs, partitions and pods (deploy/grafana/tessera-dashboard.json)", color=TEXT)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(png_path, dpi=72, facecolor=BACKGROUND)


if __name__ == "__main__":
    main(*sys.argv[1:3])
