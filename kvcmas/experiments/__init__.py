"""Experiments run as ``kvcmas bench NAME``.

Each module listed here defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (and ``smoke_args(out_dir)`` for ``kvcmas bench smoke``); the command line
registers them all. A larger experiment is a package whose ``__init__`` holds just that
contract, over separate pieces: ``plan`` (what runs: flags, items, sizes, methods), ``runs``
(running it) and ``report`` (tables and plots). Every experiment shows progress, and writes
``results.json``, a markdown table and PNG plots into ``--out``.
"""

from __future__ import annotations

import importlib

EXPERIMENT_MODULES: dict[str, str] = {
    "calibrate": "kvcmas.experiments.calibrate",
    "context-sweep": "kvcmas.experiments.context_sweep",
    "ablation": "kvcmas.experiments.ablation",
    "lowrank": "kvcmas.experiments.lowrank",
    "coverage": "kvcmas.experiments.coverage_exp",
    "accuracy": "kvcmas.experiments.accuracy",
    "pareto": "kvcmas.experiments.pareto",
    "engine": "kvcmas.experiments.engine_bench",
    "serve": "kvcmas.experiments.serve_bench",
    "report": "kvcmas.experiments.report",
    "smoke": "kvcmas.experiments.smoke",
}


def register_all(subparsers) -> None:
    for name, module_name in EXPERIMENT_MODULES.items():
        module = importlib.import_module(module_name)
        p = subparsers.add_parser(name, help=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
