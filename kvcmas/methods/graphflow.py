"""GraphFlow (ICML'26): a per-request context-free base plus a sparse residual per path.

Per shared segment ``S`` in slot ``s`` of a hop of agent ``a`` (METHOD.md section 5):

* the first consumer of ``S`` prefills it densely (rule 4: no source exists yet);
* otherwise the **base** is a prefill of ``S`` alone from position 0 (no prefix: a full
  prefill of the span on the critical path), placed at the hop's position;
* a **residual** for the path ``(s, a)`` (slot name, consuming agent) is added when one is
  known: the ``residual_topk`` tokens with the largest ``||Y_dense - base||`` (K and V over
  all layers, heads and channels, canonical frame), recorded from an earlier dense hop of the
  same path, stored as those token indices and their full K/V deltas. It is applied by token
  index, only to indices below the segment's length.

Interpretations (the public description is thin):

* The first time a path is seen (with ``residual_topk > 0``) the hop prefills ``S`` densely
  and records the path's residual; the base prefill needed for that runs after the first token
  (``after_hop``), off the critical path, like anchor construction. Residuals persist across
  requests (``memory_bytes()`` reports them) and are never refreshed.
* ``residual_topk=0`` never records: every non-first consumer uses the base alone.
* The base is computed once per session and content, by the first hop that needs it (on
  that hop's critical path, ``n * L`` pairs, decision "partial"); later hops of the session
  place the same base (0 pairs, decision "reuse"). A span that extends a kept base (the
  connector's later hops often match the document together with the notes after it) has
  only its new tokens computed (:func:`~kvcmas.methods.base.kept_standalone_prefill`; those
  tokens are not served from a source). Bases are per-session state
  (:mod:`kvcmas.methods.session_state`: kept while sessions interleave in the connector,
  within its bound) and counted in ``memory_bytes()``. A base computed to record a residual
  (after the first token) is kept the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcmas.kv.segment import SegmentKV, place_segment
from kvcmas.methods.base import (
    Method,
    SegmentRecord,
    dense_shared,
    kept_standalone_prefill,
)
from kvcmas.methods.config import MethodConfig, option, require


@dataclass
class Residual:
    """Sparse correction of one (slot, consumer) path: token indices and their K/V deltas."""

    indices: torch.Tensor  # [k] sorted token indices
    k: torch.Tensor  # [n_layers, n_kv_heads, k, head_dim], canonical frame
    v: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.indices, self.k, self.v))

    def apply(self, base: SegmentKV) -> int:
        """Add the deltas of indices below ``len(base)`` to ``base`` in place; how many."""
        keep = self.indices < len(base)
        idx = self.indices[keep]
        base.k[:, :, idx] += self.k[:, :, keep]
        base.v[:, :, idx] += self.v[:, :, keep]
        return int(keep.sum())


def top_residual(dense: SegmentKV, base: SegmentKV, topk: int) -> Residual:
    """The ``topk`` tokens of ``dense - base`` with the largest norm (all layers, K and V)."""
    dk, dv = dense.k - base.k, dense.v - base.v
    norms = dk.float().pow(2).sum((0, 1, 3)) + dv.float().pow(2).sum((0, 1, 3))
    idx = torch.topk(norms, min(topk, len(dense))).indices.sort().values
    return Residual(idx, dk[:, :, idx].clone(), dv[:, :, idx].clone())


@dataclass(frozen=True)
class GraphFlowConfig(MethodConfig):
    method: ClassVar[str] = "graphflow"
    residual_topk: int = option(16, "GraphFlow: sparse residual tokens per (slot, consumer) path")

    def check(self) -> None:
        require(self.residual_topk >= 0, self.method, "residual_topk must be >= 0")


class GraphFlow(Method):
    name = "graphflow"
    Config = GraphFlowConfig
    learns_across_requests = True

    def __init__(self, config: GraphFlowConfig | None = None):
        super().__init__(config)
        self.residual_topk = self.config.residual_topk
        self.residuals: dict[tuple[str, str], Residual] = {}
        # (path, start in the hop's cache, tokens) of residuals to record after the hop
        self._pending: list[tuple[tuple[str, str], int, tuple[int, ...]]] = []
        self._model = None  # the model of the hop being built (for after_hop)

    def memory_bytes(self) -> int:
        return sum(r.nbytes() for r in self.residuals.values()) + super().memory_bytes()

    def build_segments(self, hop, model, cache):
        # Here rather than in build: the serving connector builds its ranges through this.
        self._model = model
        self._pending.clear()
        return super().build_segments(hop, model, cache)

    def base(self, session: str, tokens: tuple[int, ...]) -> tuple[SegmentKV, int]:
        """The session's context-free base of ``tokens``; how many tokens were computed now."""
        return kept_standalone_prefill(self.session_state, session, "base", self._model, tokens)

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        if shared.latest is None:
            return dense_shared(seg, shared, model, cache)
        path = (seg.slot, hop.agent)
        residual = self.residuals.get(path)
        if residual is None and self.residual_topk > 0:
            self._pending.append((path, cache.length, seg.tokens))
            rec = dense_shared(seg, shared, model, cache)
            rec.details = {"records_residual": True}
            return rec
        base, computed = self.base(hop.session, seg.tokens)
        kv = SegmentKV(base.k.clone(), base.v.clone())
        applied = residual.apply(kv) if residual is not None else 0
        start = place_segment(cache, kv, model.inv_freq)
        n = len(seg)
        pairs = computed * model.config.n_layers
        how = "cached" if computed == 0 else "computed" if computed == n else "extended"
        details = {"base": how, "residual_tokens": applied}
        decision = "partial" if computed else "reuse"
        # Tokens of the base computed just now are a prefill: they came from no source.
        served = n - computed
        return SegmentRecord(
            seg.slot, shared.kind, start, n, decision, pairs, served, details=details
        )

    def after_hop(self, hop, build) -> None:
        """Record the residuals of paths seen for the first time in this hop (dense hops)."""
        inv_freq = self._model.inv_freq
        for path, start, tokens in self._pending:
            dense = SegmentKV.from_cache(build.cache, start, start + len(tokens), inv_freq)
            base, _ = self.base(hop.session, tokens)
            self.residuals[path] = top_residual(dense, base, self.residual_topk)
        self._pending.clear()
