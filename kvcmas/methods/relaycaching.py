"""RelayCaching (Geng et al., 2026): reused KV with a recomputed band of middle layers.

Bands ``layers = (L_start, L_det, L_end)``, per shared segment that has a source
(METHOD.md section 5):

* layers ``[0, L_start)``: reused;
* layers ``[L_start, L_det)``: recomputed for every token of the segment, entering at
  ``L_start`` with the saved hidden state of the hop that computed the segment exactly (the
  same saved state as DroidSpeak's E-cache; agent outputs are captured while their producer
  decodes them). Without a saved state the band starts at layer 0 instead (counted);
* at ``L_det``: detection. Every token's fresh q, k, v of that layer are projected (one QKV
  GEMM, no attention or MLP) from the band's output. A token is selected when
  ``d_j = 1 - cos(v_reused_j, v_fresh_j) >= tau_dev * mean(d)`` (vectors over all kv heads
  and channels), or when the attention it receives at ``L_det`` from the last
  ``attention_queries`` (10) tokens is ``>= tau_inf * mean`` over the segment's tokens;
* layers ``[L_det, L_end]`` (inclusive): recomputed for the selected tokens only, entering
  at ``L_det`` with their hidden state from the band; others keep their reused K/V;
* layers above ``L_end``: reused.

Interpretations (the public description is thin):

* "The last 10 prompt tokens": the segment is built before the private text that follows it,
  so the queries are the last ``min(10, n)`` tokens *of the segment itself* (fresh queries at
  ``L_det``), attending causally to the hop's context so far and to the segment's fresh keys.
  Attention is averaged over query heads and those queries.
* ``computed_pairs = n * (L_det - first) + k * (L_end - L_det + 1)``, ``first`` being
  ``L_start`` (or 0 without a saved state). The detection projection of all ``n`` tokens is
  a fraction of a layer and is reported as ``details["detected"]``, not counted as pairs.
* ``layers`` is ``"A:B:C"``, a tuple, or the path of a profile JSON written by
  :func:`kvcmas.eval.profiles.profile_relay_layers` (where the deviation of reused K/V
  concentrates); ``None`` uses :func:`default_layers`.
* ``layers=(0, 0, L-1)`` with ``tau_dev=0`` selects and recomputes everything: NonShared's
  cache exactly. ``layers=(0, 0, c)`` (or ``(a, a, c)`` with a saved state at ``a``) with
  nothing selected (``tau_dev = tau_inf = inf``) computes no pair: FullShared's cache exactly.
* The source is the latest hop's cache of the segment (for an agent output, at first its
  producer's decode-phase KV), as for every method here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvcmas.errors import ConfigError
from kvcmas.methods.base import Method, SegmentRecord
from kvcmas.methods.config import MethodConfig, option, require
from kvcmas.methods.selective import (
    HiddenStore,
    check_layers,
    dense_saving_hidden,
    parse_layer_spec,
    place_source,
    recompute_record,
    segment_rows,
)
from kvcmas.model.cache import KVCache
from kvcmas.model.transformer import Transformer

DEFAULT_LAYER_FRACTIONS = (14 / 30, 17 / 30, 25 / 30)


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """Bands used without a profile: 14:17:25 of the default model's 30 layers (scaled by
    depth for other models).

    It is what :func:`~kvcmas.eval.profiles.profile_relay_layers` chose on the default model
    (fp32, roster workflow, 3 calibration questions, 9 hops): the shortest band holding half
    of the per-layer relative K+V deviation of reused caches is layers 14..25 (relative value
    error peaks at 0.25-0.26 in layers 17-19, against 0.02-0.08 in layers 1-3), and its first
    quarter (14..16) is recomputed for all tokens.
    """
    a, d, e = (round(f * n_layers) for f in DEFAULT_LAYER_FRACTIONS)
    e = min(e, n_layers - 1)
    return min(a, e), min(d, e), e


def received_attention(
    q: torch.Tensor, keys: torch.Tensor, q_positions: torch.Tensor, start: int
) -> torch.Tensor:
    """Mean attention probability each key at ``start..`` receives from queries ``q``.

    ``q [Hq, m, Dh]`` at ``q_positions``, ``keys [Hkv, T, Dh]`` at positions ``0..T-1``;
    exact causal mask; averaged over query heads and queries.
    """
    groups = q.shape[0] // keys.shape[0]
    k = keys.float().repeat_interleave(groups, dim=0)
    scores = q.float() @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    mask = torch.arange(keys.shape[1], device=keys.device)[None, :] <= q_positions[:, None]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return probs.mean((0, 1))[start:]


@dataclass(frozen=True)
class RelayCachingConfig(MethodConfig):
    method: ClassVar[str] = "relaycaching"
    layers: str | None = option(
        None, "RelayCaching: bands L_START:L_DET:L_END, or a profile JSON", "--relay-layers"
    )
    tau_dev: float = option(1.5, "RelayCaching: deviation threshold (x mean)")
    tau_inf: float = option(1.45, "RelayCaching: attention threshold (x mean)")

    def check(self) -> None:
        require(self.tau_dev >= 0 and self.tau_inf >= 0, self.method, "tau_dev, tau_inf >= 0")
        try:
            parse_layer_spec(self.layers, 3, "layers")
        except ValueError as e:
            raise ConfigError(f"method 'relaycaching': {e}") from None


class RelayCaching(Method):
    name = "relaycaching"
    Config = RelayCachingConfig
    needs_hidden_states = True
    attention_queries = 10

    def __init__(self, config: RelayCachingConfig | None = None):
        super().__init__(config)
        self._spec = parse_layer_spec(self.config.layers, 3, "layers")
        self._layers: tuple[int, int, int] | None = None
        self.tau_dev = self.config.tau_dev
        self.tau_inf = self.config.tau_inf
        self.hidden_store = HiddenStore(self.session_state)

    def params(self) -> dict[str, Any]:
        layers = self._layers or self._spec
        return {
            "layers": list(layers) if layers else "default",
            "tau_dev": self.tau_dev,
            "tau_inf": self.tau_inf,
            "attention_queries": self.attention_queries,
        }

    def resolve(self, n_layers: int) -> tuple[int, int, int]:
        if self._layers is None:
            layers = self._spec or default_layers(n_layers)
            check_layers(layers, n_layers - 1, "layers")
            self._layers = (int(layers[0]), int(layers[1]), int(layers[2]))
        return self._layers

    def build(self, hop, model, cache):
        self.resolve(model.config.n_layers)
        return super().build(hop, model, cache)

    def decode_capture_layers(self) -> tuple[int, ...]:
        a = (self._layers or (0, 0, 0))[0]
        return (a,) if a > 0 else ()

    def after_decode(self, hop, tokens, captured: dict[int, torch.Tensor]) -> None:
        for layer, hidden in captured.items():
            self.hidden_store.put(hop.session, tokens, layer, hidden)

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        n_layers = model.config.n_layers
        a, d, e = self.resolve(n_layers)
        if shared.latest is None:
            layers = self.decode_capture_layers()
            return dense_saving_hidden(hop, seg, shared, model, cache, self.hidden_store, layers)
        start = place_source(seg, shared, model, cache)
        n = len(seg)
        rows = segment_rows(start, n, cache.device)
        hidden, first = self._band(hop, seg, model, cache, rows)
        chosen = self._select(model, cache, hidden, rows, start)
        if len(chosen):
            model.forward(
                None,
                rows[chosen],
                cache,
                layers=range(d, e + 1),
                hidden=hidden[chosen],
                logits_rows=None,
            )
        pairs = n * (d - first) + len(chosen) * (e - d + 1)
        return recompute_record(
            seg,
            shared,
            start,
            pairs,
            n_layers,
            n - len(chosen),
            layers=[a, d, e],
            from_layer=first,
            selected=len(chosen),
            detected=n,
        )

    def _band(self, hop, seg, model: Transformer, cache: KVCache, rows: torch.Tensor):
        """Run ``[L_start, L_det)`` for all rows; their hidden input to ``L_det``, first layer."""
        a, d, _ = self._layers
        saved = self.hidden_store.get(hop.session, seg.tokens, a) if a > 0 else None
        if saved is not None and a == d:
            return saved, a
        ids = torch.tensor(seg.tokens, device=cache.device)
        if saved is None and d == 0:
            return model.embed_tokens(ids), 0
        first = a if saved is not None else 0
        out = model.forward(
            ids if saved is None else None,
            rows,
            cache,
            layers=range(first, d),
            hidden=saved,
            logits_rows=None,
        )
        return out.hidden, first

    def _select(
        self, model: Transformer, cache: KVCache, hidden: torch.Tensor, rows: torch.Tensor, start
    ) -> torch.Tensor:
        """Indices (into the segment) of tokens to recompute in ``[L_det, L_end]``."""
        d = self._layers[1]
        with torch.inference_mode():
            q, k, v = model.project_kv(d, hidden, rows)
        v_reused = cache.v[d, :, rows].float().transpose(0, 1).flatten(1)
        v_fresh = v.float().transpose(0, 1).flatten(1)
        dev = (1 - F.cosine_similarity(v_reused, v_fresh, dim=-1)).clamp_min(0)
        picked = dev >= self.tau_dev * dev.mean()
        m = min(self.attention_queries, len(rows))
        keys = torch.cat([cache.k[d, :, :start], k], dim=1)
        att = received_attention(q[:, -m:], keys, rows[-m:], start)
        picked |= att >= self.tau_inf * att.mean()
        return picked.nonzero().flatten()
