"""``kvcmas bench ablation``: KVCMAS's knobs one at a time.

* **(a) rank r and pool size V**: online runs on the calibration stream (MMLU validation by
  default), each rank at V=10 and each pool size at r=32 (r is the rank of bases and deltas):
  rho, recompute, KV error of reused segments over FullShared's, pool bytes.
* **(b) gate threshold tau**: online runs of several tau on the same stream.
* **(c) chained vs non-chained** (``chain=False``: a context-free reference prefill is the
  base of a query), online runs.
* **(d) scale**: nonshared vs kvcmas as the number of agents grows (roster-style chains) and as
  debate rounds grow (three debaters): TTFT, latency, compute, rho, measured after
  ``--warmup`` requests that fill the pools.

Nothing is replayed: (a)-(c) run the method as it runs live
(:class:`~kvcmas.experiments.calibrate.runs.OnlineRuns`). Pieces: :mod:`.plan` (parts, knobs,
workflows, checks), :mod:`.runs`, :mod:`.report` (tables, plots).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvcmas.experiments import common
from kvcmas.experiments.ablation.plan import PARTS, check_args
from kvcmas.experiments.ablation.report import markdown, plot
from kvcmas.experiments.ablation.runs import ablate
from kvcmas.methods.kvcmas import DEFAULT_TAU, DEFAULT_TEMPERATURE

HELP = "KVCMAS ablations: rank and pool size, gate threshold, chaining, agents and rounds"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcmas.experiments.args import add_model_args

    p.add_argument("--parts", type=common.str_list, default=list(PARTS), help="a,b,c,d")
    p.add_argument("--workflow", default="roster", help="workflow of parts a-c")
    p.add_argument(
        "--agent-tokens",
        type=int,
        default=32,
        help="cap agents' output budgets (parts a-c; 0: the workflow's own)",
    )
    p.add_argument("--requests", default="mmlu", help="stream of every part: file or dataset")
    p.add_argument("--split", default="validation", help="split of the stream")
    p.add_argument("--limit", type=int, default=12, help="requests of parts a-c")
    p.add_argument("--ranks", type=common.rank_list, default=[4, 8, 16, 32, None])
    p.add_argument("--pool-sizes", type=common.int_list, default=[2, 5, 10, 20])
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    p.add_argument("--taus", type=common.float_list, default=[0.5, 0.9, 0.98, DEFAULT_TAU, 1.01])
    p.add_argument("--agents", type=common.int_list, default=[2, 3, 4, 6])
    p.add_argument("--rounds", type=common.int_list, default=[1, 2, 3])
    p.add_argument("--warmup", type=int, default=2, help="(d) warm-up requests")
    p.add_argument("--scale-requests", type=int, default=1, help="(d) measured requests")
    p.add_argument("--output-tokens", type=int, default=24, help="(d) tokens per agent")
    p.add_argument("--out", required=True)
    add_model_args(p)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    log = common.Progress("ablation")
    results = ablate(args, log)
    return common.finish(args.out, results, log, markdown, plot)


def smoke_args(out_dir: str | Path) -> list[str]:
    return [
        "--agent-tokens", "8",
        "--limit", "2",
        "--ranks", "8,32",
        "--pool-sizes", "2,10",
        "--taus", "1.01",
        "--agents", "2,3",
        "--rounds", "1,2",
        "--warmup", "0",
        "--output-tokens", "8",
        "--out", str(out_dir),
    ]  # fmt: skip


__all__ = ["HELP", "add_arguments", "check_args", "run", "smoke_args"]
