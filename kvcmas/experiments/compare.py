"""``kvcmas bench compare``: several methods on one request stream, side by side.

Every method runs on the same model, the same token sequences and the same system-prefix
caches (METHOD.md section 2); every hop is compared with a dense NonShared prefill of its own
prompt in fp32. The noise floor row is NonShared run in bf16 against the same fp32 reference.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvcmas.eval.fidelity import FidelityObserver
from kvcmas.eval.summary import add_ratios, agreement, fidelity_summary, mean, run_summary
from kvcmas.experiments.cells import COST_HEADER, cost_cells, fmt, pair, reuse_cells
from kvcmas.experiments.common import write_results
from kvcmas.experiments.machine import machine_description
from kvcmas.methods import check_options_used, make_method
from kvcmas.methods.base import Method
from kvcmas.model.loader import LoadedModel, load_model
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow

LENGTH_BUCKETS = ((0, 32), (32, 64), (64, 128), (128, 10**9))
LENGTH_BUCKETS_LABELS = [f"{lo}-{hi - 1}" if hi < 10**9 else f">={lo}" for lo, hi in LENGTH_BUCKETS]
NOISE_FLOOR = "nonshared-bf16"


def floor_gemm_phrase(gemm_dtypes: set[str]) -> str:
    """How the noise floor multiplied, from its runs' recorded ``gemm_dtype`` values; empty
    where it multiplied natively in bf16."""
    if not gemm_dtypes:
        return ""
    return (
        f"matrix products in {'/'.join(sorted(gemm_dtypes))} over bf16 weights and inputs, "
        "rounded to bf16 (`--floor-gemm`: bf16's numbers up to summation order)"
    )


def run_method(
    loaded: LoadedModel,
    reference: LoadedModel | None,
    workflow: Workflow,
    method: Method,
    requests: list[dict],
    progress=None,
) -> list[RequestResult]:
    observer = FidelityObserver(reference) if reference is not None else None
    runner = Runner(loaded, workflow, method, observer=observer)
    return list(runner.run_stream(requests, progress))


def segment_errors(results: list[RequestResult]) -> dict[str, Any]:
    """KV error of shared segments by slot kind and by length (all hops)."""
    seg_errors = [
        (s, e)
        for r in results
        for h in r.hops
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
            "error_reused_mean": mean(re_k),
            "error_all_mean": mean(all_k),
        }
    by_length = {}
    for (lo, hi), label in zip(LENGTH_BUCKETS, LENGTH_BUCKETS_LABELS, strict=True):
        re_b = [e for s, e in reused if lo <= s["length"] < hi]
        by_length[label] = {"reused": len(re_b), "error_reused_mean": mean(re_b)}
    return {
        "kv_error_reused_segments_mean": mean(e for _, e in reused),
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
    out = {"method": method.name, "params": method.params(), **run_summary(results)}
    out["method_state_bytes"] = method.memory_bytes()
    if all(h.fidelity is not None for r in results for h in r.hops):
        out.update(fidelity_summary(results, n_layers))
        out.update(segment_errors(results))
    if baseline is not None:
        out["final_agreement"] = agreement(results, baseline)
    pool = method.pool_report(n_layers, width)
    if pool is not None:
        out["pool"] = pool
    return out


def compare(
    model_spec: str,
    dtype: str,
    workflow: Workflow,
    requests: list[dict],
    methods: list[str],
    method_options: dict[str, Any],
    noise_floor: bool = True,
    log=print,
    fidelity: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run every method (NonShared first: the reference answers) and summarize side by side."""
    names = ["nonshared"] + [m for m in methods if m != "nonshared"]
    check_options_used(names, method_options)
    built = [(name, make_method(name, method_options, strict=False)) for name in names]
    loaded = load_model(model_spec, dtype, device)
    reference = None
    if fidelity:
        reference = loaded if dtype == "fp32" else load_model(model_spec, "fp32", device)
    results: dict[str, list[RequestResult]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    cfg = loaded.config
    runs: list[tuple[str, LoadedModel, Method]] = [(n, loaded, m) for n, m in built]
    if noise_floor and fidelity and dtype == "fp32":
        runs.append((NOISE_FLOOR, load_model(model_spec, "bf16", device), make_method("nonshared")))
    for label, model, method in runs:
        start = time.perf_counter()

        def progress(i, r, label=label, start=start):
            log(f"  {label}: request {i + 1}/{len(requests)} ({time.perf_counter() - start:.0f}s)")

        log(f"running {label} on {len(requests)} requests ...")
        results[label] = run_method(model, reference, workflow, method, requests, progress)
        baseline = results["nonshared"]
        summaries[label] = summarize(results[label], method, baseline, cfg.n_layers, cfg.kv_width)
        summaries[label]["wall_s"] = time.perf_counter() - start
    add_ratios(summaries)
    return {
        "setup": {
            "model": loaded.name,
            "dtype": dtype,
            "reference_dtype": "fp32" if fidelity else "none (timing run)",
            "workflow": workflow.name,
            "requests": len(requests),
            "machine": machine_description(),
        },
        "summary": summaries,
        "requests": {k: [r.to_json() for r in v] for k, v in results.items()},
    }


def markdown_table(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [
        f"# Method comparison: {s['workflow']} workflow, {s['requests']} requests",
        "",
        f"Model {s['model']} ({s['dtype']}), fidelity against NonShared in "
        f"{s['reference_dtype']}; machine {s['machine']}.",
        "",
        "Cells with a slash give all hops / hops 2+. rho: shared tokens served from a source; "
        "recompute: computed (token, layer) pairs of shared tokens over dense. Latency is the "
        "request end to end (mean); bg the anchor work after it; compute the process CPU "
        "seconds of the whole run (bg included). Ratios are to NonShared (below 1 is faster).",
        "",
        f"| method | rho | recompute | {COST_HEADER} | bg s | KV err | KL first (mean) "
        "| KL cont. | same hop output | final agree | state MiB | pool KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, m in report["summary"].items():
        lines.append(
            f"| {label} | {reuse_cells(m)} | {cost_cells(m)}"
            f" | {fmt(m.get('background_request_mean_s'))}"
            f" | {pair(m, 'kv_error_{}_mean', '.4f')}"
            f" | {pair(m, 'first_token_kl_{}_mean', '.4f')}"
            f" | {pair(m, 'continuation_kl_{}_mean', '.4f')}"
            f" | {pair(m, 'same_hop_output_{}', '.2f')}"
            f" | {fmt(m.get('final_agreement'), '.2f')}"
            f" | {m['peak_state_bytes'] / 2**20:.1f} | {m['method_state_bytes'] / 1024:.0f} |"
        )
    if any("by_slot_kind" in m for m in report["summary"].values()):  # fidelity runs only
        lines += segment_error_lines(report)
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


def segment_error_lines(report: dict[str, Any]) -> list[str]:
    """KV error of reused segments by slot kind and by length (fidelity runs)."""
    lines: list[str] = []
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
    return lines


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
    write_results(out, report, markdown_table(report))
    if all("k_error_per_layer" in m for m in report["summary"].values()):
        plot_layer_errors(report, out / "layer_errors.png")
