"""Running an accuracy plan: every method over every benchmark's roster, scored item by item.

Each (method, benchmark) run gets a fresh method and goes through
:func:`kvcmas.experiments.compare.run_method`; its figures are compare's ``summarize`` (one
definition, :mod:`kvcmas.eval.summary`) plus the task figures: strict accuracy and agreement
of the extracted answer with NonShared on the same item.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcmas.eval.requests import load_requests
from kvcmas.eval.summary import add_ratios, mean
from kvcmas.eval.tasks import extract_answer, score, task_spec
from kvcmas.experiments.accuracy.plan import Plan
from kvcmas.experiments.compare import NOISE_FLOOR, run_method, summarize
from kvcmas.experiments.machine import machine_description
from kvcmas.methods import make_method
from kvcmas.model.loader import LoadedModel, load_model
from kvcmas.workflow.records import RequestResult, peak_rss_bytes
from kvcmas.workflow.spec import Workflow

Log = Callable[[str], Any]


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
    return peak_rss_bytes()


def item_record(
    task: str, request: dict, result: RequestResult, baseline: dict | None
) -> dict[str, Any]:
    """One scored item; ``baseline`` is NonShared's record of the same item (None for itself)."""
    record = {
        "id": result.request,
        "gold": request.get("gold"),
        "final_answer": result.final_answer,
        "answer": extract_answer(task, request, result.final_answer),
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


def agreement_figures(records: list[dict]) -> dict[str, float | None]:
    """Answer and text agreement with NonShared (None for NonShared itself)."""
    return {
        "agreement": mean(float(r["same_answer"]) for r in records if "same_answer" in r),
        "same_text_rate": mean(float(r["same_text"]) for r in records if "same_text" in r),
    }


def task_figures(records: list[dict], wall_s: float) -> dict[str, Any]:
    n = len(records)
    correct = sum(r["correct"] for r in records)
    return {
        "items": n,
        "correct": correct,
        "accuracy": correct / n,
        "unparsed_rate": sum(r["answer"] is None for r in records) / n,
        "new_tokens_per_item": sum(r["new_tokens"] for r in records) / n,
        "s_per_item": wall_s / n,
        **agreement_figures(records),
    }


def add_task_ratios(summary: dict[str, dict[str, Any]], task: str) -> None:
    """TTFT, latency and compute ratios to NonShared on ``task`` (once NonShared has run)."""
    add_ratios({label: per_task[task] for label, per_task in summary.items() if task in per_task})


def progress_line(task: str, label: str, records: list[dict], total: int, wall_s: float) -> str:
    n = len(records)
    text = f"  [{task}] {label}: item {n}/{total}, correct {sum(r['correct'] for r in records)}/{n}"
    if "same_answer" in records[-1]:
        text += f", agree {sum(r['same_answer'] for r in records)}/{n}"
    return text + f" ({wall_s / n:.1f} s/item)"


def run_one(
    loaded: LoadedModel,
    reference: LoadedModel | None,
    workflow: Workflow,
    method_name: str,
    options: dict[str, Any],
    task: str,
    requests: list[dict],
    label: str,
    baseline: list[dict] | None,
    log: Log,
) -> tuple[list[dict], dict[str, Any]]:
    """One method over one benchmark's items: the scored records and the run's summary."""
    method = make_method(method_name, options, strict=False)
    measured_rss = reset_peak_rss()
    start = time.perf_counter()
    records: list[dict] = []

    def scored(i: int, result: RequestResult) -> None:
        base = baseline[i] if baseline is not None else None
        records.append(item_record(task, requests[i], result, base))
        log(progress_line(task, label, records, len(requests), time.perf_counter() - start))

    results = run_method(loaded, reference, workflow, method, requests, scored)
    wall_s = time.perf_counter() - start
    cfg = loaded.config
    summary = {
        **summarize(results, method, None, cfg.n_layers, cfg.kv_width),
        **task_figures(records, wall_s),
        "wall_s": wall_s,
        "peak_rss_bytes": current_peak_rss_bytes(),  # since this run began, where possible
        "peak_rss_since_reset": measured_rss,
    }
    return records, {**summary, **loaded.gemm_facts()}


def plan_items(plan: Plan) -> dict[str, list[dict]]:
    """Per benchmark, the plan's items: the first ``limit`` of its split's seeded shuffle."""
    return {t: load_requests(t, plan.limits[t], split=plan.split) for t in plan.benchmarks}


def accuracy_experiment(
    plan: Plan,
    log: Log = print,
    on_update: Callable[[dict[str, Any]], Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run every planned method on every benchmark; return the results dict.

    A second model (bf16 for the noise floor) is loaded only when its run comes, so the other
    runs' peak RSS does not include it. ``on_update`` gets the partial results after every
    (method, benchmark) run.
    """
    models = {plan.dtype: load_model(plan.model, plan.dtype, device)}
    if plan.fidelity and "fp32" not in models:
        models["fp32"] = load_model(plan.model, "fp32", device)
    reference = models["fp32"] if plan.fidelity else None
    tasks = plan_items(plan)
    workflows = {t: task_spec(t).workflow(*plan.budgets) for t in plan.benchmarks}
    report = new_report(plan, models[plan.dtype].name, tasks, workflows)
    for run in plan.runs:
        if run.dtype not in models:  # bf16 here is the noise floor's (plan_runs)
            gemm = plan.floor_gemm if run.label == NOISE_FLOOR else None
            models[run.dtype] = load_model(plan.model, run.dtype, device, gemm_dtype=gemm)
        for task, requests in tasks.items():
            log(f"{run.label} on {task}: {len(requests)} items, workflow {workflows[task].name}")
            baseline = report["items"].get("nonshared", {}).get(task)
            records, summary = run_one(
                models[run.dtype], reference, workflows[task], run.method, plan.options, task,
                requests, run.label, baseline, log,
            )  # fmt: skip
            report["items"][run.label][task] = records
            report["summary"][run.label][task] = summary
            add_task_ratios(report["summary"], task)
            if on_update:
                on_update(report)
    return report


def new_report(
    plan: Plan,
    model_name: str,
    tasks: dict[str, list[dict]],
    workflows: dict[str, Workflow],
) -> dict[str, Any]:
    """The results dict before any run: setup facts and empty per-run tables."""
    labels = [r.label for r in plan.runs]
    return {
        "setup": {
            "experiment": "accuracy",
            "model": model_name,
            "dtype": plan.dtype,
            "reference": f"NonShared {plan.dtype}",
            "noise_floor": NOISE_FLOOR if NOISE_FLOOR in labels else None,
            "decoding": "greedy",
            "split": plan.split,
            "sizes": {t: len(r) for t, r in tasks.items()},
            "workflows": {t: workflow_facts(w) for t, w in workflows.items()},
            "methods": labels,
            "label_methods": {r.label: r.method for r in plan.runs},
            "method_params": plan.options,
            "fidelity": plan.fidelity,
            "machine": machine_description(),
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
