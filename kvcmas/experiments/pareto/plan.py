"""What a pareto run covers: sizes, the trace workflow, and each method's knob points.

Each method runs over at most ``--max-points`` points of its own knob (KVCMAS: tau and the
graded-repair budget; CacheBlend: ratio; head recompute: k; DroidSpeak: its layer block;
GraphFlow: its sparse residual's tokens per path); FullShared, KVCOMM and NonShared are single
points, and NonShared in bf16 is the noise floor.
The workflow is the context sweep's trace (every agent reads the shared document and every
earlier output); documents are cut from a packaged dataset's questions by the context sweep's
builder (:mod:`kvcmas.experiments.context_sweep.documents`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcmas.errors import ConfigError, UsageError
from kvcmas.experiments.args import add_floor_gemm_arg, add_model_args, add_split_arg
from kvcmas.experiments.common import choice_list, int_list
from kvcmas.experiments.compare import NOISE_FLOOR
from kvcmas.experiments.context_sweep.plan import ROLES
from kvcmas.methods import make_method
from kvcmas.methods.kvcmas import LONG_CONTEXT

MAX_POINTS = 6

# Knob ranges, cheapest repair first. KVCMAS at tau 1 reuses whenever anchors exist and lets
# the repair budget grade with the gate's entropy; tau 0.995 with no repair is round 1's default,
# then the long-context point and a shorter head (head selection), then deviation scoring.
# Ordered so that fewer --max-points keep round 1's default, a head point and the largest.
KNOBS: dict[str, list[dict[str, Any]]] = {
    "nonshared": [{}],
    "fullshared": [{}],
    "kvcomm": [{}],
    "kvcmas": [
        {"tau": 0.995, "repair_max": 0.0},
        LONG_CONTEXT,
        {**LONG_CONTEXT, "repair_max": 0.05, "repair_head": 32},
        {"tau": 1.0, "repair_max": 0.1},
        {"tau": 1.0, "repair_max": 0.25},
        {"tau": 1.0, "repair_max": 0.5},
    ],
    "cacheblend": [{"ratio": r} for r in (0.05, 0.1, 0.15, 0.3, 0.5)],
    "headrecompute": [{"head_tokens": k} for k in (4, 16, 64, 128, 256)],
    # DroidSpeak blocks as fractions of the depth: resolved once the model is loaded.
    "droidspeak": [{"block": f} for f in ((0.2, 0.93), (0.3, 0.8), (0.4, 0.7), (0.45, 0.6))],
    "graphflow": [{"residual_topk": k} for k in (16, 0, 64)],  # its default first
}
DEFAULT_METHODS = list(KNOBS)


@dataclass(frozen=True)
class Point:
    """One method at one knob setting; ``label`` names it in tables and plots."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)
    dtype: str = "fp32"

    @property
    def label(self) -> str:
        if self.method == "nonshared" and self.dtype == "bf16":
            return NOISE_FLOOR
        knobs = ",".join(f"{k}={_fmt(v)}" for k, v in self.options.items())
        return f"{self.method}({knobs})" if knobs else self.method


def _fmt(v: Any) -> str:
    return ":".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def resolve(options: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """DroidSpeak's fractional block as layer numbers ``S:E`` of this model."""
    if "block" in options and isinstance(options["block"], tuple):
        s, e = (round(f * n_layers) for f in options["block"])
        return {**options, "block": f"{s}:{max(s, e)}"}
    return options


def parse_point(text: str) -> tuple[str, dict[str, str]]:
    """``--point METHOD:key=value,...``: one knob point of a method, given explicitly."""
    method, _, knobs = text.partition(":")
    if method not in KNOBS:
        raise UsageError(f"--point {text!r}: unknown method {method!r} (from {', '.join(KNOBS)})")
    options = {}
    for item in filter(None, knobs.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--point {text!r}: expected key=value, got {item!r}")
        options[key.strip()] = value.strip()
    return method, options


def plan_points(
    methods: list[str],
    n_layers: int,
    max_points: int,
    given: Sequence[tuple[str, dict[str, Any]]] = (),
) -> list[Point]:
    """NonShared first (the reference of every ratio), then each method's knob points; a
    method with ``given`` points (``--point``) runs exactly those, all of them, instead of its
    grid (``max_points`` caps a grid, never what was asked for by name)."""
    if not 1 <= max_points <= MAX_POINTS:
        raise UsageError(f"--max-points must be in 1..{MAX_POINTS}")
    order = ["nonshared"] + [m for m in methods if m != "nonshared"]
    order += [m for m, _ in given if m not in order]
    points = []
    for m in order:
        grid = [o for g, o in given if g == m] or _capped(KNOBS[m], max_points)
        points += [Point(m, resolve(o, n_layers)) for o in grid]
    return points


def _capped(grid: list[dict[str, Any]], max_points: int) -> list[dict[str, Any]]:
    """At most ``max_points`` of a grid: its ends kept and the rest spread evenly."""
    if len(grid) <= max_points:
        return grid
    step = (len(grid) - 1) / max(1, max_points - 1)
    return [grid[round(i * step)] for i in range(max_points)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=[512, 1024, 2048], help="document tokens")
    p.add_argument(
        "--methods", type=choice_list(DEFAULT_METHODS), default=DEFAULT_METHODS,
        help=f"comma-separated, from {', '.join(DEFAULT_METHODS)} (NonShared always runs)",
    )  # fmt: skip
    p.add_argument("--max-points", type=int, default=MAX_POINTS, help="knob points per method")
    p.add_argument(
        "--point", dest="points", action="append", type=parse_point, default=[],
        metavar="METHOD:K=V,...", help="run this knob point (repeatable); a method given "
        "points runs only those, e.g. kvcmas:tau=1.0,repair_max=0.1,repair_head=64",
    )  # fmt: skip
    p.add_argument("--agents", type=int, default=4, help=f"chain length (2-{len(ROLES)})")
    p.add_argument("--output-tokens", type=int, default=128, help="tokens per agent output")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests (stateful methods)")
    p.add_argument("--measure", type=int, default=8, help="measured requests per size")
    p.add_argument("--source", default="mmlu", help="dataset whose questions make documents")
    add_split_arg(p, "the source's questions")
    p.add_argument("--no-timing", action="store_true", help="fidelity pass only")
    p.add_argument(
        "--no-fidelity", action="store_true",
        help="timing pass only: --merge joins it with a --no-timing part of the same points",
    )  # fmt: skip
    p.add_argument("--no-noise-floor", action="store_true", help="skip the NonShared-bf16 point")
    p.add_argument(
        "--resume", action="store_true",
        help="with --no-timing: keep the points --out's earlier run finished (a run stopped "
        "early saves each), run the rest",
    )  # fmt: skip
    add_floor_gemm_arg(p)
    p.add_argument(
        "--rerender", action="store_true",
        help="run nothing: rewrite --out's table and plots from its results.json",
    )  # fmt: skip
    p.add_argument(
        "--merge", nargs="+", metavar="DIR",
        help="run nothing: merge these runs' results.json (parts on the same documents) into "
        "--out, one frontier plot per size over every part's methods",
    )  # fmt: skip
    p.add_argument(
        "--timing-from", metavar="DIR",
        help="with --merge: every point's timing from this --no-fidelity run (one machine and "
        "dtype for all); the merged parts give only their fidelity",
    )  # fmt: skip
    p.add_argument("--out", required=True)
    add_model_args(p)
    p.set_defaults(dtype="bf16")  # the timing pass; fidelity is always fp32


def check_args(args: argparse.Namespace) -> None:
    """Bad sizes, counts or knob values fail before any model loads."""
    if args.warmup < 0 or args.measure < 1 or args.output_tokens < 1:
        raise UsageError("need --warmup >= 0, --measure >= 1 and --output-tokens >= 1")
    if not args.sizes or any(s < 1 for s in args.sizes):
        raise UsageError("--sizes must be positive token counts")
    if args.timing_from and not args.merge:
        raise UsageError("--timing-from re-times a --merge: give the parts with --merge")
    if args.no_timing and args.no_fidelity:
        raise UsageError("--no-timing and --no-fidelity together leave nothing to run")
    if args.resume and (not args.no_timing or args.merge or args.rerender):
        raise UsageError(
            "--resume goes on with a fidelity pass: give --no-timing (a timing pass runs whole,"
            " its rounds interleaved), not --merge or --rerender"
        )
    if not 2 <= args.agents <= len(ROLES):
        raise UsageError(f"--agents must be in 2..{len(ROLES)}")
    try:
        for point in plan_points(args.methods, 30, args.max_points, args.points):
            make_method(point.method, point.options)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def smoke_args(out_dir: str | Path) -> list[str]:
    return [
        "--sizes", "64",
        "--methods", "nonshared,kvcmas,cacheblend,headrecompute",
        "--max-points", "2",
        "--warmup", "1",
        "--measure", "1",
        "--output-tokens", "8",
        "--out", str(out_dir),
    ]  # fmt: skip
