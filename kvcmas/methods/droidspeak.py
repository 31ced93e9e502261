"""DroidSpeak (Liu et al., NSDI'26): reuse the source KV outside one contiguous layer block.

Per shared segment that has a source (METHOD.md section 5): place the source cache, then run
layers ``[s, e)`` for every token of the segment, entering at layer ``s`` with the source hop's
hidden state there (the "E-cache"); layers outside the block keep the reused K/V.
``computed_pairs = n * (e - s)``.

Interpretations (the public description is thin):

* **E-cache.** The hop that computes a segment exactly saves its hidden input to layer ``s``:
  the first consumer of a query or input (dense prefill), or the producer of an agent output
  while decoding it (the runner's decode-capture hook). Later hops reuse the *latest* cache,
  whose layers below ``s`` are the exact hop's unchanged, so its hidden state at ``s`` is the
  saved one. ``s = 0`` starts from the token embeddings and needs no E-cache. When none is
  saved (a source this method did not produce) the block is run from layer 0 instead, and
  the extra pairs are counted (``details["from_layer"] = 0``). The E-cache of the current
  request is reported by ``memory_bytes()``.
* **Block.** ``block`` is ``"S:E"``, a tuple, or the path of a profile JSON written by
  :func:`kvcmas.eval.profiles.profile_droidspeak_block` (the smallest block within a
  first-token-KL tolerance against dense on a calibration split, one-hop replay from dense
  sources). ``block=None`` uses :func:`default_block`, derived from that profile on the
  default model (see its docstring).
* ``block=(0, L)`` recomputes every layer from the embeddings: NonShared's cache exactly.
  An empty block (``s == e``) computes nothing: FullShared's cache exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcmas.errors import ConfigError
from kvcmas.methods.base import Method, SegmentRecord
from kvcmas.methods.config import MethodConfig, option
from kvcmas.methods.selective import (
    HiddenStore,
    check_layers,
    dense_saving_hidden,
    parse_layer_spec,
    place_source,
    recompute_record,
    segment_rows,
)

DEFAULT_BLOCK_FRACTION = (6 / 30, 28 / 30)


def default_block(n_layers: int) -> tuple[int, int]:
    """The block used without a profile: layers ``[round(0.2 L), round(0.93 L))``, [6, 28) of
    the default model's 30 layers.

    It is what :func:`~kvcmas.eval.profiles.profile_droidspeak_block` chose on the default
    model (fp32, roster workflow, 3 calibration questions distinct from the report questions,
    9 hops, tolerance: mean first-token KL <= 0.005 against dense). Reuse without recompute
    gave KL 0.033 there; the best blocks of 3, 6, 9 and 15 layers reached 0.024 ([15, 18)),
    0.020 ([15, 21)), 0.017 ([12, 21)) and 0.010 ([9, 24)); blocks starting at layer 0 helped
    least (0.030 for [0, 9)): on this model the deviation that matters for the next token
    builds up in the middle layers. Other models should be profiled.
    """
    a, b = DEFAULT_BLOCK_FRACTION
    return round(a * n_layers), max(round(a * n_layers), round(b * n_layers))


@dataclass(frozen=True)
class DroidSpeakConfig(MethodConfig):
    method: ClassVar[str] = "droidspeak"
    block: str | None = option(
        None, "DroidSpeak: recomputed layers START:END, or a profile JSON (default: profiled)"
    )

    def check(self) -> None:
        try:
            parse_layer_spec(self.block, 2, "block")
        except ValueError as e:
            raise ConfigError(f"method 'droidspeak': {e}") from None


class DroidSpeak(Method):
    name = "droidspeak"
    Config = DroidSpeakConfig
    needs_hidden_states = True

    def __init__(self, config: DroidSpeakConfig | None = None):
        super().__init__(config)
        self._spec = parse_layer_spec(self.config.block, 2, "block")
        self._block: tuple[int, int] | None = None
        self.hidden_store = HiddenStore(self.session_state)

    def params(self) -> dict[str, Any]:
        block = self._block or self._spec
        return {"block": list(block) if block else "default"}

    def resolve(self, n_layers: int) -> tuple[int, int]:
        """The block for a model of ``n_layers`` (fixed at the first hop)."""
        if self._block is None:
            block = self._spec or default_block(n_layers)
            check_layers(block, n_layers, "block")
            self._block = (int(block[0]), int(block[1]))
        return self._block

    def build(self, hop, model, cache):
        self.resolve(model.config.n_layers)
        return super().build(hop, model, cache)

    def decode_capture_layers(self) -> tuple[int, ...]:
        s, e = self._block or (0, 0)
        return (s,) if 0 < s < e else ()

    def after_decode(self, hop, tokens, captured: dict[int, torch.Tensor]) -> None:
        for layer, hidden in captured.items():
            self.hidden_store.put(hop.session, tokens, layer, hidden)

    def build_shared(self, hop, seg, shared, model, cache) -> SegmentRecord:
        n_layers = model.config.n_layers
        s, e = self.resolve(n_layers)
        if shared.latest is None:
            layers = self.decode_capture_layers()
            return dense_saving_hidden(hop, seg, shared, model, cache, self.hidden_store, layers)
        start = place_source(seg, shared, model, cache)
        n = len(seg)
        if s == e:
            return recompute_record(seg, shared, start, 0, n_layers, n, block=[s, e])
        hidden = self.hidden_store.get(hop.session, seg.tokens, s) if s > 0 else None
        first = s if hidden is not None else 0
        model.forward(
            torch.tensor(seg.tokens, device=cache.device) if hidden is None else None,
            segment_rows(start, n, cache.device),
            cache,
            layers=range(first, e),
            hidden=hidden,
            logits_rows=None,
        )
        pairs = n * (e - first)
        return recompute_record(
            seg, shared, start, pairs, n_layers, n, block=[s, e], from_layer=first
        )
