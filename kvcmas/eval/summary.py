"""The figures every table reports for a method's run, defined once.

Each figure is given over **all hops** and over **hops 2+** (``later``): hop 1 is dense for
every method but KVCOMM, whose first consumer pays a reference prefill and reads an inexact
query, so its cost shows in the all-hop figures. Reuse is ``rho`` with the recompute fraction
beside it (:class:`~kvcmas.methods.base.ReuseCounts`); a TTFT always comes with the request's
end-to-end latency, its background seconds and the compute seconds (process CPU time), so
that no saving can hide a cost moved elsewhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from kvcmas.methods.base import ReuseCounts
from kvcmas.workflow.records import HopResult, RequestResult

HOP_SETS = ("all", "later")


def mean(xs: Iterable[float | None]) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def hop_sets(results: list[RequestResult]) -> dict[str, list[HopResult]]:
    return {
        "all": [h for r in results for h in r.hops],
        "later": [h for r in results for h in r.hops[1:]],
    }


def reuse_counts(hops: Iterable[HopResult]) -> ReuseCounts:
    return sum((h.reuse for h in hops), ReuseCounts())


def run_summary(results: list[RequestResult]) -> dict[str, Any]:
    """Timing, reuse and memory figures of a run (no reference needed)."""
    sets = hop_sets(results)
    out: dict[str, Any] = {"requests": len(results), "hops": len(sets["all"])}
    for name, hops in sets.items():
        counts = reuse_counts(hops)
        out[f"ttft_{name}_mean_s"] = mean(h.ttft_s for h in hops)
        out[f"ttft_{name}_median_s"] = median(h.ttft_s for h in hops)
        out[f"rho_{name}"] = counts.rho
        out[f"recompute_{name}"] = counts.recompute_fraction
    out["reuse_calls_later"] = mean(
        float(s["decision"] != "dense")
        for h in sets["later"]
        for s in h.segments
        if s["kind"] != "private"
    )
    # KVCMAS with check_on_head: how often the head check kept a span's correction.
    kept = [
        s["details"]["correction_kept"]
        for h in sets["later"]
        for s in h.segments
        if "correction_kept" in s.get("details", {})
    ]
    if kept:
        out["corrections_checked_later"] = len(kept)
        out["corrections_kept_later"] = sum(kept) / len(kept)
    per_agent: dict[str, list[float]] = {}
    for h in sets["later"]:
        per_agent.setdefault(h.agent, []).append(h.ttft_s)
    out["ttft_per_agent_s"] = {a: mean(v) for a, v in per_agent.items()}
    out["latency_request_mean_s"] = mean(r.latency_s for r in results)
    out["background_request_mean_s"] = mean(r.background_s for r in results)
    # A client of a serving engine sees no compute, KV or RSS of the server: None there.
    cpu = [r.cpu_s for r in results]
    out["compute_s"] = None if None in cpu else sum(cpu)
    out["compute_request_mean_s"] = mean(cpu)
    outputs = [h.output_tokens for h in sets["all"]]
    out["output_tokens_mean"] = mean(outputs)
    out["prompt_tokens_later_mean"] = mean(h.prompt_tokens for h in sets["later"])
    if sets["all"] and sets["all"][0].kv_bytes is not None:
        out["peak_state_bytes"] = max(
            h.kv_bytes + h.source_bytes + h.method_state_bytes for h in sets["all"]
        )
        out["method_state_bytes"] = sets["all"][-1].method_state_bytes
        out["peak_rss_bytes"] = max(h.peak_rss_bytes for h in sets["all"])
    return out


RATIO_KEYS = {
    "ttft_later_ratio": "ttft_later_mean_s",
    "ttft_all_ratio": "ttft_all_mean_s",
    "latency_ratio": "latency_request_mean_s",
    "compute_ratio": "compute_request_mean_s",
}


def add_ratios(summaries: dict[str, dict[str, Any]], baseline: str = "nonshared") -> None:
    """Each method's TTFT, latency and compute over the baseline's (below 1 is faster)."""
    if baseline not in summaries:
        return
    base = summaries[baseline]
    for s in summaries.values():
        for ratio, key in RATIO_KEYS.items():
            a, b = s.get(key), base.get(key)
            s[ratio] = a / b if a is not None and b else None


def fidelity_summary(results: list[RequestResult], n_layers: int) -> dict[str, Any]:
    """KV error and KL over all hops and hops 2+ (every hop must carry fidelity)."""
    out: dict[str, Any] = {}
    for name, hops in hop_sets(results).items():
        fid = [h.fidelity for h in hops]
        out[f"kv_error_{name}_mean"] = mean(f["kv_rel_error"] for f in fid)
        out[f"first_token_kl_{name}_mean"] = mean(f["first_token_kl"] for f in fid)
        out[f"first_token_kl_{name}_median"] = median(f["first_token_kl"] for f in fid)
        out[f"continuation_kl_{name}_mean"] = mean(f["continuation_kl"] for f in fid)
        out[f"same_hop_output_{name}"] = mean(float(f["same_output"]) for f in fid)
    later = [h.fidelity for h in hop_sets(results)["later"]]
    for kv in ("k", "v"):
        key = f"{kv}_rel_error_per_layer"
        out[f"{kv}_error_per_layer"] = [mean(f[key][i] for f in later) for i in range(n_layers)]
    return out


def agreement(results: list[RequestResult], reference: list[RequestResult]) -> float | None:
    """Share of requests whose final answer equals the reference run's (paired by order)."""
    return answer_agreement([r.final_answer for r in results], [r.final_answer for r in reference])


def answer_agreement(answers: list[str], reference: list[str]) -> float | None:
    """Share of final answers equal to the reference run's (paired by order), from the
    answers alone (a resumed run keeps its reference's answers, not its requests)."""
    if not answers:
        return None
    return mean(float(a == b) for a, b in zip(answers, reference, strict=True))


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The 95% Wilson score interval of a proportion."""
    if n == 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
