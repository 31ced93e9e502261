"""The table and plots of the low-rank analysis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcmas.experiments import common
from kvcmas.experiments.lowrank.plan import LONG_SEGMENT
from kvcmas.experiments.lowrank.spectra import CURVE_RANKS, ENERGY
from kvcmas.experiments.plots import line_plot


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Low-rank structure of KV deviations and base caches",
        "",
        *common.setup_lines(results["setup"]),
        "",
        "Per layer (1..L-1) and instance, canonical frame. Effective rank: singular values "
        "holding 90% of the squared spectrum. Averages run over instances and layers. A matrix "
        "of n tokens has rank at most min(n, D).",
        "",
        "| family | instances | tokens (mean, min-max) | eff. rank mean | median | p90 | max "
        "| share < 32 | eff. rank / min(n, D) | energy @8 | energy @32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["summaries"].values():
        if s is None:
            continue
        lines.append(
            f"| {s['family']} | {s['instances']} | {s['tokens_mean']:.0f} "
            f"({s['tokens_min']}-{s['tokens_max']}) | {s['effective_rank_mean']:.1f} "
            f"| {s['effective_rank_median']:.0f} | {s['effective_rank_p90']:.0f} "
            f"| {s['effective_rank_max']} | {s['share_below_32']:.2f} "
            f"| {s['rank_fraction_mean']:.2f} | {s['energy_at_8']:.3f} "
            f"| {s['energy_at_32']:.3f} |"
        )
    lines += ["", "## The paper's claims", "", "| claim | measured | verdict |", "|---|---|---|"]
    for name, c in results["claims"].items():
        measured = "; ".join(
            f"{k.replace('measured_', '')}: {format_pair(v)}"
            for k, v in c.items()
            if k.startswith("measured")
        )
        verdict = "holds" if c["holds"] else "does not hold"
        if c.get("holds_on_long_segments") is not None:
            verdict += (
                f" (on segments >= {LONG_SEGMENT} tokens: "
                f"{'holds' if c['holds_on_long_segments'] else 'does not hold'})"
            )
        lines.append(f"| {name.replace('_', ' ')} | {measured} | **{verdict}** |")
    return "\n".join(lines) + "\n"


def format_pair(v: list[float | None] | None) -> str:
    return "-" if v is None or None in v else " / ".join(f"{x:.2f}" for x in v)


PLOTTED = ("delta K (all)", "delta V (all)", "base K (all)", "base V (all)", "PF K", "PF V")


def plot(results: dict[str, Any], out: Path) -> None:
    s = results["setup"]
    title = f"{s['model']} {s['dtype']}, {s['workflow']} ({s['requests']})"
    sums = {k: results["summaries"].get(k) for k in PLOTTED}
    line_plot(
        out / "energy_curves.png",
        {k: (range(1, CURVE_RANKS + 1), v["energy_curve"]) for k, v in sums.items() if v},
        "rank k",
        "share of squared singular-value energy in top k",
        title,
        hline=ENERGY,
    )
    line_plot(
        out / "effective_rank_per_layer.png",
        {
            k: (range(1, len(v["rank_per_layer"]) + 1), v["rank_per_layer"])
            for k, v in sums.items()
            if v
        },
        "layer",
        "effective rank (90% energy), mean over instances",
        title,
    )
