"""What an accuracy run covers: benchmarks, items per benchmark, methods in run order, budgets.

Methods run one after the other, NonShared first (its answers are the agreement reference)
and the bf16 noise floor last; a split run (``--without-nonshared``) leaves NonShared to
another part, merged later (:mod:`kvcmas.experiments.accuracy.merge`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcmas.errors import ConfigError, UsageError
from kvcmas.eval.tasks import TASKS
from kvcmas.experiments.args import (
    add_floor_gemm_arg,
    add_method_args,
    add_model_args,
    add_split_arg,
    method_options,
)
from kvcmas.experiments.common import choice_list
from kvcmas.experiments.compare import NOISE_FLOOR
from kvcmas.methods import METHODS, check_options_used, make_method

DEFAULT_LIMITS = {"mmlu": 60, "gsm8k": 60, "humaneval": 30}
DEFAULT_METHODS = "nonshared,fullshared,kvcmas,kvcomm"
TITLES = {"mmlu": "MMLU", "gsm8k": "GSM8K", "humaneval": "HumanEval"}


@dataclass(frozen=True)
class Run:
    """One method's pass over every benchmark: its table label, method name and dtype."""

    label: str
    method: str
    dtype: str


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    benchmarks: tuple[str, ...]
    limits: dict[str, int]
    runs: tuple[Run, ...]
    options: dict[str, Any]  # method options from flags / --method-config
    fidelity: bool
    budgets: tuple[int | None, int | None]  # (task agents, decision agent) caps
    floor_gemm: str = "bf16"  # the noise floor's matrix products (--floor-gemm)
    split: str = "test"  # where the items come from (--split)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--benchmarks", type=choice_list(list(TASKS)), default=list(TASKS), help="comma-separated"
    )
    p.add_argument(
        "--methods",
        type=choice_list(list(METHODS)),
        default=DEFAULT_METHODS.split(","),
        help="comma-separated; NonShared added",
    )
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
    p.add_argument(
        "--label",
        help="table label of the one method this part runs, e.g. kvcmas-head40 (so that parts "
        "of one method with different options merge as two rows)",
    )
    p.add_argument("--no-noise-floor", action="store_true", help="skip the NonShared-bf16 row")
    add_floor_gemm_arg(p)
    add_split_arg(p, "the items")
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


def plan_runs(
    methods: list[str],
    dtype: str,
    noise_floor: bool,
    with_nonshared: bool = True,
    label: str | None = None,
) -> list[Run]:
    """Runs in order: NonShared first, the noise floor (NonShared in bf16) last; ``label``
    names the one other method's row (see :func:`check_label`)."""
    runs = [Run("nonshared", "nonshared", dtype)] if with_nonshared else []
    runs += [Run(label or m, m, dtype) for m in methods if m != "nonshared"]
    if noise_floor and dtype == "fp32":
        runs.append(Run(NOISE_FLOOR, "nonshared", "bf16"))
    return runs


def check_label(label: str | None, methods: list[str]) -> None:
    """A ``--label`` names one method's row and must not pass for another row's name."""
    if label is None:
        return
    others = [m for m in methods if m != "nonshared"]
    if len(others) != 1:
        raise UsageError(f"--label names the one method a part runs; --methods gives {others}")
    if label in METHODS or label in (NOISE_FLOOR, "nonshared"):
        raise UsageError(f"--label {label!r} is another row's name; choose a new one")


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan of ``kvcmas bench accuracy``; bad sizes or options fail before any model loads."""
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    for flag in ("task_tokens", "final_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    for task in args.benchmarks:
        if args.split not in TASKS[task].splits:
            raise UsageError(
                f"{task} has no {args.split} split (it has: {', '.join(TASKS[task].splits)})"
            )
    check_label(args.label, args.methods)
    options = method_options(args)
    runs = plan_runs(
        args.methods, args.dtype, not args.no_noise_floor, not args.without_nonshared, args.label
    )
    names = sorted({r.method for r in runs})
    try:
        check_options_used(names, options)
        for name in names:
            make_method(name, options, strict=False)  # a bad option value fails here
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return Plan(
        model=args.model,
        dtype=args.dtype,
        benchmarks=tuple(args.benchmarks),
        limits={t: args.limit or DEFAULT_LIMITS[t] for t in args.benchmarks},
        runs=tuple(runs),
        options=options,
        fidelity=args.fidelity,
        budgets=(args.task_tokens, args.final_tokens),
        floor_gemm=args.floor_gemm,
        split=args.split,
    )
