"""Merging the parts of a split accuracy run (methods run in separate processes) into one.

The parts must share model, dtype, item counts and workflows; one must hold NonShared, against
which agreement and the TTFT / latency / compute ratios are recomputed. Method options may
differ between parts (KVCMAS with graded repair in one part, CacheBlend at its defaults in
another): each label keeps the options its own part gave it, and the table states them. A
label present in two parts for the same benchmark is an error rather than a silent overwrite.
Parts may run on different machines (accuracy and agreement do not depend on the machine's
speed), but a label timed on another machine than NonShared gets no TTFT, latency or compute
ratio: a ratio across machines measures the machines.
"""

from __future__ import annotations

from typing import Any

from kvcmas.errors import UsageError
from kvcmas.eval.summary import RATIO_KEYS
from kvcmas.eval.tasks import TASKS
from kvcmas.experiments.accuracy.runs import add_task_ratios, agreement_figures, mark_agreement
from kvcmas.experiments.common import read_results
from kvcmas.experiments.compare import NOISE_FLOOR
from kvcmas.methods import METHODS, method_class

SAME_SETUP = ("model", "dtype", "decoding", "fidelity")


def check_parts_fit(reports: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, dict]]:
    """Per benchmark, the item count and workflow every part agrees on."""
    if not reports:
        raise UsageError("--merge needs at least one results folder")
    first = reports[0]["setup"]
    for other in reports[1:]:
        for key in SAME_SETUP:
            if other["setup"].get(key) != first.get(key):
                raise UsageError(f"cannot merge runs with a different {key}")
        if other["setup"].get("split", "test") != first.get("split", "test"):  # older: test
            raise UsageError("cannot merge runs of different splits (a calibration and a test)")
    # Parts may cover different benchmarks; each benchmark's items and budgets must agree.
    sizes: dict[str, int] = {}
    workflows: dict[str, dict] = {}
    for r in reports:
        for task, n in r["setup"]["sizes"].items():
            if sizes.setdefault(task, n) != n:
                raise UsageError(f"cannot merge runs with {sizes[task]} and {n} {task} items")
            if workflows.setdefault(task, r["setup"]["workflows"][task]) != workflows[task]:
                raise UsageError(f"cannot merge runs with different {task} workflows")
    return sizes, workflows


def label_method(setup: dict[str, Any], label: str) -> str:
    """The method a row ran: its part's ``--label`` names it, else the label is the method."""
    if label == NOISE_FLOOR:
        return "nonshared"
    return setup.get("label_methods", {}).get(label, label)


def label_methods(reports: list[dict[str, Any]]) -> dict[str, str]:
    """Per row of every part, the method it ran."""
    return {label: label_method(r["setup"], label) for r in reports for label in r["summary"]}


def collect_runs(reports: list[dict[str, Any]]) -> tuple[dict, dict]:
    """Summaries and items of every (label, benchmark), in method-registry order (a labelled
    row after its method's)."""
    summary: dict[str, dict] = {}
    items: dict[str, dict] = {}
    for r in reports:
        for label, per_task in r["summary"].items():
            for task, s in per_task.items():
                if task in summary.get(label, {}):
                    raise UsageError(
                        f"{label} on {task} appears in two of the merged runs (give one part "
                        "--label to keep both; run the noise floor in one part only: "
                        "--no-noise-floor in the others)"
                    )
                summary.setdefault(label, {})[task] = s
                items.setdefault(label, {})[task] = r["items"][label][task]
    if "nonshared" not in summary:
        raise UsageError("none of the merged runs holds NonShared, the agreement reference")
    methods = label_methods(reports)
    known = list(METHODS) + [NOISE_FLOOR]  # registry order; unknown labels after the methods

    def rank(label: str) -> tuple[int, bool]:
        method = NOISE_FLOOR if label == NOISE_FLOOR else methods[label]
        return (known.index(method) if method in known else len(METHODS), label != method)

    order = sorted(summary, key=rank)
    return {k: summary[k] for k in order}, {k: items[k] for k in order}


def label_options(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per label, the method options its run was given (only the options its method takes):
    a merged report keeps them per label; a single run's flags went to every method."""
    setup = report["setup"]
    if "label_options" in setup:
        return setup["label_options"]
    given = setup.get("method_params") or {}
    out = {}
    for label in report["summary"]:
        method = label_method(setup, label)
        taken = method_class(method).Config.option_names() if method in METHODS else ()
        options = {k: v for k, v in given.items() if k in taken}
        if options:
            out[label] = options
    return out


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the parts of a split run."""
    sizes, workflows = check_parts_fit(reports)
    summary, items = collect_runs(reports)
    setup = dict(reports[0]["setup"])
    setup["sizes"] = {t: sizes[t] for t in TASKS if t in sizes}
    setup["workflows"] = {t: workflows[t] for t in setup["sizes"]}
    setup["methods"] = list(summary)
    setup["noise_floor"] = NOISE_FLOOR if NOISE_FLOOR in summary else None
    setup["machine"] = "; ".join(dict.fromkeys(r["setup"]["machine"] for r in reports))
    setup["merged_from"] = len(reports)
    setup["label_methods"] = label_methods(reports)
    setup.pop("method_params", None)  # per part; kept per label instead
    setup["label_options"] = {
        label: options for r in reports for label, options in label_options(r).items()
    }
    for label, per_task in items.items():
        for task, records in per_task.items():
            base = items["nonshared"].get(task)
            if label == "nonshared" or base is None:
                continue
            if [r["id"] for r in records] != [b["id"] for b in base]:
                raise UsageError(f"{label} on {task} ran other items than NonShared")
            for record, b in zip(records, base, strict=True):
                mark_agreement(record, b)
            summary[label][task].update(agreement_figures(records))
    for task in setup["sizes"]:
        add_task_ratios(summary, task)
    machines = label_machines(reports)
    if len(set(machines.values())) > 1:
        setup["label_machines"] = machines
        for label, machine in machines.items():
            if machine != machines["nonshared"]:
                for per_task in summary[label].values():
                    per_task.update(dict.fromkeys(RATIO_KEYS))
    return {"setup": setup, "summary": summary, "items": items}


def label_machines(reports: list[dict[str, Any]]) -> dict[str, str]:
    """The machine each label ran on (a merged part keeps its own labels' machines)."""
    machines: dict[str, str] = {}
    for r in reports:
        own = r["setup"].get("label_machines", {})
        for label in r["summary"]:
            machines[label] = own.get(label, r["setup"]["machine"])
    return machines


def read_parts(dirs: list[str]) -> list[dict[str, Any]]:
    reports = []
    for d in dirs:
        path, report = read_results(d)
        if report.get("setup", {}).get("experiment") != "accuracy":
            raise UsageError(f"{path} is not an accuracy run")
        reports.append(report)
    return reports
