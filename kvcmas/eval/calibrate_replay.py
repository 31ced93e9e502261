"""Former home of the offline calibration replay, which is gone (calibration runs online:
:mod:`kvcmas.experiments.calibrate`). Pair recording moved to :mod:`kvcmas.eval.anchor_pairs`;
this alias stays only until ``kvcmas.experiments.lowrank`` imports it from there."""

from kvcmas.eval.anchor_pairs import EdgePair, collect_pairs

__all__ = ["EdgePair", "collect_pairs"]
