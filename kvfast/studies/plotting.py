"""What the studies' figures share: matplotlib on demand, the report's colours and its symlog floor.

matplotlib is the optional ``plot`` extra: nothing here imports it at import
time. A :class:`kvfast.studies.base.Figure`'s ``draw`` calls :func:`pyplot`
when the report draws; :func:`matplotlib_available` says whether it can.
"""

from __future__ import annotations

import importlib.util

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
