"""What a calibration runs: the grid of KVCMAS settings and the stream they run on.

Each grid point is one (T, r, tau): a full online run of KVCMAS with those options through the
real runner, so pools, use counts, eviction and chained sources are exactly the method's.
The default grid is the README's "Calibrated defaults" table; ``--quick`` is a smoke size.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.methods.kvcmas import DEFAULT_TAU, DEFAULT_TEMPERATURE
from kvcmas.workflow.spec import Workflow


@dataclass(frozen=True)
class GridPoint:
    """One KVCMAS setting; every other option keeps KVCMASConfig's default."""

    temperature: float
    rank: int | None  # delta rank r; None = full width
    tau: float

    @property
    def label(self) -> str:
        return f"T={self.temperature} r={self.rank or 'full'} tau={self.tau}"

    def options(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "rank": self.rank or 0, "tau": self.tau}


T, TAU = DEFAULT_TEMPERATURE, DEFAULT_TAU
# The README table: tau around the default at T=0.2, r=32; a lower rank; sharper matching.
DEFAULT_GRID = (
    GridPoint(T, 32, 0.98),
    GridPoint(T, 32, 0.99),
    GridPoint(T, 32, TAU),
    GridPoint(T, 32, 1.01),
    GridPoint(T, 8, TAU),
    GridPoint(0.05, 32, 1.01),
    GridPoint(0.005, 32, 1.01),
)
QUICK_GRID = (GridPoint(T, 32, TAU), GridPoint(T, 32, 1.01))


@dataclass(frozen=True)
class Plan:
    points: tuple[GridPoint, ...]
    workflow: str = "roster"
    requests: str = "mmlu"
    split: str = "validation"  # never the test split: defaults are chosen here
    limit: int = 30
    agent_tokens: int | None = None  # cap every agent's budget (None: the workflow's own)
    pool_size: int = 10

    def method_options(self, point: GridPoint) -> dict[str, Any]:
        return {**point.options(), "pool_size": self.pool_size}


QUICK = Plan(QUICK_GRID, limit=3, agent_tokens=8)


def parse_points(text: str) -> tuple[GridPoint, ...]:
    """``"0.2:32:0.995,0.2:full:1.01"`` -> grid points (rank ``full`` or 0: full width)."""
    points = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"grid point {item!r} is not T:r:tau")
        t, r, tau = parts
        try:
            rank = None if r in ("full", "0") else int(r)
            points.append(GridPoint(float(t), rank, float(tau)))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"grid point {item!r}: {e}") from None
    return tuple(points)


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan the flags ask for: ``--quick`` sizes first, explicit flags over them."""
    base = QUICK if args.quick else Plan(DEFAULT_GRID)
    plan = replace(
        base,
        points=args.points or base.points,
        workflow=args.workflow,
        requests=args.requests,
        split=args.split,
        limit=args.limit if args.limit is not None else base.limit,
        agent_tokens=args.agent_tokens if args.agent_tokens is not None else base.agent_tokens,
        pool_size=args.pool_size,
    )
    check(plan)
    return plan


def check(plan: Plan) -> None:
    """Refuse a plan that cannot run, before any model loads."""
    if plan.limit < 1:
        raise UsageError("--limit must be at least 1")
    if plan.pool_size < 1:
        raise UsageError("--pool-size must be at least 1")
    if plan.agent_tokens is not None and plan.agent_tokens < 1:
        raise UsageError("--agent-tokens must be at least 1")
    for p in plan.points:
        if p.temperature <= 0 or p.tau < 0 or (p.rank is not None and p.rank < 1):
            raise UsageError(f"grid point {p.label}: need T > 0, tau >= 0 and r >= 1 or full")
    if plan.split == "test":
        raise UsageError("calibrate on a held-out split (validation), never on test")


def capped(workflow: Workflow, max_new_tokens: int | None) -> Workflow:
    """``workflow`` with every agent's output budget at most ``max_new_tokens``."""
    if max_new_tokens is None:
        return workflow
    agents = tuple(
        replace(a, max_new_tokens=min(a.max_new_tokens, max_new_tokens)) for a in workflow.agents
    )
    return Workflow(workflow.name, agents, workflow.final)
