"""Tables and the plot of an accuracy run: accuracy and agreement per method and benchmark,
then reuse and cost (all hops / hops 2+; TTFT beside end-to-end latency and compute seconds),
then fidelity where it was measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcmas.eval.summary import wilson_interval
from kvcmas.experiments.accuracy.merge import label_options
from kvcmas.experiments.accuracy.plan import TITLES
from kvcmas.experiments.cells import COST_HEADER, cost_cells, fmt, pair, reuse_cells
from kvcmas.experiments.common import write_results
from kvcmas.experiments.compare import floor_gemm_phrase


def _budget_text(report: dict[str, Any]) -> str:
    parts = []
    for w in report["setup"]["workflows"].values():
        budgets = list(w["max_new_tokens"].values())
        parts.append(f"{w['name']} (task agents {budgets[:-1]}, decision agent {budgets[-1]})")
    return "; ".join(parts)


def _title(task: str) -> str:
    return TITLES.get(task, task)


def _interval(successes: int, n: int) -> str:
    """``lo-hi``: the 95% Wilson interval of ``successes`` out of ``n`` items."""
    found = wilson_interval(successes, n)
    return "" if found is None else f"{found[0]:.2f}-{found[1]:.2f}"


def _floor_gemm_text(report: dict[str, Any]) -> str:
    floor = report["summary"].get(report["setup"]["noise_floor"], {})
    phrase = floor_gemm_phrase({s.get("gemm_dtype") for s in floor.values()} - {None})
    return f" ({phrase})" if phrase else ""


def markdown_table(report: dict[str, Any]) -> str:
    """Method rows x benchmark columns (accuracy and agreement), then reuse and cost."""
    s = report["setup"]
    tasks = list(s["sizes"])
    sizes = ", ".join(f"{n} {_title(t)}" for t, n in s["sizes"].items())
    noise = (
        f"`{s['noise_floor']}` is NonShared in bf16{_floor_gemm_text(report)} against "
        "NonShared fp32: the noise floor."
        if s["noise_floor"]
        else ""
    )
    lines = [
        "# Task accuracy on the task rosters",
        "",
        f"Model {s['model']} ({s['dtype']}), {s['decoding']} decoding; {sizes} items "
        f"(seeded shuffle of each {s.get('split', 'test')} split); machine {s['machine']}. "
        f"Workflows (new-token budgets): {_budget_text(report)}.",
        "",
        "Accuracy is strict (MMLU: last `Answer: X` line; GSM8K: number after the last "
        "`Answer:`; HumanEval: unit tests pass). Agreement: the same extracted answer as "
        f"{s['reference']} on the same item (where either answer is unreadable: the same "
        f"final text). Brackets: the 95% Wilson interval. {noise}",
        "",
        "| method | " + " | ".join(f"{_title(t)} acc | agree" for t in tasks) + " |",
        "|---|" + "---|---|" * len(tasks),
    ]
    for label, per_task in report["summary"].items():
        cells = []
        for t in tasks:
            m = per_task.get(t)
            if m is None:
                cells.append("- | -")
                continue
            n = m["items"]
            agree = (
                "ref" if label == "nonshared" or m["agreement"] is None
                # a share of n items is an exact count: rounding recovers it
                else f"{m['agreement']:.2f} [{_interval(round(m['agreement'] * n), n)}]"
            )  # fmt: skip
            acc = f"{m['accuracy']:.3f} ({m['correct']}/{n}) [{_interval(m['correct'], n)}]"
            cells.append(f"{acc} | {agree}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    options = label_options(report)
    if options:
        given = "; ".join(
            f"{label} " + ", ".join(f"{k}={v}" for k, v in o.items())
            for label, o in options.items()
        )
        lines += ["", f"Method options set (the rest at their defaults): {given}."]
    elsewhere = {
        label: machine
        for label, machine in s.get("label_machines", {}).items()
        if machine != s["label_machines"]["nonshared"]
    }
    if elsewhere:
        where = "; ".join(f"{label} on {m}" for label, m in elsewhere.items())
        lines += ["", f"Timed on another machine than NonShared (no ratio, marked -): {where}."]
    lines += efficiency_table(report, tasks)
    if s["fidelity"]:
        lines += fidelity_table(report, tasks)
    return "\n".join(lines) + "\n"


def _rows(report: dict[str, Any], tasks: list[str]):
    for label, per_task in report["summary"].items():
        for t in tasks:
            if t in per_task:
                yield label, t, per_task[t]


def efficiency_table(report: dict[str, Any], tasks: list[str]) -> list[str]:
    lines = [
        "",
        "## Reuse, latency, compute and memory",
        "",
        "Cells with a slash give all hops / hops 2+. rho: shared tokens served from a source; "
        "recompute: computed (token, layer) pairs of shared tokens over dense. Latency is the "
        "request end to end (mean), compute the process CPU seconds of the run; ratios are to "
        "NonShared on the same benchmark (below 1 is faster). Peak state: the largest context "
        "cache + shared-segment sources + method state of any hop. Peak RSS: process peak "
        "while the run lasted (model weights included; the noise-floor row also holds the fp32 "
        "model). Unparsed: final answers without a readable answer.",
        "",
        f"| method | benchmark | rho | recompute | {COST_HEADER} | peak state MiB | peak RSS MiB "
        "| state KiB | new tokens / item | s / item | unparsed | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, t, m in _rows(report, tasks):
        lines.append(
            f"| {label} | {_title(t)} | {reuse_cells(m)} | {cost_cells(m)}"
            f" | {m['peak_state_bytes'] / 2**20:.1f} | {m['peak_rss_bytes'] / 2**20:.0f}"
            f" | {m['method_state_bytes'] / 1024:.0f} | {m['new_tokens_per_item']:.0f}"
            f" | {m['s_per_item']:.1f} | {fmt(m['unparsed_rate'], '.2f')}"
            f" | {fmt(m['same_text_rate'], '.2f')} |"
        )
    return lines


def fidelity_table(report: dict[str, Any], tasks: list[str]) -> list[str]:
    lines = [
        "",
        "## Fidelity against NonShared fp32 (all hops / hops 2+)",
        "",
        "| method | benchmark | KV err | KL first | KL cont. | same hop output |",
        "|---|---|---|---|---|---|",
    ]
    for label, t, m in _rows(report, tasks):
        lines.append(
            f"| {label} | {_title(t)} | {pair(m, 'kv_error_{}_mean', '.4f')}"
            f" | {pair(m, 'first_token_kl_{}_mean', '.4f')}"
            f" | {pair(m, 'continuation_kl_{}_mean', '.4f')}"
            f" | {pair(m, 'same_hop_output_{}', '.2f')} |"
        )
    return lines


def bar_value(report: dict[str, Any], label: str, task: str, key: str) -> float:
    """A bar's height: 0 where missing; NonShared agrees with itself."""
    m = report["summary"][label].get(task)
    if m is None:
        return 0.0
    if key == "agreement" and label == "nonshared":
        return 1.0
    return m[key] or 0.0


def plot_accuracy(report: dict[str, Any], path: Path) -> None:
    """Grouped bars: accuracy and agreement per method, one bar per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["summary"])
    tasks = list(report["setup"]["sizes"])
    width = 0.8 / max(len(tasks), 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    panels = (("accuracy", "strict accuracy"), ("agreement", "agreement with NonShared"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for j, t in enumerate(tasks):
            values = [bar_value(report, m, t, key) for m in labels]
            xs = [i + (j - (len(tasks) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, values, width, label=_title(t))
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    s = report["setup"]
    sizes = ", ".join(f"{_title(t)} n={n}" for t, n in s["sizes"].items())
    fig.suptitle(f"{s['model']} {s['dtype']}, task rosters, {sizes}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    write_results(out, report, markdown_table(report))
    plot_accuracy(report, out / "accuracy.png")
