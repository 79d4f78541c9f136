"""What the studies' figures share: matplotlib on demand, the report's colours and its symlog floor.

matplotlib is the optional ``plot`` extra: nothing here imports it at import
time. A :class:`kvfast.sweep.study.Figure`'s ``draw`` calls :func:`pyplot`
when the report draws; :func:`matplotlib_available` says whether it can.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import numpy as np
import pandas as pd

SYMLOG_FLOOR = 1e-8  # deviations below this are drawn on a linear scale, so that exactly 0.0 is visible
COLORS = {"random": "#1f77b4", "trained": "#d62728", "one-step": "#ff7f0e", "every-step": "#2ca02c"}


def matplotlib_available() -> bool:
    """Whether the ``plot`` extra (matplotlib) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed) with the report's font sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "figure.dpi": 100})
    return plt


def ratio_bars(
    labels: Sequence[str],
    clean: pd.Series,
    bugged: pd.Series,
    *,
    bugged_label: str,
    line: float,
    floor: float,
    ylabel: str,
    title: str,
    figsize: tuple[float, float],
    line_label: str | None = None,
):
    """A control-mode verdict per configuration (``labels``), on a log scale: the largest ``clean`` ratio
    (green) beside the smallest ``bugged`` one (red, ``bugged_label``), and a dashed line at ``line`` that
    clean runs stay under and bugs rise above. A missing ratio (``NaN``) and one below ``floor`` are drawn
    at ``floor``."""
    fig, ax = pyplot().subplots(figsize=figsize)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, clean.fillna(0.0).clip(lower=floor), 0.4, label="largest clean ratio", color="#2ca02c")
    ax.bar(x + 0.2, bugged.fillna(0.0).clip(lower=floor), 0.4, label=bugged_label, color="#d62728")
    ax.axhline(line, color="black", lw=0.8, ls="--", label=line_label)
    ax.set_yscale("log")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
