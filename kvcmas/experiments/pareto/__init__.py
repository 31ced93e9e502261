"""``kvcmas bench pareto``: each method over its knob range, speed against fidelity, on long
shared context (issue 11).

Per model and document size, every method's knob points (:mod:`.plan`) run on the context
sweep's trace workflow with documents cut from a packaged dataset: a fidelity pass in fp32
(first-token and continuation KL of hops 2+ and final-answer agreement, all against fp32
NonShared; the bf16 noise floor beside them) and a separate timing pass in ``--dtype`` (bf16:
TTFT speedup on hops 2+, end-to-end speedup, compute). Each method's frontier (points no other
point of the same method beats on both axes) is drawn per size, with a JSON and a table.

Pieces: :mod:`.plan` (knob points, flags), :mod:`.runs` (the two passes), :mod:`.report`
(frontiers, table, plots), :mod:`.merge` (parts run separately, as one report), :mod:`.resume`
(a fidelity pass stopped early, continued).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvcmas.experiments import common
from kvcmas.experiments.pareto.merge import merge_runs, read_parts
from kvcmas.experiments.pareto.plan import add_arguments, check_args, smoke_args
from kvcmas.experiments.pareto.report import add_frontiers, markdown, plot
from kvcmas.experiments.pareto.runs import pareto

__all__ = ["HELP", "add_arguments", "run", "smoke_args"]

HELP = "each method over its knob: TTFT and end-to-end speedup against KL and answer agreement"


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.merge:
        timing = read_parts([args.timing_from])[0] if args.timing_from else None
        results = merge_runs(read_parts(args.merge), timing)
        add_frontiers(results)
        common.render(Path(args.out), results, markdown, plot)
        return 0
    if args.rerender:  # an earlier run's figures, with this version's frontiers and table
        out = Path(args.out)
        _, results = common.read_results(out)
        add_frontiers(results)
        common.render(out, results, markdown, plot)
        return 0
    log = common.Progress("pareto")
    results = pareto(args, log, on_update=lambda partial: _save_partial(Path(args.out), partial))
    add_frontiers(results)
    return common.finish(args.out, results, log, markdown, plot)


def _save_partial(out: Path, results: dict) -> None:
    """The JSON and table of the points done so far (plots are drawn at the end)."""
    add_frontiers(results)
    common.write_results(out, results, markdown(results))
