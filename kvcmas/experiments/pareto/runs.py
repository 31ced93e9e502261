"""Running a pareto plan: a fidelity pass in fp32 and a separate timing pass, every point on
the same documents (warm-ups first for methods that keep state).

Fidelity: every hop against a dense fp32 NonShared prefill of its own prompt
(:class:`~kvcmas.eval.fidelity.FidelityObserver`), and final answers against the fp32
NonShared run. Timing: the same points without an observer in ``--dtype`` (bf16 by default),
their measured requests interleaved (round by round), ratios to NonShared at the same size.
Figures come from :mod:`kvcmas.eval.summary`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcmas.eval.fidelity import MEMO_BYTES, FidelityObserver
from kvcmas.eval.summary import add_ratios, answer_agreement, fidelity_summary, run_summary
from kvcmas.experiments import common
from kvcmas.experiments.compare import fmt
from kvcmas.experiments.context_sweep.documents import documents, source_texts
from kvcmas.experiments.context_sweep.plan import (
    cap_sizes,
    overhead_tokens,
    trace_fields,
    trace_workflow,
)
from kvcmas.experiments.context_sweep.runs import point_requests
from kvcmas.experiments.machine import machine_description
from kvcmas.experiments.pareto.plan import NOISE_FLOOR, Point, plan_points
from kvcmas.experiments.pareto.resume import finished_points
from kvcmas.methods import make_method
from kvcmas.model.loader import LoadedModel, load_model
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow

Log = Callable[[str], None]


def warmed_runner(
    loaded: LoadedModel, workflow: Workflow, point: Point, docs: list[str], warmup: int, log: Log
) -> tuple[Runner, Any, list[dict]]:
    """A runner of ``point``'s method after its warm-ups (if it keeps state), the method and
    the measured requests left to run. Every agent output has exactly its budget (end-of-turn
    ignored). No observer: warm-ups only build the method's state, and their dense
    references (a prefill and a full decode each hop) would be computed for nothing."""
    method = make_method(point.method, point.options)
    runner = Runner(loaded, workflow, method)
    runner.stop = set()  # as common.trace_runner(ignore_eos=True)
    requests, n_warm = point_requests(method, docs, warmup)
    if n_warm:
        common.run_stream(runner, requests[:n_warm], log, f"{point.label} warm-up")
    return runner, method, requests[n_warm:]


def run_point(
    loaded: LoadedModel,
    workflow: Workflow,
    point: Point,
    docs: list[str],
    warmup: int,
    observer: FidelityObserver | None,
    log: Log,
) -> tuple[list[RequestResult], Any]:
    """One point over the measured documents, watched by ``observer`` (after its warm-ups)."""
    runner, method, measured = warmed_runner(loaded, workflow, point, docs, warmup, log)
    runner.observer = observer
    return common.run_stream(runner, measured, log, point.label), method


def fidelity_pass(
    reference: LoadedModel, bf16: LoadedModel | None, workflow, points, docs, warmup, log,
    on_point: Callable[[dict], None] = lambda _: None, done: dict[str, dict] | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per point label: fidelity and reuse figures against fp32 NonShared, handed to
    ``on_point`` after each point. One observer watches every point, so each distinct hop's
    dense reference is computed once. ``done``: points an earlier run finished (``--resume``),
    taken as they are instead of run again."""
    n_layers = reference.config.n_layers
    observer = FidelityObserver(reference, memo_bytes=MEMO_BYTES)
    out: dict[str, dict[str, Any]] = {}
    baseline: list[str] = []  # fp32 NonShared's final answers
    runs = [(p, reference) for p in points]
    if bf16 is not None:
        runs.append((Point("nonshared", dtype="bf16"), bf16))
    for point, loaded in runs:
        taken = point.label in (done or {})
        if taken:
            s = done[point.label]
        else:
            start = time.perf_counter()
            results, method = run_point(loaded, workflow, point, docs, warmup, observer, log)
            s = {**run_summary(results), **fidelity_summary(results, n_layers)}
            s["final_answers"] = [r.final_answer for r in results]  # what a resume compares
            s["params"] = method.params()
            s["wall_s"] = round(time.perf_counter() - start, 1)
            s["machine"] = machine_description()  # a resumed run's points: two hosts maybe
            s.update(loaded.gemm_facts())
        if point.method == "nonshared" and point.dtype == "fp32":
            baseline = s["final_answers"]
        s["final_agreement"] = answer_agreement(s["final_answers"], baseline) if baseline else None
        out[point.label] = s
        log(
            f"  fidelity {point.label}: KL first 2+ {fmt(s['first_token_kl_later_mean'], '.5f')},"
            f" agree {fmt(s['final_agreement'], '.2f')}, rho 2+ {fmt(s['rho_later'], '.2f')};"
            f" references computed {observer.memo.misses}, reused {observer.memo.hits}"
            + (" (taken from the earlier run)" if taken else f" ({s['wall_s']:.0f}s)")
        )
        on_point(out)
    return out


def timing_pass(
    loaded: LoadedModel, workflow, points, docs, warmup, log,
    on_round: Callable[[dict], None] = lambda _: None,
) -> dict[str, Any]:  # fmt: skip
    """Per point label: timing figures and ratios to NonShared (the first point), handed to
    ``on_round`` after each round.

    Rounds interleave the points: every point's warm-ups run first, then measured request i
    of every point before request i + 1 of any, so a drift in the host's speed during the
    pass (a shared VM's neighbours) falls on every point alike, not on the points run last.
    Each point keeps its own runner and method state, so it sees the same request sequence
    as when run alone."""
    runs = []
    for point in points:
        runner, method, measured = warmed_runner(loaded, workflow, point, docs, warmup, log)
        runs.append((point, runner, method, measured, []))
    out: dict[str, Any] = {}
    start = time.perf_counter()
    n_rounds = len(docs) - warmup
    for i in range(n_rounds):
        for _, runner, _, requests, results in runs:
            results.append(runner.run(requests[i]))
        out = {p.label: {**run_summary(res), "params": m.params()} for p, _, m, _, res in runs}
        add_ratios(out, baseline="nonshared")
        log(
            f"timing round {i + 1}/{n_rounds} ({time.perf_counter() - start:.0f}s): TTFT 2+ "
            + ", ".join(f"{lb} x{fmt(speedup(s, 'ttft_later_ratio'), '.2f')}"
                        for lb, s in out.items())
        )  # fmt: skip
        on_round(out)
    return out


def speedup(summary: dict[str, Any] | None, ratio: str) -> float | None:
    """Speedup over NonShared from a ``*_ratio`` figure (time / NonShared's time)."""
    r = (summary or {}).get(ratio)
    return 1 / r if r else None


def pareto(
    args: argparse.Namespace, log: Log, on_update: Callable[[dict], None] = lambda _: None
) -> dict[str, Any]:
    """The run's results; ``on_update`` gets them after every fidelity point and timing
    round, marked ``partial``, so a run stopped early leaves what it finished (a part
    ``--merge`` can use)."""
    reference = load_model(args.model, "fp32", args.device)
    n_layers = reference.config.n_layers
    points = plan_points(args.methods, n_layers, args.max_points, args.points)
    workflow = trace_workflow(args.agents, args.output_tokens)
    overhead = overhead_tokens(reference.tokenizer, workflow)
    sizes, capped = cap_sizes(args.sizes, reference.config.max_position - overhead)
    texts = source_texts(args.source, args.split)
    count = args.warmup + args.measure
    all_docs = {s: documents(reference.tokenizer, texts, s, count) for s in sizes}
    floor = not args.no_noise_floor
    bf16 = None
    if floor and not args.no_fidelity:
        bf16 = load_model(args.model, "bf16", args.device, gemm_dtype=args.floor_gemm)
    timed = None
    if not args.no_timing:
        same = args.dtype == "bf16" and bf16 and args.floor_gemm == "bf16"
        timed = bf16 if same else load_model(args.model, args.dtype, args.device)
    results = {
        "setup": common.setup(
            reference,
            f"fidelity {'none' if args.no_fidelity else 'fp32'}, "
            f"timing {'none' if args.no_timing else args.dtype}",
            **trace_fields(args, sizes),
            split=args.split,
            device=args.device,
            # runs before the interleaved timing pass lack this field: theirs was sequential
            **({} if args.no_timing else {"timing_order": "interleaved"}),
        ),
        "capped": {str(k): v for k, v in capped.items()},
        "sizes": [],
    }
    finished: dict[int, dict[str, dict]] = {}  # per size: points an earlier run finished
    if args.resume:
        floor_gemm = bf16.gemm_facts().get("gemm_dtype") if bf16 is not None else None
        finished = finished_points(
            Path(args.out), results["setup"], points, n_layers, floor, floor_gemm
        )
        taken = {str(size): sorted(rows) for size, rows in finished.items() if rows}
        log(f"resuming {args.out}: " + (f"points taken {taken}" if taken else "nothing to take"))
        if taken:
            results["setup"]["resumed_points"] = taken
    for i, (size, docs) in enumerate(all_docs.items()):

        def partial(fid: dict, tim: dict, size: int = size, i: int = i) -> None:
            # points an earlier run finished (--resume) stay in every save, those this pass
            # has not reached yet (later in the plan, or at a later size) included
            fid = {**finished.get(size, {}), **fid}
            now = {"size": size, "points": rows_so_far(points, fid, tim, floor)}
            later = [{"size": s, "points": rows_so_far(points, finished[s], {}, floor)}
                     for s in sizes[i + 1 :] if finished.get(s)]  # fmt: skip
            on_update({**results, "sizes": [*results["sizes"], now, *later], "partial": True})

        fid = {}
        if not args.no_fidelity:
            log(f"size {size}: fidelity pass (fp32), {len(points)} points")
            fid = fidelity_pass(
                reference, bf16, workflow, points, docs, args.warmup, log,
                on_point=lambda f: partial(f, {}), done=finished.get(size),
            )  # fmt: skip
        tim = {}
        if timed is not None:
            log(f"size {size}: timing pass ({args.dtype})")
            tim = timing_pass(
                timed, workflow, points, docs, args.warmup, log,
                on_round=lambda t, fid=fid: partial(fid, t),
            )  # fmt: skip
        results["sizes"].append({"size": size, "points": merge_points(points, fid, tim, floor)})
    return results


def rows_so_far(points: list[Point], fid: dict, tim: dict, floor: bool) -> list[dict[str, Any]]:
    """The rows of the points either pass has finished (a partial run's)."""
    ran = [p for p in points if p.label in fid or p.label in tim]
    return merge_points(ran, fid, tim, floor and NOISE_FLOOR in fid)


def merge_points(points: list[Point], fid: dict, tim: dict, floor: bool) -> list[dict[str, Any]]:
    """One row per point (and the noise floor's, if ``floor``): its knobs, the fidelity figures
    and the timing figures; a pass not run leaves its figures None."""
    labels = [p.label for p in points] + ([NOISE_FLOOR] if floor else [])
    methods = {p.label: p.method for p in points}
    rows = []
    for label in labels:
        f, t = fid.get(label), tim.get(label)
        if label == NOISE_FLOOR:  # dense prefill: timed as the timing pass's NonShared point
            t = tim.get("nonshared")
        rows.append(
            {
                "label": label,
                "method": methods.get(label, label),
                "params": (f or t or {}).get("params"),
                "ttft_speedup_later": speedup(t, "ttft_later_ratio"),
                "e2e_speedup": speedup(t, "latency_ratio"),
                "compute_ratio": (t or {}).get("compute_ratio"),
                "first_token_kl": (f or {}).get("first_token_kl_later_mean"),
                "continuation_kl": (f or {}).get("continuation_kl_later_mean"),
                "final_agreement": (f or {}).get("final_agreement"),
                "rho_later": (f or {}).get("rho_later"),
                "recompute_later": (f or {}).get("recompute_later"),
                "fidelity": f,
                "timing": t,
            }
        )
    return rows
