"""``kvcmas bench compare``: several methods on one request stream, side by side.

Every method runs on the same model, the same token sequences and the same system-prefix
caches (METHOD.md section 2); every hop is compared with a dense NonShared prefill of its own
prompt in fp32. The noise floor row is NonShared run in bf16 against the same fp32 reference.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from kvcmas.methods import make_method
from kvcmas.methods.base import Method
from kvcmas.model.loader import LoadedModel, load_model
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow

LENGTH_BUCKETS = ((0, 32), (32, 64), (64, 128), (128, 10**9))
LENGTH_BUCKETS_LABELS = [f"{lo}-{hi - 1}" if hi < 10**9 else f">={lo}" for lo, hi in LENGTH_BUCKETS]
NOISE_FLOOR = "nonshared-bf16"


def _mean(xs) -> float | None:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def run_method(
    loaded: LoadedModel,
    reference: LoadedModel,
    workflow: Workflow,
    method: Method,
    requests: list[dict],
    progress=None,
) -> list[RequestResult]:
    runner = Runner(loaded, workflow, method, reference=reference, reference_answers=False)
    return list(runner.run_stream(requests, progress))


def fidelity_summary(hops, later, n_layers: int) -> dict[str, Any]:
    """Figures that need each hop's comparison with the dense fp32 reference."""
    seg_errors = [
        (s, e)
        for h in hops
        for s, e in zip(
            [s for s in h.segments if s["kind"] != "private"],
            h.fidelity["segment_errors"],
            strict=True,
        )
    ]
    reused = [(s, e) for s, e in seg_errors if s["decision"] != "dense"]
    by_kind = {}
    for kind in sorted({s["kind"] for s, _ in seg_errors}):
        all_k = [e for s, e in seg_errors if s["kind"] == kind]
        re_k = [e for s, e in reused if s["kind"] == kind]
        by_kind[kind] = {
            "segments": len(all_k),
            "reused": len(re_k),
            "error_reused_mean": _mean(re_k),
            "error_all_mean": _mean(all_k),
        }
    by_length = {}
    for (lo, hi), label in zip(LENGTH_BUCKETS, LENGTH_BUCKETS_LABELS, strict=True):
        re_b = [e for s, e in reused if lo <= s["length"] < hi]
        by_length[label] = {"reused": len(re_b), "error_reused_mean": _mean(re_b)}
    fid = [h.fidelity for h in later]
    return {
        "kv_error_mean": _mean(f["kv_rel_error"] for f in fid),
        "kv_error_reused_segments_mean": _mean(e for _, e in reused),
        "k_error_per_layer": [
            _mean(f["k_rel_error_per_layer"][i] for f in fid) for i in range(n_layers)
        ],
        "v_error_per_layer": [
            _mean(f["v_rel_error_per_layer"][i] for f in fid) for i in range(n_layers)
        ],
        "first_token_kl_mean": _mean(f["first_token_kl"] for f in fid),
        "first_token_kl_median": statistics.median(f["first_token_kl"] for f in fid)
        if fid
        else None,
        "continuation_kl_mean": _mean(f["continuation_kl"] for f in fid),
        "same_hop_output_rate": _mean(float(f["same_output"]) for f in fid),
        "by_slot_kind": by_kind,
        "by_segment_length": by_length,
    }


def summarize(
    results: list[RequestResult],
    method: Method,
    baseline: list[RequestResult] | None,
    n_layers: int,
    width: int,
) -> dict[str, Any]:
    """The per-method figures of the comparison table."""
    hops = [h for r in results for h in r.hops]
    later = [h for r in results for h in r.hops[1:]]  # the first hop is exact for KVCMAS
    segs = [(s, h) for h in hops for s in h.segments if s["kind"] != "private"]
    shared_tokens = sum(s["length"] for s, _ in segs)
    out = {
        "method": method.name,
        "params": method.params(),
        "requests": len(results),
        "hops": len(hops),
        "reuse_ratio_tokens": sum(s["length"] for s, _ in segs if s["decision"] != "dense")
        / max(shared_tokens, 1),
        "reuse_ratio_calls": sum(s["decision"] != "dense" for s, _ in segs) / max(len(segs), 1),
        "recompute_fraction_mean": _mean(h.recompute_fraction for h in later),
        "ttft_nonfirst_mean_s": _mean(h.ttft_s for h in later),
        "ttft_all_mean_s": _mean(h.ttft_s for h in hops),
        "latency_request_mean_s": _mean(sum(h.latency_s for h in r.hops) for r in results),
        "method_state_bytes": method.memory_bytes(),
        "peak_state_bytes": max(h.kv_bytes + h.source_bytes + h.method_state_bytes for h in hops),
    }
    if all(h.fidelity is not None for h in hops):
        out.update(fidelity_summary(hops, later, n_layers))
    if baseline is not None:
        same = [a.final_answer == b.final_answer for a, b in zip(results, baseline, strict=True)]
        out["final_agreement"] = sum(same) / len(same)
    if hasattr(method, "pool_report"):
        out["pool"] = method.pool_report(n_layers, width)
    return out


def compare(
    model_spec: str,
    dtype: str,
    workflow: Workflow,
    requests: list[dict],
    methods: list[str],
    method_params: dict[str, Any],
    noise_floor: bool = True,
    log=print,
    fidelity: bool = True,
) -> dict[str, Any]:
    """Run every method (NonShared first: the reference answers) and summarize side by side."""
    loaded = load_model(model_spec, dtype)
    reference = None
    if fidelity:
        reference = loaded if dtype == "fp32" else load_model(model_spec, "fp32")
    names = ["nonshared"] + [m for m in methods if m != "nonshared"]
    results: dict[str, list[RequestResult]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    cfg = loaded.config
    runs: list[tuple[str, LoadedModel, Method]] = [
        (name, loaded, make_method(name, **accepted_params(name, method_params))) for name in names
    ]
    if noise_floor and fidelity and dtype == "fp32":
        runs.append((NOISE_FLOOR, load_model(model_spec, "bf16"), make_method("nonshared")))
    for label, model, method in runs:
        start = time.perf_counter()

        def progress(i, r, label=label, start=start):
            log(f"  {label}: request {i + 1}/{len(requests)} ({time.perf_counter() - start:.0f}s)")

        log(f"running {label} on {len(requests)} requests ...")
        results[label] = run_method(model, reference, workflow, method, requests, progress)
        baseline = results["nonshared"]
        summaries[label] = summarize(results[label], method, baseline, cfg.n_layers, cfg.kv_width)
        summaries[label]["wall_s"] = time.perf_counter() - start
    base_ttft = summaries["nonshared"]["ttft_nonfirst_mean_s"]
    for s in summaries.values():
        s["ttft_ratio_vs_nonshared"] = s["ttft_nonfirst_mean_s"] / base_ttft
    return {
        "setup": {
            "model": loaded.name,
            "dtype": dtype,
            "reference_dtype": "fp32" if fidelity else "none (timing run)",
            "workflow": workflow.name,
            "requests": len(requests),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "torch_threads": __import__("torch").get_num_threads(),
        },
        "summary": summaries,
        "requests": {k: [r.to_json() for r in v] for k, v in results.items()},
    }


def accepted_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The subset of command-line knobs that this method takes."""
    import inspect

    from kvcmas.methods import METHODS

    accepted = inspect.signature(METHODS[name]).parameters
    return {k: v for k, v in params.items() if k in accepted}


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [
        f"# Method comparison: {s['workflow']} workflow, {s['requests']} requests",
        "",
        f"Model {s['model']} ({s['dtype']}), fidelity against NonShared in "
        f"{s['reference_dtype']}; machine {s['machine']}, {s['torch_threads']} torch threads. "
        "Errors and KL are over hops after the first; TTFT is the mean over non-first hops.",
        "",
        "| method | reuse (tokens) | reuse (calls) | recompute | KV err | KV err reused segs "
        "| KL first (mean / median) | KL cont. | same hop output | final agree | TTFT s "
        "| TTFT / NonShared | state MiB | pool KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, m in report["summary"].items():
        lines.append(
            f"| {label} | {fmt(m['reuse_ratio_tokens'], '.2f')}"
            f" | {fmt(m['reuse_ratio_calls'], '.2f')}"
            f" | {fmt(m['recompute_fraction_mean'], '.2f')} | {fmt(m.get('kv_error_mean'), '.4f')}"
            f" | {fmt(m.get('kv_error_reused_segments_mean'), '.4f')}"
            f" | {fmt(m.get('first_token_kl_mean'), '.4f')}"
            f" / {fmt(m.get('first_token_kl_median'), '.4f')}"
            f" | {fmt(m.get('continuation_kl_mean'), '.4f')}"
            f" | {fmt(m.get('same_hop_output_rate'), '.2f')}"
            f" | {fmt(m.get('final_agreement'), '.2f')} | {fmt(m['ttft_nonfirst_mean_s'], '.3f')}"
            f" | {fmt(m['ttft_ratio_vs_nonshared'], '.2f')}"
            f" | {m['peak_state_bytes'] / 2**20:.1f} | {m['method_state_bytes'] / 1024:.0f} |"
        )
    lines += [
        "",
        "## KV error of reused segments by slot kind",
        "",
        "| method | kind | segments | reused | error (reused) | error (all) |",
        "|---|---|---|---|---|---|",
    ]
    for label, m in report["summary"].items():
        for kind, k in m.get("by_slot_kind", {}).items():
            lines.append(
                f"| {label} | {kind} | {k['segments']} | {k['reused']} | "
                f"{fmt(k['error_reused_mean'], '.4f')} | {fmt(k['error_all_mean'], '.4f')} |"
            )
    lines += [
        "",
        "## KV error of reused segments by segment length (tokens)",
        "",
        "| method | " + " | ".join(LENGTH_BUCKETS_LABELS) + " |",
        "|---|" + "---|" * len(LENGTH_BUCKETS_LABELS),
    ]
    for label, m in report["summary"].items():
        cells = [
            f"{fmt(b['error_reused_mean'], '.4f')} (n={b['reused']})"
            for b in m.get("by_segment_length", {}).values()
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    pools = {k: m["pool"] for k, m in report["summary"].items() if "pool" in m}
    if pools:
        lines += [
            "",
            "## Anchor pools",
            "",
            "| method | anchors | measured bytes | analytic full-dimensional | analytic low-rank |",
            "|---|---|---|---|---|",
        ]
        for label, p in pools.items():
            lines.append(
                f"| {label} | {p['anchors']} | {p['pool_bytes']:,} | "
                f"{p['analytic_full_bytes']:,} | {p['analytic_lowrank_bytes']:,} |"
            )
    return "\n".join(lines) + "\n"


def plot_layer_errors(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for label, m in report["summary"].items():
        for ax, key in zip(axes, ("k_error_per_layer", "v_error_per_layer"), strict=True):
            ax.plot(range(len(m[key])), m[key], label=label)
    for ax, name in zip(axes, ("K", "V"), strict=True):
        ax.set_xlabel("layer")
        ax.set_title(f"{name} relative error vs NonShared (fp32)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative error")
    axes[1].legend(fontsize=8)
    s = report["setup"]
    fig.suptitle(f"{s['model']} {s['dtype']}, {s['workflow']}, {s['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "table.md").write_text(markdown_table(report))
    if all("k_error_per_layer" in m for m in report["summary"].values()):
        plot_layer_errors(report, out / "layer_errors.png")
