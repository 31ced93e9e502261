"""``kvcmas bench context-sweep``: TTFT, end-to-end latency and compute as the shared context
grows.

A controlled four-agent trace (the paper's serving traces): a chain of agents where every
agent reads the shared document ``{doc}`` (a request input of exactly N tokens, built
deterministically from benchmark questions) and the output of every earlier agent. Each
agent output is exactly ``--output-tokens`` tokens: the end-of-turn token is ignored (vLLM's
``ignore_eos``; the token, if chosen, stays in the output as an ordinary token). Methods that
keep state across requests (anchor pools, residuals) first run ``--warmup`` requests on other
documents of the same size; every method is measured on the same ``--measure`` requests.
Each (size, method) runs in a spawned child process, so its peak RSS is its own.

Pieces: :mod:`.plan` (workflow, sizes, flags), :mod:`.documents`, :mod:`.runs`, :mod:`.report`.
"""

from __future__ import annotations

import argparse

from kvcmas.experiments import common
from kvcmas.experiments.context_sweep.plan import add_arguments, check_args, smoke_args
from kvcmas.experiments.context_sweep.report import markdown, plot
from kvcmas.experiments.context_sweep.runs import sweep

__all__ = ["HELP", "add_arguments", "run", "smoke_args"]

HELP = "TTFT, latency and compute per method and their ratio to NonShared as the document grows"


def run(args: argparse.Namespace) -> int:
    check_args(args)
    log = common.Progress("context-sweep")
    results = sweep(args, log)
    return common.finish(args.out, results, log, markdown, plot)
