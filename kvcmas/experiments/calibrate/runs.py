"""Online runs of KVCMAS settings on one request stream, measured as the method runs live.

Every run is a fresh method through the real :class:`~kvcmas.workflow.runner.Runner`: its
pools fill from its own dense fallbacks, count uses, evict least-used and read chained
sources, exactly as ``kvcmas run`` does. Each hop is checked against a dense fp32 NonShared
prefill of the same tokens (:class:`~kvcmas.eval.fidelity.FidelityObserver`). NonShared (TTFT,
latency and compute ratios, final agreement) and FullShared (the error of reusing without
correction) run once on the same stream. Reuse and cost figures come from
:mod:`kvcmas.eval.summary`, their one definition. The ablation uses this class too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcmas.eval.fidelity import MEMO_BYTES, FidelityObserver
from kvcmas.eval.summary import add_ratios, agreement, fidelity_summary, mean, run_summary
from kvcmas.experiments.calibrate.plan import Plan
from kvcmas.experiments.cells import fmt
from kvcmas.methods import make_method
from kvcmas.methods.base import Method
from kvcmas.methods.kvcmas import KVCMAS
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow

BASELINES = ("nonshared", "fullshared")
SegmentKey = tuple[int, str, str]  # (request index, consuming agent, slot)


def segment_errors(results: list[RequestResult]) -> dict[SegmentKey, tuple[str, float]]:
    """Each shared segment's (decision, KV error against the dense reference)."""
    out = {}
    for i, r in enumerate(results):
        for h in r.hops:
            shared = [s for s in h.segments if s["kind"] != "private"]
            errors = h.fidelity["segment_errors"]
            for s, e in zip(shared, errors, strict=True):
                out[(i, h.agent, s["slot"])] = (s["decision"], e)
    return out


def reused_error_vs_fullshared(
    results: list[RequestResult], fullshared: list[RequestResult]
) -> dict[str, Any]:
    """KV error of the segments a run reused, beside FullShared's error on the same segments
    (same request, consumer and slot) of its own run on the stream. Agent outputs may differ
    between the two runs, each decoding from its own caches: that is the online comparison."""
    ours, theirs = segment_errors(results), segment_errors(fullshared)
    pairs = [
        (e, theirs[k][1])
        for k, (decision, e) in ours.items()
        if decision != "dense" and k in theirs
    ]
    return {
        "reused_segments": len(pairs),
        "reused_error_mean": mean(a for a, _ in pairs),
        "fullshared_error_same_mean": mean(b for _, b in pairs),
        "error_ratio": mean(a / b for a, b in pairs if b > 0),  # below 1: the correction helps
    }


def gate_counts(results: list[RequestResult]) -> dict[str, Any]:
    """Segments the gate judged (a match was scored) and the share of them it reused."""
    segs = [s for r in results for h in r.hops for s in h.segments if s["kind"] != "private"]
    matched = [s for s in segs if "entropy" in s]
    reused = [s for s in matched if s["decision"] != "dense"]
    return {
        "matched_segments": len(matched),
        "reuse_share_of_matched": len(reused) / len(matched) if matched else None,
        "entropy_mean": mean(s["entropy"] for s in matched),
    }


def pool_figures(method: Method, n_layers: int, width: int) -> dict[str, Any]:
    """Pool bytes and anchors at the end of the run; the fullest pool (never above V)."""
    report = method.pool_report(n_layers, width)
    if not isinstance(method, KVCMAS) or report is None:
        return {}
    fullest = max((len(p.anchors) for p in method.pools.values()), default=0)
    return {**report, "pools": len(method.pools), "pool_anchors_max": fullest}


class OnlineRuns:
    """Memoised runs on one stream; call :meth:`summary` for any method and options."""

    def __init__(
        self,
        loaded: LoadedModel,
        reference: LoadedModel,
        workflow: Workflow,
        requests: list[dict],
        log: Callable[[str], None] = lambda _: None,
    ):
        self.loaded, self.workflow = loaded, workflow
        # one observer for every run of the stream: each distinct hop's reference once
        self.observer = FidelityObserver(reference, memo_bytes=MEMO_BYTES)
        self.requests, self.log = requests, log
        self.results: dict[str, list[RequestResult]] = {}
        self.methods: dict[str, Method] = {}
        self.summaries: dict[str, dict[str, Any]] = {}

    def run(self, label: str, name: str, **options: Any) -> list[RequestResult]:
        """The run of method ``name`` with ``options`` (a fresh method: empty pools)."""
        if label not in self.results:
            method = make_method(name, options)
            runner = Runner(self.loaded, self.workflow, method, self.observer)
            n = len(self.requests)
            progress = lambda i, _: self.log(f"{label}: request {i + 1}/{n}")  # noqa: E731
            self.results[label] = list(runner.run_stream(self.requests, progress))
            self.methods[label] = method
        return self.results[label]

    def summary(self, label: str, name: str, **options: Any) -> dict[str, Any]:
        """Reuse, fidelity, cost and pool figures of a run, with its ratios to NonShared."""
        if label in self.summaries:
            return self.summaries[label]
        base = {b: self.run(b, b) for b in BASELINES}  # first: the references every run needs
        results = self.run(label, name, **options)
        cfg = self.loaded.config
        fid = fidelity_summary(results, cfg.n_layers)
        out = {
            "label": label,
            "method": name,
            "options": options,
            **run_summary(results),
            **{k: v for k, v in fid.items() if not k.endswith("_per_layer")},
            "final_agreement": agreement(results, base["nonshared"]),
            **gate_counts(results),
            **reused_error_vs_fullshared(results, base["fullshared"]),
            **pool_figures(self.methods[label], cfg.n_layers, cfg.kv_width),
        }
        out.pop("ttft_per_agent_s", None)
        self.summaries[label] = out
        if name not in BASELINES:
            self.baseline_summaries()
        add_ratios(self.summaries)
        return out

    def baseline_summaries(self) -> dict[str, dict[str, Any]]:
        return {b: self.summary(b, b) for b in BASELINES}


def run_grid(runs: OnlineRuns, plan: Plan) -> list[dict[str, Any]]:
    """One online KVCMAS run per grid point; each row holds its point and its figures."""
    rows = []
    for point in plan.points:
        s = runs.summary(point.label, "kvcmas", **plan.method_options(point))
        rows.append({"temperature": point.temperature, "rank": point.rank, "tau": point.tau, **s})
        runs.log(
            f"{point.label}: rho {fmt(s['rho_later'], '.2f')} (hops 2+), recompute "
            f"{fmt(s['recompute_later'], '.2f')}, error / FullShared {fmt(s['error_ratio'], '.3f')}"
        )
    return rows
