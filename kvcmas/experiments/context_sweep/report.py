"""The table and plots of a context sweep: per size and method, TTFT beside end-to-end latency
and compute seconds (with their ratios to NonShared), rho beside the recompute fraction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcmas.experiments import common
from kvcmas.experiments.cells import COST_HEADER, cost_cells, fmt, reuse_cells
from kvcmas.experiments.plots import line_panels

COLUMNS = (
    f"| N | method | {COST_HEADER} | rho | recompute | prompt tokens 2+ | output tokens "
    "| peak state MiB | method state MiB | peak RSS MiB |"
)


def _intro(results: dict[str, Any]) -> list[str]:
    s = results["setup"]
    isolated = " (each run in its own child process)." if results["isolated_processes"] else "."
    lines = [
        f"Each agent reads the shared document of N tokens and every earlier agent's output; "
        f"outputs are exactly {s['output_tokens']} tokens (end-of-turn ignored). Cells with a "
        f"slash give all hops / hops 2-{s['agents']}, over {s['measured_requests']} measured "
        f"requests; methods with state ran {s['warmup_requests']} warm-up requests on other "
        "documents first. Latency is the request end to end (mean), compute the process CPU "
        "seconds of the measured requests; ratios are to NonShared at the same N (below 1 is "
        "faster). rho: shared tokens served from a source; recompute: computed (token, layer) "
        "pairs of shared tokens over dense. Peak state is the largest KV + held sources + "
        "method state of any hop; peak RSS is the process high-water mark of the run" + isolated,
    ]
    for req, used in results["capped"].items():
        lines.append(
            f"Size {req} exceeds the model's {results['context_limit']}-token context once the "
            f"prompt, earlier outputs and new tokens ({results['non_doc_tokens_max']}) are "
            f"added: capped to {used}."
        )
    return lines


def _row(r: dict[str, Any]) -> str:
    m = r["summary"]
    if m is None:
        why = r["error"].strip().splitlines()[-1] if r.get("error") else "no result"
        return f"| {r['size']} | {r['method']} | failed: {why} |" + " |" * 10
    return (
        f"| {r['size']} | {r['method']} | {cost_cells(m)} | {reuse_cells(m)}"
        f" | {fmt(m['prompt_tokens_later_mean'], '.0f')} | {fmt(m['output_tokens_mean'], '.0f')}"
        f" | {m['peak_state_bytes'] / 2**20:.1f} | {m['method_state_bytes'] / 2**20:.1f}"
        f" | {m['peak_rss_bytes'] / 2**20:.0f} |"
    )


def markdown(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        f"# Context sweep: {s['agents']}-agent controlled trace",
        "",
        *common.setup_lines(s),
        "",
        *_intro(results),
        "",
        COLUMNS,
        "|---" * COLUMNS.count(" | ") + "|---|",
    ]
    lines += [_row(r) for r in results["runs"]]
    return "\n".join(lines) + "\n"


def _series(results: dict[str, Any], key: str) -> dict[str, tuple[list, list]]:
    """Per method: sizes and the summary's ``key`` at each (None where the run failed)."""
    out: dict[str, tuple[list, list]] = {}
    for r in results["runs"]:
        xs, ys = out.setdefault(r["method"], ([], []))
        xs.append(r["size"])
        ys.append(r["summary"].get(key) if r["summary"] else None)
    return out


def plot(results: dict[str, Any], out: Path) -> None:
    """``cost_vs_size.png`` (seconds) and ``ratio_vs_size.png`` (to NonShared): TTFT of hops
    2+, request latency and compute side by side in each."""
    s = results["setup"]
    title = f"{s['model']} {s['dtype']}, {s['agents']}-agent trace, {s['machine']}"
    xlabel = "shared document tokens"
    cost = [
        ("mean TTFT of hops 2+ (s)", _series(results, "ttft_later_mean_s")),
        ("request latency, end to end (s)", _series(results, "latency_request_mean_s")),
        ("compute: process CPU s of the run", _series(results, "compute_s")),
    ]
    line_panels(out / "cost_vs_size.png", cost, xlabel, title, logx=True, logy=True)
    ratios = [
        ("TTFT of hops 2+ / NonShared", _series(results, "ttft_later_ratio")),
        ("latency / NonShared", _series(results, "latency_ratio")),
        ("compute / NonShared", _series(results, "compute_ratio")),
    ]
    line_panels(out / "ratio_vs_size.png", ratios, xlabel, title, logx=True, hline=1.0)
