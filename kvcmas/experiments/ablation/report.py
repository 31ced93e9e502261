"""The ablation's tables and plots, from its results dict (no model needed). Parts (a)-(c)
share the calibration's columns: every online run shows rho and recompute beside its error,
KL, TTFT, end-to-end latency and compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcmas.experiments import common
from kvcmas.experiments.ablation.plan import DEFAULT_POOL, DEFAULT_RANK
from kvcmas.experiments.calibrate.report import COLUMNS, row
from kvcmas.experiments.cells import fmt
from kvcmas.experiments.plots import line_panels, line_plot
from kvcmas.methods.kvcmas import DEFAULT_TAU

RULE = "|" + "---|" * (COLUMNS.count("|") - 1)


def online_table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [f"## {title}", "", COLUMNS, RULE, *(row(name, m) for name, m in rows), ""]


def markdown(results: dict[str, Any]) -> str:
    lines = ["# KVCMAS ablations", "", *common.setup_lines(results["setup"]), ""]
    if "baselines" in results:
        lines += [
            "Parts (a)-(c) are online runs of KVCMAS on the calibration stream (its own pools, "
            "use counts, eviction and chained sources), every hop checked against fp32 "
            "NonShared; one knob moves at a time from r=32, V=10, tau=0.995. Cells with a slash "
            "are all hops / hops 2+; error / FullShared is over the reused segments.",
            "",
        ]
        lines += online_table("Baselines", list(results["baselines"].items()))
    if "rank_pool" in results:
        rows = [(f"r={m['rank'] or 'full'} V={m['pool_size']}", m) for m in results["rank_pool"]]
        lines += online_table("(a) Rank r (bases and deltas) and pool size V", rows)
    if "tau" in results:
        rows = [(f"tau {m['tau']}", m) for m in results["tau"]]
        lines += online_table("(b) Gate threshold tau", rows)
    if "chain" in results:
        rows = [(f"chain {m['chain']}", m) for m in results["chain"]]
        lines += online_table(f"(c) Chained vs non-chained (tau {DEFAULT_TAU})", rows)
    if "scale" in results:
        lines += scale_table(results["scale"])
    return "\n".join(lines) + "\n"


def scale_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "## (d) Agents and rounds: nonshared vs kvcmas",
        "",
        "Outputs forced to the token budget (end-of-turn ignored); figures over the measured "
        "requests after the warm-up ones. Agents: roster-style chains (each agent reads the "
        "question and every earlier output); rounds: three debaters, each round reading all "
        "answers of the round before. Speedups are NonShared's time over the method's.",
        "",
        "| axis | value | agent calls | method | TTFT s (2+) | speedup | latency s | speedup "
        "| compute s | rho (2+) | recompute (2+) | prompt tokens (2+) | peak state MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['axis']} | {r['value']} | {r['agent_calls']} | {r['method']} "
            f"| {fmt(r['ttft_later_mean_s'])} | {fmt(r['speedup'], '.2f')} "
            f"| {fmt(r['latency_request_mean_s'])} | {fmt(r['latency_speedup'], '.2f')} "
            f"| {fmt(r['compute_s'], '.1f')} | {fmt(r['rho_later'], '.2f')} "
            f"| {fmt(r['recompute_later'], '.2f')} | {fmt(r['prompt_tokens_later_mean'], '.0f')} "
            f"| {r['peak_state_bytes'] / 2**20:.1f} |"
        )
    return [*out, ""]


def plot(results: dict[str, Any], out: Path) -> list[str]:
    s = results["setup"]
    title = f"{s['model']} {s['dtype']}, {s['workflow']}"
    written = []
    if "rank_pool" in results:
        grid = results["rank_pool"]
        by_rank = [m for m in grid if m["pool_size"] == DEFAULT_POOL]
        by_pool = [m for m in grid if m["rank"] == DEFAULT_RANK]
        for key, fname, ylabel, logy in (
            ("error_ratio", "rank_pool_error.png", "KV error / FullShared's (reused)", False),
            ("pool_bytes", "rank_pool_bytes.png", "pool bytes (end of stream)", True),
        ):
            series = {
                f"rank r (V={DEFAULT_POOL}; full drawn at 256)": (
                    [m["rank"] or 256 for m in by_rank],
                    [m.get(key) for m in by_rank],
                ),
                f"pool size V (r={DEFAULT_RANK})": (
                    [m["pool_size"] for m in by_pool],
                    [m.get(key) for m in by_pool],
                ),
            }
            line_plot(out / fname, series, "r or V", ylabel, title, logx=True, logy=logy)
            written.append(fname)
    if "tau" in results:
        rows = results["tau"]
        taus = [m["tau"] for m in rows]
        series = {
            name: (taus, [m.get(key) for m in rows])
            for name, key in (
                ("rho, hops 2+", "rho_later"),
                ("recompute, hops 2+", "recompute_later"),
                ("KV error / FullShared's (reused)", "error_ratio"),
                ("final agreement with NonShared", "final_agreement"),
            )
        }
        line_plot(out / "tau.png", series, "tau", "value", title)
        written.append("tau.png")
    for axis in ("agents", "rounds"):
        rows = [r for r in results.get("scale", []) if r["axis"] == axis]
        if not rows:
            continue
        panels = []
        for key, ylabel in (
            ("ttft_later_mean_s", "mean TTFT of hops 2+ (s)"),
            ("latency_request_mean_s", "request latency (s)"),
            ("compute_s", "compute (CPU s)"),
        ):
            series = {}
            for m in ("nonshared", "kvcmas"):
                mine = [r for r in rows if r["method"] == m]
                series[m] = ([r["value"] for r in mine], [r[key] for r in mine])
            panels.append((ylabel, series))
        fname = f"scale_{axis}.png"
        line_panels(out / fname, panels, axis, title)  # TTFT never without its costs
        written.append(fname)
    return written
