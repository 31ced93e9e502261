"""Head recompute (EPIC / LegoLink): reuse each span uncorrected, recompute its first tokens.

Per shared segment that has a source: place the latest hop's cache of it at the hop's position
(FullShared), then recompute its first ``head_tokens`` tokens through every layer
(:func:`kvcmas.methods.repair.repair_span` with a head and nothing scored). Those tokens attend
only to the context before them and to each other, so they come out exactly dense; later
tokens keep the reused K/V but attend to the repaired head (the attention-sink tokens at a
span's start, where most of a reused span's deviation sits).

``head_tokens=0`` is FullShared exactly; ``head_tokens >= n`` recomputes the whole span:
NonShared exactly. ``computed_pairs = min(k, n) * L``; rho counts the other tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcmas.methods.base import Method, SegmentRecord, dense_shared
from kvcmas.methods.config import MethodConfig, option, require
from kvcmas.methods.repair import repair_span
from kvcmas.methods.selective import place_source, recompute_record

DEFAULT_HEAD_TOKENS = 16  # the probe: the first 16 tokens of a reused question


@dataclass(frozen=True)
class HeadRecomputeConfig(MethodConfig):
    method: ClassVar[str] = "headrecompute"
    head_tokens: int = option(DEFAULT_HEAD_TOKENS, "head recompute: first tokens recomputed (k)")

    def check(self) -> None:
        require(self.head_tokens >= 0, self.method, "head_tokens must be >= 0")


class HeadRecompute(Method):
    name = "headrecompute"
    Config = HeadRecomputeConfig

    def recomputed_tokens(self, length: int) -> int:
        return min(length, self.config.head_tokens)

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        if shared.latest is None:
            return dense_shared(seg, shared, model, cache)
        start = place_source(seg, shared, model, cache)
        repair = repair_span(model, cache, seg.tokens, start, head=self.config.head_tokens)
        n_layers, n = model.config.n_layers, len(seg)
        return recompute_record(
            seg, shared, start, repair.pairs, n_layers, n - repair.count, selected=repair.count
        )
