"""What the load generator replays: four-agent chain sessions, their documents, their arrivals.

One session is one document of exactly S tokens run through the context sweep's trace
workflow (:func:`~kvcmas.experiments.context_sweep.plan.trace_workflow`: every agent reads the
document and every earlier agent's output), hops in order. Every session of a run has its own
document, so plain vLLM's (unsalted) prefix cache never serves one session's document to
another; each size cuts its documents from its own slice of the source texts for the same
reason. Every method replays the same sessions with the same arrival times.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.experiments.context_sweep.documents import documents
from kvcmas.experiments.context_sweep.plan import DOC_SLOT, overhead_tokens
from kvcmas.workflow.spec import Workflow


def poisson_arrivals(rate_per_s: float, count: int, seed: int | str) -> list[float]:
    """Arrival times (s, the first at 0) of ``count`` sessions of a Poisson process of
    ``rate_per_s``: exponential gaps of mean ``1 / rate_per_s`` from a seeded generator."""
    if rate_per_s <= 0:
        raise ValueError(f"an arrival rate must be positive, got {rate_per_s}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate_per_s)
        times.append(t)
    return times


def arrivals_within(arrivals: list[float], time_limit_s: float) -> int:
    """How many of ``arrivals`` (ascending, s from the cell's start) a cell with this time
    limit sends: those up to the first arrival past it. The cell and the warning before it
    both count with this."""
    if any(b < a for a, b in itertools.pairwise(arrivals)):
        raise ValueError("arrival times must be in ascending order")
    return bisect.bisect_right(arrivals, time_limit_s)


def cell_seed(seed: int, size: int, load: float) -> str:
    """The arrival seed of one (S, load) cell: the same for every method, distinct per cell."""
    return f"{seed}:{size}:{load:g}"


@dataclass
class SizeDocuments:
    """The documents of one size, by use: warm-up sessions, idle sessions and capacity probes
    (plain vLLM only), then one block per load. Cells of every method take the same block."""

    warmup: list[str]
    idle: list[str]
    probes: list[str]
    cells: dict[float, list[str]] = field(default_factory=dict)


def session_requests(docs: list[str], label: str) -> list[dict[str, Any]]:
    return [{"id": f"{label}-{i}", DOC_SLOT: doc} for i, doc in enumerate(docs)]


def check_sizes_fit(tokenizer: Any, workflow: Workflow, sizes: list[int], context: int) -> None:
    """Every hop of every size must fit the model's context (its outputs at full length)."""
    overhead = overhead_tokens(tokenizer, workflow)
    too_long = [s for s in sizes if s + overhead > context]
    if too_long:
        raise UsageError(
            f"--sizes {','.join(map(str, too_long))}: a document of S tokens plus the trace's "
            f"{overhead} other tokens (prompts and outputs) exceeds the model's context of "
            f"{context}; the largest S that fits is {context - overhead}"
        )


def size_documents(
    tokenizer: Any,
    texts: list[str],
    sizes: list[int],
    counts: dict[int, tuple[int, int, int]],
    loads: list[float],
    sessions: int,
) -> dict[int, SizeDocuments]:
    """Documents per size: ``counts[S] = (warmup, idle, probes)``, then ``sessions`` per load.

    Each size cuts from its own slice of ``texts``, sized in proportion to the tokens it needs,
    so no two sessions of a run share a document or its beginning."""
    need = {s: sum(counts[s]) + sessions * len(loads) for s in sizes}
    total = sum(s * n for s, n in need.items())
    out, pos = {}, 0
    for s in sizes:
        end = pos + len(texts) * s * need[s] // total
        try:
            docs = documents(tokenizer, texts[pos:end], s, need[s])
        except ValueError as err:
            raise UsageError(
                f"the source has too little text for {need[s]} distinct documents of {s} "
                f"tokens ({err}): ask for fewer --sessions, --loads or --sizes"
            ) from None
        pos = end
        warmup, idle, probes = counts[s]
        taken = iter(docs)
        block = [[next(taken) for _ in range(n)] for n in (warmup, idle, probes)]
        cells = {load: [next(taken) for _ in range(sessions)] for load in loads}
        out[s] = SizeDocuments(*block, cells=cells)
    return out
