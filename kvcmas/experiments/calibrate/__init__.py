"""``kvcmas bench calibrate``: how KVCMAS's temperature, rank and gate were chosen.

For each grid point (T, r, tau) KVCMAS runs online, through the real runner, on a calibration
stream (MMLU validation questions by default, never the test split): the method's own pools,
use counts, eviction and chained sources decide what is reused, exactly as in ``kvcmas run``.
Every point reports rho and the recompute fraction (all hops / hops 2+), the KV error of the
segments it reused relative to FullShared's on the same stream, first-token KL, final-answer
agreement with NonShared, and TTFT, end-to-end latency and compute beside NonShared's.

Pieces: :mod:`.plan` (grid and stream), :mod:`.runs` (online runs and their figures, shared
with the ablation), :mod:`.report` (table and plot).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcmas.experiments import common
from kvcmas.experiments.calibrate.plan import Plan, capped, parse_points, plan_from_args
from kvcmas.experiments.calibrate.report import markdown, plot
from kvcmas.experiments.calibrate.runs import OnlineRuns, run_grid

HELP = "choose KVCMAS's temperature, rank and gate threshold from online runs per grid point"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcmas.experiments.args import add_model_args

    p.add_argument(
        "--points",
        type=parse_points,
        default=None,
        help="grid points T:r:tau, comma-separated (r 'full' or 0: full width); "
        "default: the README table's seven",
    )
    p.add_argument("--quick", action="store_true", help="smoke size: 2 points, 3 requests")
    p.add_argument("--workflow", default="roster")
    p.add_argument("--requests", default="mmlu", help="JSONL file or dataset name")
    p.add_argument("--split", default="validation")
    p.add_argument("--limit", type=int, default=None, help="requests (default 30; quick 3)")
    p.add_argument(
        "--agent-tokens", type=int, default=None, help="cap every agent's new tokens (quick 8)"
    )
    p.add_argument("--pool-size", type=int, default=10, help="anchors per pool (V)")
    p.add_argument("--out", required=True)
    add_model_args(p)


def smoke_args(out_dir: str | Path) -> list[str]:
    return ["--quick", "--out", str(out_dir)]


def calibrate(
    plan: Plan, model: str, dtype: str, log: common.Progress, device: str = "cpu"
) -> dict[str, Any]:
    """Load the model and stream, run NonShared, FullShared and every grid point."""
    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.model.loader import load_model

    workflow = capped(load_workflow(plan.workflow), plan.agent_tokens)
    requests = load_requests(plan.requests, plan.limit, split=plan.split)
    loaded = load_model(model, dtype, device)
    reference = loaded if dtype == "fp32" else load_model(model, "fp32", device)
    runs = OnlineRuns(loaded, reference, workflow, requests, log)
    grid = run_grid(runs, plan)
    return {
        "setup": common.setup(
            loaded,
            dtype,
            workflow=workflow.name,
            requests=plan.requests,
            split=plan.split,
            limit=len(requests),
            agent_tokens=plan.agent_tokens or "workflow's own",
            pool_size=plan.pool_size,
            reference_dtype="fp32",
        ),
        "grid": grid,
        "baselines": runs.baseline_summaries(),
    }


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)  # bad input fails here, before any model loads
    log = common.Progress("calibrate")
    results = calibrate(plan, args.model, args.dtype, log, args.device)
    return common.finish(args.out, results, log, markdown, plot)
