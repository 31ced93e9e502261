"""``kvcmas bench accuracy``: strict task accuracy of every method on the task rosters.

Per method and benchmark (MMLU, GSM8K, HumanEval, each through its roster of
:mod:`kvcmas.eval.tasks`): strict accuracy, agreement of the extracted final answer with
NonShared on the same item, reuse ratio, mean TTFT over non-first hops, peak state bytes and
process peak RSS, anchor-pool bytes. The noise-floor row is NonShared in bf16, scored and
compared with NonShared in fp32 (METHOD.md section 2, rule 6). Decoding is greedy. Every method
runs on the same model, requests and system-prefix caches, NonShared first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.eval.requests import load_requests
from kvcmas.eval.tasks import TASKS, extract_answer, score, task_spec
from kvcmas.experiments.args import add_method_args, add_model_args
from kvcmas.experiments.args import method_options as method_params
from kvcmas.experiments.common import mean, speed_summary
from kvcmas.experiments.compare import NOISE_FLOOR, fmt, summarize
from kvcmas.experiments.report import describe_machine
from kvcmas.methods import METHODS, make_method
from kvcmas.methods.base import Method
from kvcmas.model.loader import LoadedModel, load_model
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow

HELP = "strict accuracy and answer agreement per method on the MMLU/GSM8K/HumanEval rosters"
DEFAULT_LIMITS = {"mmlu": 60, "gsm8k": 60, "humaneval": 30}
DEFAULT_METHODS = "nonshared,fullshared,kvcmas,kvcomm"
TITLES = {"mmlu": "MMLU", "gsm8k": "GSM8K", "humaneval": "HumanEval"}
FIDELITY_KEYS = (
    "kv_error_mean",
    "first_token_kl_mean",
    "continuation_kl_mean",
    "same_hop_output_rate",
)
Log = Callable[[str], Any]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--benchmarks", default="mmlu,gsm8k,humaneval", help="comma-separated")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated; NonShared added")
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="items per benchmark (default: mmlu 60, gsm8k 60, humaneval 30)",
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--without-nonshared",
        action="store_true",
        help="run only the named methods (a part of a split run; see --merge)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="merge these runs' results.json into --out (runs nothing); one must hold NonShared",
    )
    p.add_argument(
        "--fidelity", action="store_true", help="also measure every hop against NonShared fp32"
    )
    p.add_argument("--no-noise-floor", action="store_true", help="skip the NonShared-bf16 row")
    p.add_argument("--task-tokens", type=int, help="cap the task agents' budget (quick runs)")
    p.add_argument("--final-tokens", type=int, help="cap the decision agent's budget")
    add_model_args(p)
    add_method_args(p)


def smoke_args(out_dir: Path) -> list[str]:
    """A small run for ``kvcmas bench smoke``: one item per benchmark, short budgets."""
    return [
        "--benchmarks", "mmlu,gsm8k,humaneval",
        "--methods", "nonshared,kvcmas",
        "--limit", "1",
        "--task-tokens", "8",
        "--final-tokens", "24",
        "--out", str(out_dir),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- peak memory


def reset_peak_rss() -> bool:
    """Reset the process's peak-RSS mark (Linux ``clear_refs``); False where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def current_peak_rss_bytes() -> int:
    """Peak RSS since the last reset (``VmHWM``), else since the process started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    from kvcmas.workflow.runner import peak_rss_bytes

    return peak_rss_bytes()


# ----------------------------------------------------------------------------- one run


def item_record(
    task: str, request: dict, result: RequestResult, baseline: dict | None
) -> dict[str, Any]:
    """One scored item; ``baseline`` is NonShared's record of the same item (None for itself)."""
    answer = extract_answer(task, request, result.final_answer)
    record = {
        "id": result.request,
        "gold": request.get("gold"),
        "final_answer": result.final_answer,
        "answer": answer,
        "correct": score(task, request, result.final_answer),
        "new_tokens": sum(h.output_tokens for h in result.hops),
    }
    if baseline is not None:
        mark_agreement(record, baseline)
    return record


def mark_agreement(record: dict, baseline: dict) -> None:
    """Store whether ``record`` has NonShared's final text and answer on the same item."""
    record["same_text"] = record["final_answer"] == baseline["final_answer"]
    record["same_answer"] = same_answer(record, baseline)


def same_answer(record: dict, baseline: dict) -> bool:
    """Agreement on an item: the same extracted answer where both parse; where either does
    not, the same final text (two different unreadable answers do not agree)."""
    if record["answer"] is None or baseline["answer"] is None:
        return record["final_answer"] == baseline["final_answer"]
    return record["answer"] == baseline["answer"]


def progress_line(task: str, label: str, records: list[dict], total: int, wall_s: float) -> str:
    n = len(records)
    correct = sum(r["correct"] for r in records)
    text = f"  [{task}] {label}: item {n}/{total}, correct {correct}/{n}"
    if "same_answer" in records[-1]:
        text += f", agree {sum(r['same_answer'] for r in records)}/{n}"
    return text + f" ({wall_s / n:.1f} s/item)"


def run_one(
    loaded: LoadedModel,
    workflow: Workflow,
    method: Method,
    task: str,
    requests: list[dict],
    label: str,
    baseline: list[dict] | None,
    reference: LoadedModel | None,
    log: Log,
) -> tuple[list[RequestResult], list[dict], dict[str, float]]:
    """Run one method over one benchmark's items, scoring each as it finishes."""
    measured_rss = reset_peak_rss()
    start = time.perf_counter()
    runner = Runner(loaded, workflow, method, reference=reference)
    results, records = [], []
    for i, result in enumerate(runner.run_stream(requests)):
        base = baseline[i] if baseline is not None else None
        results.append(result)
        records.append(item_record(task, requests[i], result, base))
        log(progress_line(task, label, records, len(requests), time.perf_counter() - start))
    timing = {
        "wall_s": time.perf_counter() - start,
        "peak_rss_bytes": current_peak_rss_bytes(),
        "peak_rss_since_reset": measured_rss,
    }
    return results, records, timing


# ----------------------------------------------------------------------------- summaries


def efficiency(results: list[RequestResult], method: Method, n_layers: int, width: int) -> dict:
    """Reuse, TTFT and memory of one run (no fidelity reference needed), plus pool bytes."""
    out = speed_summary(results)
    out["pool_bytes"] = method.memory_bytes()
    if hasattr(method, "pool_report"):
        out["pool"] = method.pool_report(n_layers, width)
    return out


def summarize_run(
    records: list[dict],
    results: list[RequestResult],
    method: Method,
    timing: dict[str, float],
    config,
    fidelity: bool,
) -> dict[str, Any]:
    n = len(records)
    out: dict[str, Any] = {
        "method": method.name,
        "params": method.params(),
        "items": n,
        "correct": sum(r["correct"] for r in records),
        "accuracy": sum(r["correct"] for r in records) / n,
        "unparsed_rate": sum(r["answer"] is None for r in records) / n,
        "agreement": mean(float(r["same_answer"]) for r in records if "same_answer" in r),
        "same_text_rate": mean(float(r["same_text"]) for r in records if "same_text" in r),
        "new_tokens_per_item": sum(r["new_tokens"] for r in records) / n,
        "s_per_item": timing["wall_s"] / n,
        **efficiency(results, method, config.n_layers, config.kv_width),
        **timing,  # peak RSS since this run began, over the process-lifetime figure
    }
    if fidelity:
        full = summarize(results, method, None, config.n_layers, config.kv_width)
        out["fidelity"] = {k: full[k] for k in FIDELITY_KEYS}
    return out


# ----------------------------------------------------------------------------- the experiment


def parse_list(text: str, known, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in known]
    if unknown or not names:
        raise UsageError(
            f"unknown {what} {', '.join(unknown) or '(none)'}: choose from {', '.join(known)}"
        )
    return names


def plan_runs(
    methods: list[str], dtype: str, noise_floor: bool, with_nonshared: bool = True
) -> list[tuple[str, str, str]]:
    """(label, method, dtype) in run order: NonShared first, the noise floor last."""
    runs = [("nonshared", "nonshared", dtype)] if with_nonshared else []
    runs += [(m, m, dtype) for m in methods if m != "nonshared"]
    if noise_floor and dtype == "fp32":
        runs.append((NOISE_FLOOR, "nonshared", "bf16"))
    return runs


def accuracy_experiment(
    model_spec: str,
    dtype: str,
    benchmarks: list[str],
    methods: list[str],
    params: dict[str, Any],
    limit: int | None = None,
    noise_floor: bool = True,
    fidelity: bool = False,
    budgets: tuple[int | None, int | None] = (None, None),
    with_nonshared: bool = True,
    log: Log = print,
    on_update: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
    """Run every method on every benchmark's roster; return the results dict.

    Methods run one after the other over all benchmarks (NonShared first: its answers are the
    reference), each with fresh state per benchmark. A second model (bf16 for the noise floor)
    is loaded only when its run comes, so the other runs' peak RSS does not include it.
    ``on_update`` gets the partial results after every (method, benchmark) run.
    """
    models = {dtype: load_model(model_spec, dtype)}
    if fidelity and "fp32" not in models:
        models["fp32"] = load_model(model_spec, "fp32")
    reference = models["fp32"] if fidelity else None
    config = models[dtype].config
    tasks = {t: load_requests(t, limit or DEFAULT_LIMITS[t]) for t in benchmarks}
    workflows = {t: task_spec(t).workflow(*budgets) for t in benchmarks}
    runs = plan_runs(methods, dtype, noise_floor, with_nonshared)
    report = new_report(models[dtype].name, dtype, tasks, workflows, runs, params, fidelity)
    for label, name, run_dtype in runs:
        if run_dtype not in models:
            models[run_dtype] = load_model(model_spec, run_dtype)
        for task, requests in tasks.items():
            log(f"{label} on {task}: {len(requests)} items, workflow {workflows[task].name}")
            method = make_method(name, params, strict=False)
            baseline = report["items"].get("nonshared", {}).get(task)
            results, records, timing = run_one(
                models[run_dtype], workflows[task], method, task, requests, label, baseline,
                reference, log,
            )  # fmt: skip
            report["items"][label][task] = records
            report["summary"][label][task] = summarize_run(
                records, results, method, timing, config, fidelity
            )
            add_ttft_ratios(report["summary"], task)
            if on_update:
                on_update(report)
    return report


def new_report(
    model_name: str,
    dtype: str,
    tasks: dict[str, list[dict]],
    workflows: dict[str, Workflow],
    runs: list[tuple[str, str, str]],
    params: dict[str, Any],
    fidelity: bool,
) -> dict[str, Any]:
    """The results dict before any run: setup facts and empty per-run tables."""
    labels = [label for label, _, _ in runs]
    return {
        "setup": {
            "experiment": "accuracy",
            "model": model_name,
            "dtype": dtype,
            "reference": f"NonShared {dtype}",
            "noise_floor": NOISE_FLOOR if NOISE_FLOOR in labels else None,
            "decoding": "greedy",
            "sizes": {t: len(r) for t, r in tasks.items()},
            "workflows": {t: workflow_facts(w) for t, w in workflows.items()},
            "methods": labels,
            "method_params": params,
            "fidelity": fidelity,
            "machine": describe_machine(),
        },
        "summary": {label: {} for label in labels},
        "items": {label: {} for label in labels},
    }


def workflow_facts(workflow: Workflow) -> dict[str, Any]:
    """What a run's answers depend on; split runs merge only where these agree."""
    prompts = json.dumps([[a.system, a.prompt, a.reply_prefix] for a in workflow.agents])
    return {
        "name": workflow.name,
        "agents": [a.name for a in workflow.agents],
        "max_new_tokens": {a.name: a.max_new_tokens for a in workflow.agents},
        "reply_prefix": {a.name: a.reply_prefix for a in workflow.agents if a.reply_prefix},
        "prompts_sha256": hashlib.sha256(prompts.encode()).hexdigest()[:16],
    }


def add_ttft_ratios(summary: dict[str, dict[str, Any]], task: str) -> None:
    if task not in summary.get("nonshared", {}):
        return  # a split run without NonShared: ratios come when it is merged
    base = summary["nonshared"][task]["ttft_nonfirst_mean_s"]
    for per_task in summary.values():
        if task in per_task:
            ttft = per_task[task]["ttft_nonfirst_mean_s"]
            ratio = ttft / base if ttft is not None and base else None
            per_task[task]["ttft_ratio_vs_nonshared"] = ratio


# ----------------------------------------------------------------------------- split runs

SAME_SETUP = ("model", "dtype", "decoding", "method_params", "fidelity")


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the parts of a split run (methods run in separate processes).

    The parts must share model, dtype, item counts, workflows and method parameters; one must
    hold NonShared, against which agreement and TTFT ratios are recomputed. A label present in
    two parts for the same benchmark is an error rather than a silent overwrite.
    """
    if not reports:
        raise UsageError("--merge needs at least one results folder")
    first = reports[0]["setup"]
    for other in reports[1:]:
        for key in SAME_SETUP:
            if other["setup"].get(key) != first.get(key):
                raise UsageError(f"cannot merge runs with a different {key}")
    # Parts may cover different benchmarks; each benchmark's items and budgets must agree.
    sizes: dict[str, int] = {}
    workflows: dict[str, dict] = {}
    for r in reports:
        for task, n in r["setup"]["sizes"].items():
            if sizes.setdefault(task, n) != n:
                raise UsageError(f"cannot merge runs with {sizes[task]} and {n} {task} items")
            if workflows.setdefault(task, r["setup"]["workflows"][task]) != workflows[task]:
                raise UsageError(f"cannot merge runs with different {task} workflows")
    merged = {"setup": dict(first), "summary": {}, "items": {}}
    for r in reports:
        for label, per_task in r["summary"].items():
            for task, summary in per_task.items():
                if task in merged["summary"].get(label, {}):
                    raise UsageError(
                        f"{label} on {task} appears in two of the merged runs (run the noise "
                        "floor in one part only: --no-noise-floor in the others)"
                    )
                merged["summary"].setdefault(label, {})[task] = summary
                merged["items"].setdefault(label, {})[task] = r["items"][label][task]
    if "nonshared" not in merged["summary"]:
        raise UsageError("none of the merged runs holds NonShared, the agreement reference")
    known = list(METHODS) + [NOISE_FLOOR]  # registry order; unknown labels after the methods
    order = sorted(merged["summary"], key=lambda x: known.index(x) if x in known else len(METHODS))
    merged["summary"] = {label: merged["summary"][label] for label in order}
    merged["items"] = {label: merged["items"][label] for label in order}
    setup = merged["setup"]
    setup["sizes"] = {t: sizes[t] for t in TASKS if t in sizes}
    setup["workflows"] = {t: workflows[t] for t in setup["sizes"]}
    setup["methods"] = order
    setup["noise_floor"] = NOISE_FLOOR if NOISE_FLOOR in order else None
    setup["machine"] = "; ".join(dict.fromkeys(r["setup"]["machine"] for r in reports))
    setup["merged_from"] = len(reports)
    for label in order:
        for task, records in merged["items"][label].items():
            base = merged["items"]["nonshared"].get(task)
            if label == "nonshared" or base is None:
                continue
            if [r["id"] for r in records] != [b["id"] for b in base]:
                raise UsageError(f"{label} on {task} ran other items than NonShared")
            rescore_agreement(records, base, merged["summary"][label][task])
    for task in setup["sizes"]:
        add_ttft_ratios(merged["summary"], task)
    return merged


def rescore_agreement(records: list[dict], baseline: list[dict], summary: dict) -> None:
    for record, base in zip(records, baseline, strict=True):
        mark_agreement(record, base)
    summary["agreement"] = mean(float(r["same_answer"]) for r in records)
    summary["same_text_rate"] = mean(float(r["same_text"]) for r in records)


def merge_dirs(dirs: list[str], out: Path) -> int:
    reports = []
    for d in dirs:
        path = Path(d) / "results.json"
        if not path.is_file():
            raise UsageError(f"no results.json in {d}")
        report = json.loads(path.read_text())
        if report.get("setup", {}).get("experiment") != "accuracy":
            raise UsageError(f"{path} is not an accuracy run")
        reports.append(report)
    report = merge_reports(reports)
    write_outputs(report, out)
    print((out / "table.md").read_text())
    return 0


# ----------------------------------------------------------------------------- outputs


def _budget_text(report: dict[str, Any]) -> str:
    parts = []
    for w in report["setup"]["workflows"].values():
        budgets = list(w["max_new_tokens"].values())
        parts.append(f"{w['name']} (task agents {budgets[:-1]}, decision agent {budgets[-1]})")
    return "; ".join(parts)


def markdown_table(report: dict[str, Any]) -> str:
    """Method rows x benchmark columns (accuracy and agreement), then the efficiency table."""
    s = report["setup"]
    tasks = list(s["sizes"])
    sizes = ", ".join(f"{n} {TITLES.get(t, t)}" for t, n in s["sizes"].items())
    lines = [
        "# Task accuracy on the task rosters",
        "",
        f"Model {s['model']} ({s['dtype']}), {s['decoding']} decoding; {sizes} items "
        f"(seeded shuffle of each test split); machine {s['machine']}. "
        f"Workflows (new-token budgets): {_budget_text(report)}.",
        "",
        "Accuracy is strict (MMLU: last `Answer: X` line; GSM8K: number after the last "
        "`Answer:`; HumanEval: unit tests pass). Agreement: the same extracted answer as "
        f"{s['reference']} on the same item (where either answer is unreadable: the same "
        "final text). "
        + (
            f"`{s['noise_floor']}` is NonShared in bf16 against NonShared fp32: the noise floor."
            if s["noise_floor"]
            else ""
        ),
        "",
        "| method | " + " | ".join(f"{TITLES.get(t, t)} acc | agree" for t in tasks) + " |",
        "|---|" + "---|---|" * len(tasks),
    ]
    for label, per_task in report["summary"].items():
        cells = []
        for t in tasks:
            m = per_task.get(t)
            if m is None:
                cells.append("- | -")
                continue
            agree = "ref" if label == "nonshared" else fmt(m["agreement"], ".2f")
            cells.append(f"{fmt(m['accuracy'], '.3f')} ({m['correct']}/{m['items']}) | {agree}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += efficiency_table(report, tasks)
    if s["fidelity"]:
        lines += fidelity_table(report, tasks)
    return "\n".join(lines) + "\n"


def efficiency_table(report: dict[str, Any], tasks: list[str]) -> list[str]:
    lines = [
        "",
        "## Reuse, latency and memory",
        "",
        "TTFT is the mean over non-first hops. Peak state: the largest context cache + "
        "shared-segment sources + method state of any hop. Peak RSS: process peak while the "
        "run lasted (model weights included; the noise-floor row also holds the fp32 model). "
        "Unparsed: final answers without a readable "
        "answer.",
        "",
        "| method | benchmark | reuse | TTFT s | TTFT / NonShared | peak state MiB "
        "| peak RSS MiB | pool KiB | new tokens / item | s / item | unparsed | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, per_task in report["summary"].items():
        for t in [t for t in tasks if t in per_task]:
            m = per_task[t]
            lines.append(
                f"| {label} | {TITLES.get(t, t)} | {fmt(m['reuse_ratio_tokens'], '.2f')}"
                f" | {fmt(m['ttft_nonfirst_mean_s'], '.3f')}"
                f" | {fmt(m.get('ttft_ratio_vs_nonshared'), '.2f')}"
                f" | {m['peak_state_bytes'] / 2**20:.1f} | {m['peak_rss_bytes'] / 2**20:.0f}"
                f" | {m['pool_bytes'] / 1024:.0f} | {m['new_tokens_per_item']:.0f}"
                f" | {m['s_per_item']:.1f} | {fmt(m['unparsed_rate'], '.2f')}"
                f" | {fmt(m['same_text_rate'], '.2f')} |"
            )
    return lines


def fidelity_table(report: dict[str, Any], tasks: list[str]) -> list[str]:
    lines = [
        "",
        "## Fidelity against NonShared fp32 (hops after the first)",
        "",
        "| method | benchmark | KV err | KL first | KL cont. | same hop output |",
        "|---|---|---|---|---|---|",
    ]
    for label, per_task in report["summary"].items():
        for t in [t for t in tasks if t in per_task]:
            f = per_task[t]["fidelity"]
            lines.append(
                f"| {label} | {TITLES.get(t, t)} | {fmt(f['kv_error_mean'], '.4f')}"
                f" | {fmt(f['first_token_kl_mean'], '.4f')}"
                f" | {fmt(f['continuation_kl_mean'], '.4f')}"
                f" | {fmt(f['same_hop_output_rate'], '.2f')} |"
            )
    return lines


def plot_accuracy(report: dict[str, Any], path: Path) -> None:
    """Grouped bars: accuracy and agreement per method, one bar per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["summary"])
    tasks = list(report["setup"]["sizes"])
    width = 0.8 / max(len(tasks), 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, key, title in zip(
        axes, ("accuracy", "agreement"), ("strict accuracy", "agreement with NonShared"),
        strict=True,
    ):  # fmt: skip
        for j, t in enumerate(tasks):
            values = [_bar_value(report, m, t, key) for m in labels]
            xs = [i + (j - (len(tasks) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, values, width, label=TITLES.get(t, t))
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    s = report["setup"]
    fig.suptitle(f"{s['model']} {s['dtype']}, task rosters, {_size_text(s)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bar_value(report: dict[str, Any], label: str, task: str, key: str) -> float:
    """A bar's height: 0 where missing; NonShared agrees with itself."""
    m = report["summary"][label].get(task)
    if m is None:
        return 0.0
    if key == "agreement" and label == "nonshared":
        return 1.0
    return m[key] or 0.0


def _size_text(setup: dict[str, Any]) -> str:
    return ", ".join(f"{TITLES.get(t, t)} n={n}" for t, n in setup["sizes"].items())


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "table.md").write_text(markdown_table(report))
    plot_accuracy(report, out / "accuracy.png")


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return merge_dirs(args.merge, Path(args.out))
    benchmarks = parse_list(args.benchmarks, list(TASKS), "benchmark(s)")
    methods = parse_list(args.methods, list(METHODS), "method(s)")
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    for flag in ("task_tokens", "final_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    params = method_params(args)
    for name in methods:
        try:
            make_method(name, params, strict=False)
        except ValueError as e:
            raise UsageError(str(e)) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = accuracy_experiment(
        args.model,
        args.dtype,
        benchmarks,
        methods,
        params,
        limit=args.limit,
        noise_floor=not args.no_noise_floor,
        fidelity=args.fidelity,
        budgets=(args.task_tokens, args.final_tokens),
        with_nonshared=not args.without_nonshared,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        on_update=lambda r: (out / "results.json").write_text(json.dumps(r, indent=1)),
    )
    write_outputs(report, out)
    print((out / "table.md").read_text())
    return 0
