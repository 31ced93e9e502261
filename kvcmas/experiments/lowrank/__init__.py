"""``kvcmas bench lowrank``: how low-rank are cross-agent KV deviations and base caches?

Three families of ``n x D`` matrices per layer (layers 1..L-1, canonical frame, K and V apart):

* **delta**: ``dense - source`` of slot contents (query, agent outputs), from the (source,
  dense) pairs that :func:`kvcmas.eval.anchor_pairs.collect_pairs` records on a calibration
  stream (the anchors' deltas);
* **base**: the source caches of the same pairs (the anchors' bases);
* **prefix-induced (PF)**: recurring private text. The same glue text (``"Notes from the
  solver:"``, an instruction) is prefilled after two agents' system prompts with the same
  question in between; the deviation of the glue's canonical KV between the two agents.
  Reported per instance and stacked over questions (one ``(Q*n) x D`` matrix per glue and
  agent pair: the subspace a profile computed once would have to capture).

For each: effective rank (singular values holding 90% of the squared spectrum), the energy
kept at rank 8 and 32, energy curves and per-layer effective rank. An ``n x D`` matrix has rank
at most ``min(n, D)``: short segments are below 32 trivially, so lengths are reported and the
delta claim is also checked on segments of at least 64 tokens.

Claims checked (paper): delta effective rank below 32; PF effective rank around 4-6 (taken
as a mean between 3 and 7) with rank 8 keeping over 90% of the energy; bases low-rank too,
with slightly higher effective rank than deltas.

Pieces: :mod:`.plan` (what is measured), :mod:`.spectra`, :mod:`.runs`, :mod:`.claims`,
:mod:`.report`.
"""

from __future__ import annotations

import argparse

from kvcmas.experiments import common
from kvcmas.experiments.lowrank.plan import add_arguments, smoke_args
from kvcmas.experiments.lowrank.report import markdown, plot
from kvcmas.experiments.lowrank.runs import analyse

__all__ = ["HELP", "add_arguments", "run", "smoke_args"]

HELP = "singular-value energy and effective rank of KV deltas, bases and prefix deviations"


def run(args: argparse.Namespace) -> int:
    log = common.Progress("lowrank")
    results = analyse(args, log)
    return common.finish(args.out, results, log, markdown, plot)
