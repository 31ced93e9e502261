"""What a context sweep runs: the controlled trace workflow, the document sizes that fit the
model's context, the methods (NonShared first) and the warm-up / measured request counts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcmas.chat import render_segments
from kvcmas.errors import UsageError
from kvcmas.experiments.args import add_method_args, add_model_args
from kvcmas.experiments.common import choice_list, int_list
from kvcmas.methods import METHODS
from kvcmas.workflow.spec import AgentSpec, Workflow

DOC_SLOT = "doc"
ROLES = (
    (
        "reader",
        "You are a careful reader. You pick out what matters in long documents.",
        "Summarize the main points of the document.",
    ),
    (
        "analyst",
        "You are an analyst. You find patterns and connections between facts.",
        "Analyze the document, building on the notes above.",
    ),
    (
        "critic",
        "You are a skeptical critic who looks for mistakes and gaps.",
        "Point out errors or gaps in the notes above.",
    ),
    (
        "writer",
        "You are a writer. You turn notes into a clear final report.",
        "Write the final report.",
    ),
    (
        "checker",
        "You are a fact checker. You verify claims against the source.",
        "List any claim above that the document does not support.",
    ),
    (
        "editor",
        "You are an editor. You make reports correct and concise.",
        "Give the corrected final report in a few sentences.",
    ),
)


def trace_workflow(n_agents: int = 4, output_tokens: int = 128) -> Workflow:
    """A chain of ``n_agents``: each reads ``{doc}`` and every earlier agent's output."""
    if not 1 <= n_agents <= len(ROLES):
        raise ValueError(f"n_agents must be in 1..{len(ROLES)}")
    agents, earlier = [], []
    for name, system, instruction in ROLES[:n_agents]:
        notes = "".join(f"\n\nNotes from the {e}:\n{{{e}}}" for e in earlier)
        prompt = f"Document:\n{{{DOC_SLOT}}}{notes}\n\n{instruction}"
        agents.append(AgentSpec(name, system, prompt, output_tokens))
        earlier.append(name)
    return Workflow(name=f"trace{n_agents}", agents=tuple(agents), final=earlier[-1])


def overhead_tokens(tokenizer: Any, workflow: Workflow) -> int:
    """Largest, over agents, of the prompt tokens besides ``{doc}`` plus the new tokens, with
    every earlier output at its full budget."""
    worst = 0
    for agent in workflow.agents:
        slots = {s: (0,) * workflow.agent(s).max_new_tokens for s in agent.slots if s != DOC_SLOT}
        segs = render_segments(tokenizer, agent.system, agent.prompt, {DOC_SLOT: (), **slots})
        worst = max(worst, sum(len(s) for s in segs) + agent.max_new_tokens)
    return worst


def cap_sizes(sizes: list[int], limit: int) -> tuple[list[int], dict[int, int]]:
    """Sizes above ``limit`` become ``limit`` (once); returns the sizes and what was capped."""
    capped = {s: limit for s in sizes if s > limit}
    used = sorted({min(s, limit) for s in sizes})
    return used, capped


def method_order(methods: list[str]) -> list[str]:
    """NonShared first: every ratio is to it, at the same size."""
    return ["nonshared"] + [m for m in methods if m != "nonshared"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument(
        "--methods",
        type=choice_list(list(METHODS)),
        default=["nonshared", "fullshared", "kvcmas", "kvcomm"],
        help=f"comma-separated, from {', '.join(METHODS)}",
    )
    p.add_argument("--agents", type=int, default=4, help=f"chain length (2-{len(ROLES)})")
    p.add_argument("--output-tokens", type=int, default=128, help="tokens per agent output")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests (stateful methods)")
    p.add_argument("--measure", type=int, default=2, help="measured requests per size")
    p.add_argument("--source", default="mmlu", help="dataset whose questions make documents")
    p.add_argument(
        "--no-isolate",
        dest="isolate",
        action="store_false",
        help="run everything in this process (peak RSS then accumulates over runs)",
    )
    p.add_argument("--out", required=True)
    add_model_args(p)
    p.set_defaults(dtype="bf16")
    add_method_args(p)


def check_args(args: argparse.Namespace) -> None:
    if args.warmup < 0 or args.measure < 1 or args.output_tokens < 1:
        raise UsageError("need --warmup >= 0, --measure >= 1 and --output-tokens >= 1")
    if any(s < 1 for s in args.sizes):
        raise UsageError("sizes must be positive token counts")
    if not 2 <= args.agents <= len(ROLES):
        raise UsageError(f"--agents must be in 2..{len(ROLES)}")


def trace_fields(args, sizes: list[int]) -> dict:
    """The trace's sizes and shape, as every results setup of a trace experiment states them
    (the context sweep and the pareto share these flags)."""
    return {
        "sizes": sizes,
        "requested_sizes": args.sizes,
        "agents": args.agents,
        "output_tokens": args.output_tokens,
        "warmup_requests": args.warmup,
        "measured_requests": args.measure,
        "source": args.source,
    }


def smoke_args(out_dir: str | Path) -> list[str]:
    return [
        "--sizes", "32,64",
        "--warmup", "2",
        "--measure", "1",
        "--output-tokens", "8",
        "--out", str(out_dir),
    ]  # fmt: skip
