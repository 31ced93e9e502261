"""Running a context sweep: every (size, method) on the same documents, each in its own child
process by default so that its peak RSS is its own; figures from :mod:`kvcmas.eval.summary`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvcmas.eval.summary import add_ratios, run_summary
from kvcmas.experiments import common
from kvcmas.experiments.args import method_options
from kvcmas.experiments.cells import fmt
from kvcmas.experiments.child import in_child
from kvcmas.experiments.context_sweep.documents import documents, source_texts
from kvcmas.experiments.context_sweep.plan import (
    DOC_SLOT,
    cap_sizes,
    method_order,
    overhead_tokens,
    trace_fields,
    trace_workflow,
)
from kvcmas.methods import make_method
from kvcmas.methods.base import Method
from kvcmas.model.loader import LoadedModel, load_model
from kvcmas.workflow.spec import Workflow

Log = Callable[[str], None]


def keeps_state(method: Method) -> bool:
    """Methods whose state persists across requests need warm-up requests first."""
    return method.learns_across_requests


def point_requests(method: Method, docs: list[str], warmup: int) -> tuple[list[dict], int]:
    """The requests a method runs on the trace (the warm-up documents first, only if it keeps
    state) and the number of warm-ups among them."""
    n_warm = warmup if keeps_state(method) else 0
    return [{"id": f"doc{i}", DOC_SLOT: d} for i, d in enumerate(docs)][warmup - n_warm :], n_warm


def run_one(
    loaded: LoadedModel,
    workflow: Workflow,
    name: str,
    options: dict[str, Any],
    docs: list[str],
    warmup: int,
    log: Log,
) -> dict[str, Any]:
    """One method on the trace: warm-ups (when it keeps state), then the measured requests."""
    method = make_method(name, options, strict=False)
    runner = common.trace_runner(loaded, workflow, method, ignore_eos=True)
    requests, n_warm = point_requests(method, docs, warmup)
    results = common.run_stream(runner, requests, log, name)[n_warm:]
    return {
        "method": name,
        "params": method.params(),
        "warmup_requests": n_warm,
        "summary": run_summary(results),
        "requests": [r.to_json() for r in results],
    }


def run_one_loading(model_spec: str, dtype: str, device: str, *call: Any) -> dict[str, Any]:
    """``run_one`` in a child process, which loads the model from the local cache first."""
    return run_one(load_model(model_spec, dtype, device), *call)


def add_size_ratios(runs: list[dict[str, Any]]) -> None:
    """TTFT, latency and compute ratios of each run to NonShared's at the same size."""
    for size in {r["size"] for r in runs}:
        add_ratios({r["method"]: r["summary"] for r in runs if r["size"] == size and r["summary"]})


def sweep(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    loaded = load_model(args.model, args.dtype, args.device)
    workflow = trace_workflow(args.agents, args.output_tokens)
    overhead = overhead_tokens(loaded.tokenizer, workflow)
    sizes, capped = cap_sizes(args.sizes, loaded.config.max_position - overhead)
    for s, c in capped.items():
        log(f"size {s} capped to {c}: the context is {loaded.config.max_position} tokens")
    texts = source_texts(args.source)
    options = method_options(args)
    # Every size's documents first: a size without documents fails in seconds, not hours.
    all_docs = {s: documents(loaded.tokenizer, texts, s, args.warmup + args.measure) for s in sizes}
    runs: list[dict[str, Any]] = []
    for size, docs in all_docs.items():
        for name in method_order(args.methods):
            log(f"size {size}: {name} ...")
            call = (workflow, name, options, docs, args.warmup, log)
            try:
                if args.isolate:  # the child loads the model itself (a second or so)
                    run = in_child(run_one_loading, args.model, args.dtype, args.device, *call)
                else:
                    run = run_one(loaded, *call)
            except RuntimeError as e:  # e.g. a full-dimensional pool out of memory
                run = {"method": name, "summary": None, "error": str(e)[-2000:]}
                log(f"size {size}: {name} FAILED: {str(e).strip().splitlines()[-1]}")
            run["size"] = size
            runs.append(run)
            if s := run["summary"]:
                log(
                    f"size {size}: {name} TTFT 2+ {fmt(s['ttft_later_mean_s'])}s, latency "
                    f"{fmt(s['latency_request_mean_s'])}s, rho 2+ {fmt(s['rho_later'], '.2f')}"
                )
    add_size_ratios(runs)
    return {
        "setup": common.setup(
            loaded,
            args.dtype,
            **trace_fields(args, sizes),
        ),
        "context_limit": loaded.config.max_position,
        "non_doc_tokens_max": overhead,
        "capped": {str(k): v for k, v in capped.items()},
        "isolated_processes": args.isolate,
        "runs": runs,
    }
