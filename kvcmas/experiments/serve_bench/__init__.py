"""``kvcmas bench serve``: methods under load on vLLM, sessions arriving by a Poisson process.

Each method gets its own ``kvcmas serve`` server (vLLM with the connector, started here on a
free local port). Sessions are four-agent chain traces over a document of S tokens (the context
sweep's trace, each hop rendered and sent as ``kvcmas run --engine vllm`` sends it), arriving
at load x plain vLLM's capacity at that S: the highest rate at which plain vLLM's p50 TTFT
stays within 2x its idle TTFT, found by a short search (or given by ``--capacity``). Reported
per (method, S, load): TTFT p50/p95 (p99 from 100 samples) of the first hop and of later hops,
session latency, throughput, reuse of hops 2+, and peak memory.

Pieces: :mod:`.plan` (methods, flags), :mod:`.workload` (documents, arrivals), :mod:`.load`
(the async load generator), :mod:`.capacity` (the search), :mod:`.metrics`, :mod:`.runs`,
:mod:`.report`, :mod:`.merge` (runs made separately, as one report).
"""

from __future__ import annotations

import argparse

from kvcmas.experiments import common
from kvcmas.experiments.serve_bench.merge import merge_runs, read_parts
from kvcmas.experiments.serve_bench.plan import add_arguments, check_args
from kvcmas.experiments.serve_bench.report import markdown, plot

__all__ = ["HELP", "add_arguments", "run"]

HELP = "methods under Poisson load on vLLM: TTFT percentiles, throughput, reuse, memory"


def run(args: argparse.Namespace) -> int:
    from kvcmas.experiments.serve_bench.runs import bench

    if args.merge:
        common.render(args.out, merge_runs(read_parts(args.merge)), markdown, plot)
        return 0
    check_args(args)
    log = common.Progress("serve")
    results = bench(args, log)
    return common.finish(args.out, results, log, markdown, plot)
