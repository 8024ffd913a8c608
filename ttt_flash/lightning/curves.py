"""Validation curves of runs, read from their CSV logs (Lightning's ``metrics.csv``), plotted
into one PNG: a method against its baseline, e.g. the long-context recipes of
docs/long-context.md.

Reading needs nothing beyond the standard library; plotting needs matplotlib (the ``plot``
extra: ``pip install -e ".[plot]"``), and says so when it is missing.

Command line (one PNG; each ``--series`` is ``LABEL=PATH/metrics.csv:METRIC``)::

    python -m ttt_flash.lightning.curves curves.png \\
        --series "TTT (inner_steps 1)=runs/ttt/metrics.csv:val/acc_post" \\
        --series "baseline (inner_steps 0)=runs/ttt_base/metrics.csv:val/acc_post" \\
        --chance 0.015625 --title "TTT-E2E MQAR, 32,768 tokens"
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

__all__ = ["Series", "read_curve", "last_value", "plot_curves", "PLOT_EXTRA_MESSAGE"]

#: What :func:`plot_curves` says when matplotlib is missing.
PLOT_EXTRA_MESSAGE = (
    "plotting needs matplotlib, which is not installed: pip install -e \".[plot]\" in the ttt-flash "
    "folder, or pip install matplotlib (the curves themselves are in the runs' metrics.csv files)"
)


def read_curve(path, metric: str) -> Tuple[List[int], List[float]]:
    """``(steps, values)`` of the rows of a CSV log where ``metric`` has a value, in file order.

    Args:
        path: a Lightning ``metrics.csv`` (columns ``step`` and the logged names).
        metric: a column, e.g. ``"val/acc_post"``.

    Raises:
        FileNotFoundError: no such file.
        KeyError: the file has no column ``metric`` (the message lists the columns).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no CSV log at {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames or []
        if metric not in columns:
            raise KeyError(f"{path} has no column {metric!r}; its columns are {columns}")
        steps: List[int] = []
        values: List[float] = []
        for row in reader:
            cell = row.get(metric)
            if cell in (None, ""):
                continue
            steps.append(int(float(row.get("step") or 0)))
            values.append(float(cell))
    return steps, values


def last_value(path, metric: str) -> Optional[float]:
    """The last logged value of ``metric`` in a CSV log (None if it was never logged)."""
    _, values = read_curve(path, metric)
    return values[-1] if values else None


@dataclass
class Series:
    """One curve: ``label`` for the legend, the CSV log, the metric, a matplotlib line style."""

    label: str
    path: str
    metric: str
    style: str = "-"

    @classmethod
    def parse(cls, spec: str) -> "Series":
        """``"LABEL=PATH:METRIC"`` (the last ``:`` splits path and metric)."""
        label, eq, rest = spec.partition("=")
        path, colon, metric = rest.rpartition(":")
        if not (eq and colon and label and path and metric):
            raise ValueError(f"a series is 'LABEL=PATH/metrics.csv:METRIC', got {spec!r}")
        return cls(label, path, metric)


def plot_curves(out, series: Sequence[Series], *, title: str = "", ylabel: str = "",
                chance: Optional[float] = None, logy: bool = False) -> Path:
    """Plot each series' curve (step on x) into the PNG ``out``; a dotted line at ``chance``.

    Returns the path written. Raises ``RuntimeError`` (:data:`PLOT_EXTRA_MESSAGE`) without
    matplotlib, and the errors of :func:`read_curve` for a missing file or metric.
    """
    curves = [(s, *read_curve(s.path, s.metric)) for s in series]  # read (and check) first
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(PLOT_EXTRA_MESSAGE) from None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for s, steps, values in curves:
        ax.plot(steps, values, s.style, marker="o", markersize=3, label=s.label)
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle=":", label=f"chance {chance:.3g}")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel or ", ".join(sorted({s.metric for s in series})))
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ttt_flash.lightning.curves",
                                description="validation curves of runs (metrics.csv) into one PNG")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--series", action="append", required=True, metavar="LABEL=PATH:METRIC",
                   help="a curve: legend label, a metrics.csv, a column (repeat for each curve)")
    p.add_argument("--title", default="")
    p.add_argument("--ylabel", default="")
    p.add_argument("--chance", type=float, default=None, help="draw a dotted line at this value")
    p.add_argument("--logy", action="store_true", help="logarithmic y axis")
    a = p.parse_args(argv)
    try:
        series = [Series.parse(s) for s in a.series]
        plot_curves(a.out, series, title=a.title, ylabel=a.ylabel, chance=a.chance, logy=a.logy)
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
