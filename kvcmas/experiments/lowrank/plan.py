"""What the low-rank analysis measures: calibration requests for (source, dense) pairs, the
glue texts and questions of the prefix-induced deviations, and the long-segment threshold."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvcmas.experiments.args import add_model_args

GLUE_TEXTS = (
    "Notes from the solver:",
    "State the key facts needed to answer it, in two sentences.",
    "Point out any error in the notes above and give the corrected answer.",
    "Answer the question, building on the notes above. Reason step by step, check every "
    "step against the question, and finish with one line that states the final answer.",
)
LONG_SEGMENT = 64  # an n x D matrix has rank <= n: the delta claim is also read on long ones


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workflow", default="roster")
    p.add_argument("--requests", default="mmlu", help="JSONL file or dataset name")
    p.add_argument("--split", default="validation")
    p.add_argument("--limit", type=int, default=16, help="calibration requests for pairs")
    p.add_argument("--pf-questions", type=int, default=16, help="questions for PF deviations")
    p.add_argument("--out", required=True)
    add_model_args(p)


def smoke_args(out_dir: str | Path) -> list[str]:
    return ["--limit", "2", "--pf-questions", "2", "--out", str(out_dir)]
