"""Line plots of experiment results: one panel, or panels side by side sharing the x axis.

A TTFT panel is drawn beside end-to-end latency and compute panels (:func:`line_panels`), so
that a plot cannot show a prefill saving without the cost moved elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

Series = dict[str, tuple[Sequence[float], Sequence[float | None]]]


def line_panels(
    path: Path,
    panels: list[tuple[str, Series]],
    xlabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
) -> None:
    """One panel per ``(ylabel, series)``, one line per label; ``None`` values are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in series.items():
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pts:
                marker = "o" if len(pts) <= 16 else None
                ax.plot(*zip(*pts, strict=True), marker=marker, label=label)
        if hline is not None:
            ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def line_plot(
    path: Path,
    series: Series,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
) -> None:
    """A single-panel :func:`line_panels`."""
    line_panels(path, [(ylabel, series)], xlabel, title, logx, logy, hline)
