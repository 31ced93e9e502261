"""``kvcmas bench accuracy``: strict task accuracy of every method on the task rosters.

Per method and benchmark (MMLU, GSM8K, HumanEval, each through its roster of
:mod:`kvcmas.eval.tasks`): strict accuracy, agreement of the extracted final answer with
NonShared on the same item, rho beside the recompute fraction, TTFT beside end-to-end latency
and compute seconds (all hops and hops 2+), peak state and process peak RSS, method state.
The noise-floor row is NonShared in bf16, scored and compared with NonShared in fp32
(METHOD.md section 2, rule 6). Decoding is greedy. Every method runs on the same model,
requests and system-prefix caches, NonShared first.

Pieces: :mod:`.plan` (what runs), :mod:`.runs` (running and scoring), :mod:`.merge` (split
runs), :mod:`.report` (tables and plot).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcmas.experiments.accuracy.merge import merge_reports, read_parts
from kvcmas.experiments.accuracy.plan import add_arguments, plan_from_args, smoke_args
from kvcmas.experiments.accuracy.report import markdown_table, write_outputs
from kvcmas.experiments.accuracy.runs import accuracy_experiment

__all__ = ["HELP", "add_arguments", "run", "smoke_args"]

HELP = "strict accuracy and answer agreement per method on the MMLU/GSM8K/HumanEval rosters"


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.merge:
        report = merge_reports(read_parts(args.merge))
    else:
        plan = plan_from_args(args)
        out.mkdir(parents=True, exist_ok=True)
        report = accuracy_experiment(
            plan,
            log=lambda m: print(m, file=sys.stderr, flush=True),
            on_update=lambda r: (out / "results.json").write_text(json.dumps(r, indent=1)),
            device=args.device,
        )
    write_outputs(report, out)
    print(markdown_table(report))
    return 0
