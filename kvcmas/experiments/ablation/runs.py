"""The ablation's runs. Parts (a)-(c) are online KVCMAS runs on the calibration stream
(:class:`~kvcmas.experiments.calibrate.runs.OnlineRuns`: the method's own pools, use counts,
least-used eviction and chained sources; fidelity against fp32 NonShared), one knob moved at a
time from the defaults; equal settings run once. Part (d) is reference-free speed runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvcmas.eval.summary import run_summary
from kvcmas.experiments import common
from kvcmas.experiments.ablation.plan import (
    DEFAULT_POOL,
    DEFAULT_RANK,
    chain_workflow,
    debate_workflow,
    kvcmas_options,
    label,
)
from kvcmas.experiments.calibrate.plan import capped
from kvcmas.experiments.calibrate.runs import OnlineRuns
from kvcmas.experiments.cells import fmt
from kvcmas.methods import make_method
from kvcmas.methods.kvcmas import DEFAULT_TAU
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.spec import Workflow


def online(runs: OnlineRuns, **knobs: Any) -> dict[str, Any]:
    """The summary of KVCMAS with ``knobs`` moved from the defaults."""
    options = kvcmas_options(**knobs)
    return runs.summary(label(options), "kvcmas", **options)


def rank_pool_rows(
    runs: OnlineRuns, ranks: list[int | None], pool_sizes: list[int], **base: Any
) -> list[dict[str, Any]]:
    """(a): each rank at the default pool size, then each pool size at the default rank."""
    points = [(r, DEFAULT_POOL) for r in ranks]
    points += [(DEFAULT_RANK, v) for v in pool_sizes if (DEFAULT_RANK, v) not in points]
    rows = [
        {"rank": r, "pool_size": v, **online(runs, rank=r, pool_size=v, **base)} for r, v in points
    ]
    for row in rows:
        runs.log(
            f"(a) r={row['rank'] or 'full'} V={row['pool_size']}: error / FullShared "
            f"{fmt(row['error_ratio'])}, pool {row.get('pool_bytes', 0) / 2**20:.2f} MiB"
        )
    return rows


def tau_rows(runs: OnlineRuns, taus: list[float], **base: Any) -> list[dict[str, Any]]:
    """(b): the gate threshold; tau 0 never reuses, tau > 1 always once anchors exist."""
    return [{"tau": t, **online(runs, tau=t, **base)} for t in taus]


def chain_rows(runs: OnlineRuns, **base: Any) -> list[dict[str, Any]]:
    """(c): chained sources against KVCOMM's non-chained base (a reference prefill)."""
    return [{"chain": c, **online(runs, chain=c, **base)} for c in (True, False)]


def scale_rows(
    loaded: LoadedModel,
    workflows: list[tuple[str, int, Workflow]],
    requests: list[dict],
    warmup: int,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """(d): NonShared and KVCMAS on each workflow, outputs forced to their budgets; figures
    over the requests after ``warmup`` (pools filled)."""
    out = []
    for axis, value, wf in workflows:
        for name in ("nonshared", "kvcmas"):
            runner = common.trace_runner(loaded, wf, make_method(name), ignore_eos=True)
            results = common.run_stream(runner, requests, log, f"(d) {wf.name} {name}")
            out.append(
                {
                    "axis": axis,
                    "value": value,
                    "workflow": wf.name,
                    "agent_calls": len(wf.agents),
                    "method": name,
                    **run_summary(results[warmup:]),
                }
            )
    base = {(r["axis"], r["value"]): r for r in out if r["method"] == "nonshared"}
    for r in out:
        b = base[(r["axis"], r["value"])]
        for ratio, key in (
            ("speedup", "ttft_later_mean_s"),
            ("latency_speedup", "latency_request_mean_s"),
        ):
            r[ratio] = b[key] / r[key] if b[key] and r[key] else None
    return out


def ablate(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Load the model and stream, and run the parts ``args.parts`` asks for."""
    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.model.loader import load_model

    parts = set(args.parts)
    loaded = load_model(args.model, args.dtype, args.device)
    workflow = capped(load_workflow(args.workflow), args.agent_tokens or None)
    results: dict[str, Any] = {"parts": args.parts}
    if parts & {"a", "b", "c"}:
        reference = loaded if args.dtype == "fp32" else load_model(args.model, "fp32", args.device)
        stream = load_requests(args.requests, args.limit, split=args.split)
        runs = OnlineRuns(loaded, reference, workflow, stream, log)
        base = {"temperature": args.temperature}
        if "a" in parts:
            results["rank_pool"] = rank_pool_rows(runs, args.ranks, args.pool_sizes, **base)
        if "b" in parts:
            results["tau"] = tau_rows(runs, args.taus, **base)
        if "c" in parts:
            results["chain"] = chain_rows(runs, **base)
        results["baselines"] = runs.baseline_summaries()
    if "d" in parts:
        stream = load_requests(args.requests, args.warmup + args.scale_requests, split=args.split)
        wfs = [("agents", n, chain_workflow(n, args.output_tokens)) for n in args.agents]
        wfs += [("rounds", r, debate_workflow(r, 3, args.output_tokens)) for r in args.rounds]
        results["scale"] = scale_rows(loaded, wfs, stream, args.warmup, log)
    results["setup"] = common.setup(
        loaded,
        args.dtype,
        workflow=workflow.name,
        agent_tokens=args.agent_tokens or "workflow's own",
        stream=f"{args.requests}/{args.split} ({args.limit})",
        temperature=args.temperature,
        default_tau=DEFAULT_TAU,
        scale_requests=f"{args.warmup} warm-up + {args.scale_requests} measured",
        output_tokens_scale=args.output_tokens,
    )
    return results
