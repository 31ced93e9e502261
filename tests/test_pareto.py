"""``kvcmas bench pareto``: the frontier computation and the plan's validation (no model)."""

from __future__ import annotations

import argparse

import pytest

from kvcmas.errors import UsageError
from kvcmas.experiments.pareto.plan import (
    KNOBS,
    MAX_POINTS,
    NOISE_FLOOR,
    Point,
    add_arguments,
    check_args,
    plan_points,
)
from kvcmas.experiments.pareto.report import frontier, frontiers


def test_frontier_keeps_exactly_the_undominated_points():
    # (speedup, KL): point 1 beats point 3 on both axes; point 5 has no speed.
    pts = [(1.0, 0.0), (3.0, 0.01), (2.0, 0.005), (2.5, 0.02), (4.0, 0.05), (None, 0.0)]
    assert frontier(pts) == [4, 1, 2, 0]
    assert frontier([(2.0, 0.1), (2.0, 0.1)]) == [0, 1]  # equal points do not beat each other
    assert frontier([(1.0, 0.1), (1.0, 0.2)]) == [0]  # as fast and closer: beaten
    assert frontier([]) == []


def test_frontiers_are_per_method():
    rows = [
        {"method": "a", "label": "a1", "x": 2.0, "first_token_kl": 0.1},
        {"method": "a", "label": "a2", "x": 1.0, "first_token_kl": 0.2},
        {"method": "b", "label": "b1", "x": 1.0, "first_token_kl": 0.2},
    ]
    assert frontiers(rows, "x") == {"a": ["a1"], "b": ["b1"]}


def test_plan_points_nonshared_first_within_the_point_cap():
    points = plan_points(["cacheblend", "kvcmas", "droidspeak"], 30, 3)
    assert points[0] == Point("nonshared")
    per_method = {m: [p for p in points if p.method == m] for m in ("kvcmas", "droidspeak")}
    assert all(len(v) == 3 for v in per_method.values())
    kv = per_method["kvcmas"]
    assert kv[0].options == KNOBS["kvcmas"][0] and kv[-1].options == KNOBS["kvcmas"][-1]
    assert per_method["droidspeak"][0].options == {"block": "6:28"}  # fractions of 30 layers
    assert Point("nonshared", dtype="bf16").label == NOISE_FLOOR
    assert all(len(v) <= MAX_POINTS for v in KNOBS.values())


def test_given_points_replace_a_methods_grid():
    args = parse("--methods", "kvcmas,cacheblend", "--max-points", "2", "--point",
                 "kvcmas:tau=1.0,repair_head=64", "--point", "headrecompute:head_tokens=8")
    check_args(args)
    points = plan_points(args.methods, 30, args.max_points, args.points)
    assert [p.label for p in points if p.method in ("kvcmas", "headrecompute")] == [
        "kvcmas(tau=1.0,repair_head=64)", "headrecompute(head_tokens=8)"]
    assert len([p for p in points if p.method == "cacheblend"]) == 2  # its grid, capped


@pytest.mark.parametrize(
    "point, message",
    [("kvcmass:tau=1", "unknown method 'kvcmass'"), ("kvcmas:tau", "expected key=value"),
     ("kvcmas:taux=1", "taux")],
)
def test_a_bad_point_is_refused_by_name(point, message):
    with pytest.raises(UsageError, match=message):
        check_args(parse("--point", point))


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--out", "x", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--measure", "0"), "measure"),
        (("--sizes", "0"), "sizes"),
        (("--agents", "9"), "agents"),
        (("--max-points", "7"), "max-points"),
    ],
)
def test_check_args_refuses_bad_plans(argv, message):
    with pytest.raises(UsageError, match=message):
        check_args(parse(*argv))


def test_check_args_accepts_the_defaults_and_unknown_methods_fail_in_parsing():
    args = parse()
    check_args(args)
    assert args.dtype == "bf16" and args.warmup == 4 and args.measure == 8
    with pytest.raises(SystemExit):
        parse("--methods", "nosuch")
