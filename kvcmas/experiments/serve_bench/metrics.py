"""Figures of one cell: percentiles of TTFT, session latency and inter-token latency,
throughput, reuse, memory.

TTFT is the client's (request sent to first streamed token), split into the first hop (no
earlier agent in the session: nothing to reuse but the document's own prefix) and later hops.
p99 is reported only where a cell has :data:`P99_MIN_SAMPLES` samples or more. Reuse is the one
definition (:class:`~kvcmas.methods.base.ReuseCounts`) summed over hops 2+, from the
connector's build records as ``kvcmas run --engine vllm`` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcmas.methods.base import ReuseCounts

P99_MIN_SAMPLES = 100


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is in 0..100, got {q}")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict[str, Any]:
    """``n``, ``p50``, ``p95`` and ``p99`` (None where too few samples to mean anything)."""
    n = len(values)
    return {
        "n": n,
        "p50": percentile(values, 50) if n else None,
        "p95": percentile(values, 95) if n else None,
        "p99": percentile(values, 99) if n >= P99_MIN_SAMPLES else None,
    }


@dataclass
class SessionRecord:
    """One session of a cell as the load generator saw it (times from the cell's start)."""

    index: int
    arrival_s: float  # scheduled
    hops: list = field(default_factory=list)  # EngineHopResult, in order
    start_s: float | None = None
    end_s: float | None = None
    complete: bool = False
    error: str | None = None

    @property
    def latency_s(self) -> float | None:
        if not self.complete or self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s


def prometheus_value(text: str, name: str) -> float | None:
    """The largest sample of metric ``name`` in Prometheus text (any labels), or None."""
    found = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            found = value if found is None else max(found, value)
    return found


def cell_summary(records: list[SessionRecord], wall_s: float) -> dict[str, Any]:
    """The cell's figures from its sessions (completed hops of truncated sessions count in
    TTFT and reuse; only completed sessions in session latency)."""
    first = [r.hops[0].ttft_s for r in records if r.hops]
    later_hops = [h for r in records for h in r.hops[1:]]
    reuse = sum((h.reuse for h in later_hops), ReuseCounts())
    latencies = [r.latency_s for r in records if r.latency_s is not None]
    done = [r for r in records if r.complete]
    output_tokens = sum(h.output_tokens for r in records for h in r.hops)
    return {
        "sessions_launched": len(records),
        "sessions_completed": len(done),
        "sessions_failed": sum(r.error is not None for r in records),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "hops": len(first) + len(later_hops),
        "ttft_first_s": distribution(first),
        "ttft_later_s": distribution([h.ttft_s for h in later_hops]),
        "ttft_all_s": distribution(first + [h.ttft_s for h in later_hops]),
        "session_latency_s": distribution(latencies),
        # Decode stalls: every gap between streamed tokens of every hop, and each hop's time
        # per output token (a build in an engine step stalls every request decoding then).
        "itl_s": distribution([g for r in records for h in r.hops for g in h.itl_s]),
        "tpot_s": distribution([h.tpot_s for r in records for h in r.hops
                                if h.tpot_s is not None]),  # fmt: skip
        "wall_s": wall_s,
        "sessions_per_s": len(done) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "rho_later": reuse.rho,
        "recompute_later": reuse.recompute_fraction,
        "shared_tokens_later": reuse.shared_tokens,
        "served_tokens_later": reuse.served_tokens,
        # Hops whose connector log the client could not find (plain vLLM has none to find).
        "unlogged_hops": sum(h.claimed_tokens is None for r in records for h in r.hops),
    }
