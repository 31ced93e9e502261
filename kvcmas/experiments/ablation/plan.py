"""What the ablation runs: its parts, knob values, the scale workflows, and input checks."""

from __future__ import annotations

import argparse
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.methods.kvcmas import DEFAULT_TAU, DEFAULT_TEMPERATURE, KVCMASConfig
from kvcmas.workflow.builtin import roster
from kvcmas.workflow.spec import AgentSpec, Workflow

PARTS = ("a", "b", "c", "d")
DEFAULT_RANK = KVCMASConfig().rank  # 32
DEFAULT_POOL = KVCMASConfig().pool_size  # 10
ROLE_POOL = (
    ("analyst", "You are a precise analyst. You identify what a question is really asking."),
    ("solver", "You are a careful problem solver who reasons step by step."),
    ("checker", "You are a skeptical reviewer who looks for mistakes."),
    ("expert", "You are a domain expert. You recall the facts a question depends on."),
    ("planner", "You are a planner. You outline how to approach a question."),
)
DECIDER = (
    "decider",
    "You are the final decision maker. You weigh the team's notes and answer.",
    "Give the final answer in one or two sentences.",
)


def kvcmas_options(
    rank: int | None = DEFAULT_RANK,
    pool_size: int = DEFAULT_POOL,
    tau: float = DEFAULT_TAU,
    chain: bool = True,
    temperature: float = DEFAULT_TEMPERATURE,
) -> dict[str, Any]:
    """A full KVCMAS option set (r is the rank of bases and deltas; None: full width), so
    that equal settings of different parts get the same label and run once."""
    r = rank or 0
    return {
        "rank": r,
        "base_rank": r,
        "pool_size": pool_size,
        "tau": tau,
        "chain": chain,
        "temperature": temperature,
    }


def label(options: dict[str, Any]) -> str:
    o = options
    return (
        f"kvcmas r={o['rank'] or 'full'} V={o['pool_size']} tau={o['tau']} "
        f"T={o['temperature']}" + ("" if o["chain"] else " no-chain")
    )


def chain_workflow(n_agents: int, output_tokens: int) -> Workflow:
    """``n_agents`` in order (the last one decides); each reads the query and every earlier
    output: :func:`kvcmas.workflow.builtin.roster` with ``n_agents - 1`` task agents."""
    if not 2 <= n_agents <= len(ROLE_POOL) + 1:
        raise ValueError(f"n_agents must be in 2..{len(ROLE_POOL) + 1}")
    roles = tuple(
        (name, system, "Answer the question, building on any notes above.")
        for name, system in ROLE_POOL[: n_agents - 1]
    )
    return roster(f"chain{n_agents}", roles, DECIDER, output_tokens, output_tokens)


def debate_workflow(rounds: int, debaters: int = 3, output_tokens: int = 32) -> Workflow:
    """``debaters`` answer in each of ``rounds`` rounds; from round 2 every debater reads the
    question and all answers of the previous round. The last debater of the last round is
    the final agent."""
    if rounds < 1 or not 1 <= debaters <= len(ROLE_POOL):
        raise ValueError(f"need rounds >= 1 and 1..{len(ROLE_POOL)} debaters")
    agents = []
    for r in range(1, rounds + 1):
        for name, system in ROLE_POOL[:debaters]:
            earlier = "".join(
                f"\n\nAnswer of the {d} in round {r - 1}:\n{{{d}_r{r - 1}}}"
                for d, _ in (ROLE_POOL[:debaters] if r > 1 else ())
            )
            ask = "Answer the question." if r == 1 else "Considering these answers, answer again."
            prompt = f"Question:\n{{query}}{earlier}\n\n{ask}"
            agents.append(AgentSpec(f"{name}_r{r}", system, prompt, output_tokens))
    return Workflow(f"debate{rounds}x{debaters}", tuple(agents), agents[-1].name)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags before any model loads."""
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        raise UsageError(f"unknown part(s) {', '.join(bad)}: choose from {', '.join(PARTS)}")
    if any(v < 1 for v in args.pool_sizes) or any(r is not None and r < 1 for r in args.ranks):
        raise UsageError("ranks and pool sizes must be positive (rank 'full' or 0: full)")
    if any(t < 0 for t in args.taus) or args.limit < 1:
        raise UsageError("taus must be >= 0 and --limit at least 1")
    if any(not 2 <= n <= len(ROLE_POOL) + 1 for n in args.agents):
        raise UsageError(f"--agents values must be in 2..{len(ROLE_POOL) + 1}")
    if any(r < 1 for r in args.rounds) or args.scale_requests < 1 or args.warmup < 0:
        raise UsageError("need rounds >= 1, --scale-requests >= 1 and --warmup >= 0")
