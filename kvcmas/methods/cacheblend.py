"""CacheBlend (Yao et al., EuroSys'25): reuse, then recompute the most deviating tokens.

Per shared segment that has a source (METHOD.md section 5):

1. place the source cache (canonical frame, re-rotated to the hop's positions);
2. run layers ``0 .. check_layer`` for *all* shared tokens, writing their fresh K/V: those
   layers are then exactly dense (layer 0 would be exact anyway, but CacheBlend runs it and
   it is counted);
3. score every token by ``sum((V_fresh - V_reused)^2)`` over heads and channels at the check
   layer (``select_by="key"`` scores keys instead; both at the hop's positions);
4. keep the top ``ceil(ratio * n)`` tokens and run layers ``check_layer+1 .. L-1`` for those
   rows only, entering with their hidden output of the check layer from step 2 (the exact
   dense state, since every token ran every layer up to there). They attend with the exact
   causal mask to the prefix, to the fresh K/V of selected tokens and to the reused K/V of
   the rest. Private tokens after the segment are prefilled densely by the base class.

``computed_pairs = n * (check_layer + 1) + k * (L - check_layer - 1)``.

Interpretation at the ends of the ``ratio`` range:

* ``ratio=1`` selects every token: the segment equals NonShared's dense cache.
* ``ratio=0`` selects nothing, so the check-layer pass (whose only use is choosing tokens)
  is skipped too: no pair is computed and the cache equals FullShared's exactly. With any
  ``ratio > 0`` at least one token is selected and layers ``0..check_layer`` are recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcmas.methods.base import Method, SegmentRecord, dense_shared
from kvcmas.methods.config import MethodConfig, option, require
from kvcmas.methods.repair import check_layer_fits, fraction_count, repair_span
from kvcmas.methods.selective import place_source, recompute_record


def selected_count(ratio: float, n: int) -> int:
    """Tokens CacheBlend recomputes: ``ceil(ratio * n)`` (0 only for ratio 0)."""
    return fraction_count(ratio, n)


@dataclass(frozen=True)
class CacheBlendConfig(MethodConfig):
    method: ClassVar[str] = "cacheblend"
    ratio: float = option(0.15, "CacheBlend: fraction of shared tokens recomputed")
    check_layer: int = option(1, "CacheBlend: layer where deviation is measured")
    select_by: str = option(
        "value", "CacheBlend: deviation on values (released code) or keys", "--select-by"
    )

    def check(self) -> None:
        require(0.0 <= self.ratio <= 1.0, self.method, f"ratio must be in [0, 1], got {self.ratio}")
        require(self.check_layer >= 0, self.method, "check_layer must be >= 0")
        require(
            self.select_by in ("value", "key"), self.method, "select_by must be 'value' or 'key'"
        )


class CacheBlend(Method):
    """Steps 2-4 of the module docstring are :func:`kvcmas.methods.repair.repair_span` with
    no head and ``ceil(ratio * n)`` tokens chosen by deviation."""

    name = "cacheblend"
    Config = CacheBlendConfig

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        if shared.latest is None:
            return dense_shared(seg, shared, model, cache)
        n_layers, c = model.config.n_layers, self.config.check_layer
        check_layer_fits(c, n_layers)
        start = place_source(seg, shared, model, cache)
        n = len(seg)
        k = selected_count(self.config.ratio, n)
        repair = repair_span(
            model, cache, seg.tokens, start, extra=k, check_layer=c,
            score_on=self.config.select_by,
        )  # fmt: skip
        details = {"selected": repair.count, "check_layer": c}
        return recompute_record(seg, shared, start, repair.pairs, n_layers, n - k, **details)
