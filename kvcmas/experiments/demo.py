"""``kvcmas demo``: the paper's 4-agent roster with NonShared and KVCMAS side by side.

KVCMAS learns its anchors online, so a few warm-up requests (not shown in detail) fill its
pools first, as earlier traffic would in a running service; then each demo question runs
through both methods and the answers, per-hop TTFT, reuse and pool bytes are printed.
"""

from __future__ import annotations

import statistics
import sys
import time

from kvcmas.methods import make_method
from kvcmas.model.loader import load_model
from kvcmas.workflow.builtin import roster
from kvcmas.workflow.runner import RequestResult, Runner

WARMUP_QUESTIONS = (
    "What is the boiling point of water at sea level in Celsius?",
    "Which planet is known as the red planet?",
    "Who wrote the play Romeo and Juliet?",
    "What is the chemical symbol for gold?",
    "How many continents are there on Earth?",
    "What is the largest mammal on Earth?",
)
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Which gas do plants absorb from the air to make food?",
    "How many legs does a spider have?",
    "What is the freezing point of water in Fahrenheit?",
)


def _print_pair(q: str, base: RequestResult, ours: RequestResult) -> None:
    print(f"\nQ: {q}")
    print(f"  NonShared answer: {base.final_answer.strip()}")
    print(f"  KVCMAS answer:    {ours.final_answer.strip()}")
    print(f"  same final answer: {'yes' if base.final_answer == ours.final_answer else 'no'}")
    print(
        f"  {'agent':>9} {'TTFT NonShared':>15} {'TTFT KVCMAS':>12} {'reused/shared':>14}  "
        "gate (entropy)"
    )
    for b, o in zip(base.hops, ours.hops, strict=True):
        shared = [s for s in o.segments if s["kind"] != "private"]
        total = sum(s["length"] for s in shared)
        gate = ", ".join(
            f"{s['slot']}:{s['decision']}" + (f"({s['entropy']:.3f})" if "entropy" in s else "")
            for s in shared
        )
        print(
            f"  {o.agent:>9} {b.ttft_s * 1000:>13.0f}ms {o.ttft_s * 1000:>10.0f}ms "
            f"{o.reused_tokens:>6}/{total:<7}  {gate}"
        )


def run_demo(model_spec: str, dtype: str) -> int:
    print(
        f"kvcmas demo: model {model_spec} ({dtype}), workflow 'roster' "
        "(3 task agents + a decider reading all three)",
        flush=True,
    )
    loaded = load_model(model_spec, dtype)
    workflow = roster()
    nonshared = Runner(loaded, workflow, make_method("nonshared"))
    method = make_method("kvcmas")
    kvcmas = Runner(loaded, workflow, method)
    start = time.perf_counter()
    for i, q in enumerate(WARMUP_QUESTIONS):
        print(
            f"  warming KVCMAS anchor pools: request {i + 1}/{len(WARMUP_QUESTIONS)} "
            f"({time.perf_counter() - start:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        kvcmas.run({"query": q}, i)
    pairs = []
    for i, q in enumerate(DEMO_QUESTIONS):
        base = nonshared.run({"query": q}, i)
        ours = kvcmas.run({"query": q}, len(WARMUP_QUESTIONS) + i)
        _print_pair(q, base, ours)
        pairs.append((base, ours))

    later_b = [h.ttft_s for b, _ in pairs for h in b.hops[1:]]
    later_o = [h.ttft_s for _, o in pairs for h in o.hops[1:]]
    segs = [s for _, o in pairs for h in o.hops for s in h.segments if s["kind"] != "private"]
    reused = sum(s["length"] for s in segs if s["decision"] != "dense")
    agree = sum(b.final_answer == o.final_answer for b, o in pairs)
    report = method.pool_report(loaded.config.n_layers, loaded.config.kv_width)
    print("\nSummary over the demo questions")
    print(f"  final answers equal to NonShared: {agree}/{len(pairs)}")
    print(
        f"  shared tokens reused by KVCMAS:   {reused}/{sum(s['length'] for s in segs)} "
        f"(token reuse ratio {reused / max(1, sum(s['length'] for s in segs)):.2f})"
    )
    print(
        f"  mean TTFT of non-first hops:      NonShared {statistics.fmean(later_b) * 1000:.0f}ms"
        f", KVCMAS {statistics.fmean(later_o) * 1000:.0f}ms"
    )
    print(
        f"  anchor pools: {report['anchors']} anchors, {report['pool_bytes'] / 2**20:.1f} MiB "
        f"(full-dimensional would be {report['analytic_full_bytes'] / 2**20:.1f} MiB)"
    )
    return 0
