"""The calibration's table and plot, from its results dict (no model needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcmas.experiments import common
from kvcmas.experiments.cells import COST_HEADER, cost_cells, fmt, pair, reuse_cells
from kvcmas.experiments.plots import line_plot

COLUMNS = (
    "| run | rho | recompute | reused of matched | error / FullShared | KV err | KL first "
    f"| final agree | {COST_HEADER} | anchors (max/pool) | pool KiB |"
)


def row(label: str, m: dict[str, Any]) -> str:
    """One table row; pair cells are all hops / hops 2+."""
    anchors = f"{m['anchors']} ({m['pool_anchors_max']})" if "anchors" in m else "-"
    pool = f"{m['pool_bytes'] / 1024:.0f}" if "pool_bytes" in m else "-"
    return (
        f"| {label} | {reuse_cells(m)}"
        f" | {fmt(m.get('reuse_share_of_matched'), '.2f')} | {fmt(m.get('error_ratio'))}"
        f" | {pair(m, 'kv_error_{}_mean', '.4f')} | {pair(m, 'first_token_kl_{}_mean', '.4f')}"
        f" | {fmt(m.get('final_agreement'), '.2f')} | {cost_cells(m)}"
        f" | {anchors} | {pool} |"
    )


def markdown(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        f"# KVCMAS calibration: online runs, {s['workflow']} workflow, {s['requests']} "
        f"({s['split']} split, {s['limit']} requests)",
        "",
        *common.setup_lines(s),
        "",
        "Each grid point is a real online run of KVCMAS (its own pools, use counts, eviction and "
        "chained sources), every hop checked against a dense fp32 NonShared prefill. Cells with "
        "a slash are all hops / hops 2+. rho: shared tokens served from a source; recompute: "
        "computed (token, layer) pairs of shared tokens over dense; reused of matched: share "
        "of the segments the gate scored that it reused; error / FullShared: mean over reused "
        "segments of their KV error over FullShared's on the same segment of its run (below 1: "
        "the correction helps). Ratios (/NS) are to NonShared; anchors: all pools (fullest).",
        "",
        COLUMNS,
        "|" + "---|" * (COLUMNS.count("|") - 1),
    ]
    for name, m in results["baselines"].items():
        lines.append(row(name, m))
    for m in results["grid"]:
        lines.append(row(f"T={m['temperature']} r={m['rank'] or 'full'} tau={m['tau']}", m))
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> list[str]:
    """Error ratio against rho (hops 2+), one line per (T, r) along its taus."""
    s = results["setup"]
    series: dict[str, tuple[list[float], list[float | None]]] = {}
    for m in sorted(results["grid"], key=lambda m: m["tau"]):
        if m["rho_later"] is None:
            continue
        xs, ys = series.setdefault(f"T={m['temperature']}, r={m['rank'] or 'full'}", ([], []))
        xs.append(m["rho_later"])
        ys.append(m["error_ratio"])
    title = f"{s['model']} {s['dtype']}, {s['workflow']}, {s['limit']} {s['requests']} requests"
    line_plot(
        out / "calibration.png",
        series,
        "rho, hops 2+ (shared tokens served from a source; tau sweep)",
        "KV error / FullShared's (reused segments)",
        title,
        hline=1.0,
    )
    return ["calibration.png"]
