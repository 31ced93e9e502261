"""``kvcmas demo``: the paper's 4-agent roster with NonShared and KVCMAS side by side.

KVCMAS learns its anchors online, so a few warm-up requests (not shown in detail) fill its
pools first, as earlier traffic would in a running service. Then each demo question runs
through NonShared (fp32, the exact reference), KVCMAS, and NonShared in bf16 (the noise
floor: the same dense computation, rounded differently). The summary puts every figure in
context: TTFT beside request latency and compute seconds, and KVCMAS's agreement with the
reference beside the noise floor's, both as identical final text (which one changed word
flips) and as the first-token KL of every hop (which wording cannot flip).
"""

from __future__ import annotations

import sys
import time

from kvcmas.eval.fidelity import FidelityObserver
from kvcmas.eval.summary import mean, run_summary
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
LABELS = ("NonShared fp32", "KVCMAS", "NonShared bf16")


def _print_question(q: str, runs: dict[str, RequestResult]) -> None:
    base, ours = runs[LABELS[0]], runs[LABELS[1]]
    print(f"\nQ: {q}")
    for label, r in runs.items():
        print(f"  {label:<15} answer: {' '.join(r.final_answer.split())[:110]}")
    print(
        f"  {'agent':>9} {'TTFT NonShared':>15} {'TTFT KVCMAS':>12} {'rho':>5} "
        f"{'KL first':>9}  gate (entropy)"
    )
    for b, o in zip(base.hops, ours.hops, strict=True):
        shared = [s for s in o.segments if s["kind"] != "private"]
        gate = ", ".join(
            f"{s['slot']}:{s['decision']}" + (f"({s['entropy']:.3f})" if "entropy" in s else "")
            for s in shared
        )
        rho = "-" if o.rho is None else f"{o.rho:.2f}"
        print(
            f"  {o.agent:>9} {b.ttft_s * 1000:>13.0f}ms {o.ttft_s * 1000:>10.0f}ms {rho:>5} "
            f"{o.fidelity['first_token_kl']:>9.4f}  {gate}"
        )


def _same_text(results: list[RequestResult], reference: list[RequestResult]) -> str:
    same = sum(a.final_answer == b.final_answer for a, b in zip(results, reference, strict=True))
    return f"{same}/{len(results)}"


def _print_summary(results: dict[str, list[RequestResult]], pool_report: dict) -> None:
    reference = results[LABELS[0]]
    base = run_summary(reference)
    print("\nSummary over the demo questions (reference: NonShared fp32)")
    print(f"  {'':<16}{'same final text':>16}{'mean first-token KL, hops 2+':>31}")
    for label in LABELS[1:]:
        kl = mean(h.fidelity["first_token_kl"] for r in results[label] for h in r.hops[1:])
        print(f"  {label:<16}{_same_text(results[label], reference):>16}{kl:>31.4f}")
    print("  (NonShared bf16 is the noise floor: dense prefill, only rounding differs)")
    ours = run_summary(results[LABELS[1]])
    print(
        f"  TTFT hops 2+:     NonShared {base['ttft_later_mean_s'] * 1000:.0f} ms, "
        f"KVCMAS {ours['ttft_later_mean_s'] * 1000:.0f} ms "
        f"({ours['ttft_later_mean_s'] / base['ttft_later_mean_s']:.2f}x)"
    )
    print(
        f"  request latency:  NonShared {base['latency_request_mean_s']:.2f} s, "
        f"KVCMAS {ours['latency_request_mean_s']:.2f} s "
        f"({ours['latency_request_mean_s'] / base['latency_request_mean_s']:.2f}x), plus "
        f"{ours['background_request_mean_s'] * 1000:.0f} ms of anchor work after each answer"
    )
    print(
        f"  compute (CPU s):  NonShared {base['compute_s']:.1f}, KVCMAS {ours['compute_s']:.1f} "
        f"(anchor work included)"
    )
    print(
        f"  reuse: rho {ours['rho_later']:.2f} of shared tokens on hops 2+ "
        f"(recompute fraction {ours['recompute_later']:.2f})"
    )
    print(
        f"  anchor pools: {pool_report['anchors']} anchors, "
        f"{pool_report['pool_bytes'] / 2**20:.1f} MiB (full-dimensional would be "
        f"{pool_report['analytic_full_bytes'] / 2**20:.1f} MiB)"
    )


def run_demo(model_spec: str, dtype: str, device: str = "cpu") -> int:
    print(
        f"kvcmas demo: model {model_spec} (KVCMAS in {dtype}; reference NonShared fp32), "
        "workflow 'roster' (3 task agents + a decider reading all three)",
        flush=True,
    )
    loaded = load_model(model_spec, dtype, device)
    reference = loaded if dtype == "fp32" else load_model(model_spec, "fp32", device)
    bf16 = load_model(model_spec, "bf16", device)
    workflow = roster()
    method = make_method("kvcmas")
    observer = FidelityObserver(reference)
    runners = {
        LABELS[0]: Runner(reference, workflow, make_method("nonshared")),
        LABELS[1]: Runner(loaded, workflow, method, observer=observer),
        LABELS[2]: Runner(bf16, workflow, make_method("nonshared"), observer=observer),
    }
    start = time.perf_counter()
    for i, q in enumerate(WARMUP_QUESTIONS):
        print(
            f"  warming KVCMAS anchor pools: request {i + 1}/{len(WARMUP_QUESTIONS)} "
            f"({time.perf_counter() - start:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        runners[LABELS[1]].run({"query": q})
    results: dict[str, list[RequestResult]] = {label: [] for label in LABELS}
    for q in DEMO_QUESTIONS:
        runs = {label: runner.run({"query": q}) for label, runner in runners.items()}
        for label, r in runs.items():
            results[label].append(r)
        _print_question(q, runs)
    _print_summary(results, method.pool_report(loaded.config.n_layers, loaded.config.kv_width))
    return 0
