"""Pieces shared by the selective-recomputation baselines (CacheBlend, DroidSpeak, RelayCaching).

They all start from the same move: place the source cache of a shared segment at the hop's
position (FullShared), then run some (token, layer) pairs of the segment through the model
again on top of it, writing fresh K/V over the reused ones. ``computed_pairs`` counts exactly
the pairs run through a layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcmas.chat import Segment
from kvcmas.kv.segment import place_segment
from kvcmas.methods.base import Hop, SegmentRecord, SharedSegment
from kvcmas.methods.session_state import SessionState
from kvcmas.model.cache import KVCache
from kvcmas.model.transformer import Transformer

LayerSpec = str | tuple[int, ...] | list[int] | None


class HiddenStore:
    """Saved hidden states of shared segments (DroidSpeak's "E-cache"), per session.

    Keyed by content: ``(segment token ids, layer)`` -> the hidden input to ``layer`` of every
    token of that segment, as computed by the hop that produced the cache later hops reuse (the
    segment's first consumer, or for an agent output its producer while decoding). Kept in the
    method's :class:`SessionState`: a state is never served to another session.
    """

    def __init__(self, state: SessionState) -> None:
        self._state = state

    def put(self, session: str, tokens: tuple[int, ...], layer: int, hidden: torch.Tensor) -> None:
        if hidden.shape[0] != len(tokens):
            raise ValueError(f"hidden state of {hidden.shape[0]} rows for {len(tokens)} tokens")
        self._state.put(session, ("hidden", tuple(tokens), layer), hidden)

    def get(self, session: str, tokens: tuple[int, ...], layer: int) -> torch.Tensor | None:
        """The saved state of this content in this session, or None."""
        return self._state.get(session, ("hidden", tuple(tokens), layer))


def parse_layer_spec(value: LayerSpec, parts: int, name: str) -> tuple[int, ...] | None:
    """``"S:E"`` / ``(S, E)`` (or ``A:B:C`` with ``parts=3``) as ints; a ``.json`` path is
    read as a saved profile holding ``name``; None stays None (the method's default)."""
    if value is None:
        return None
    if isinstance(value, str) and (value.endswith(".json") or Path(value).is_file()):
        return parse_layer_spec(load_profile(value, name), parts, name)
    items = value.split(":") if isinstance(value, str) else list(value)
    try:
        out = tuple(int(x) for x in items)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be {parts} integers like {':'.join('N' * parts)}, got {value!r}"
        ) from None
    if len(out) != parts:
        raise ValueError(f"{name} needs {parts} layer numbers separated by ':', got {value!r}")
    if any(x < 0 for x in out) or list(out) != sorted(out):
        raise ValueError(f"{name} must be non-decreasing layer numbers >= 0, got {value!r}")
    return out


def load_profile(path: str | Path, key: str) -> list[int]:
    """The layer numbers stored under ``key`` in a profile JSON written by kvcmas.eval.profiles."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"profile file not found: {path}")
    data = json.loads(path.read_text())
    if key not in data:
        raise ValueError(f"profile {path} has no {key!r} entry")
    return list(data[key])


def check_layers(layers: tuple[int, ...], n_layers: int, name: str) -> None:
    if layers and max(layers) > n_layers:
        raise ValueError(f"{name} {layers} exceeds the model's {n_layers} layers")


def place_source(seg: Segment, shared: SharedSegment, model: Transformer, cache: KVCache) -> int:
    """Place the latest source of ``seg`` at the end of ``cache`` (all layers); its start."""
    src = shared.latest
    if src is None or len(src) != len(seg):
        raise ValueError(f"slot {seg.slot!r}: no source cache of {len(seg)} tokens to reuse")
    return place_segment(cache, src, model.inv_freq)


def segment_rows(start: int, n: int, device: torch.device) -> torch.Tensor:
    """Positions ``start .. start+n-1`` on ``device`` (the cache's)."""
    return torch.arange(start, start + n, device=device)


def dense_saving_hidden(
    hop: Hop,
    seg: Segment,
    shared: SharedSegment,
    model: Transformer,
    cache: KVCache,
    store: HiddenStore,
    layers: tuple[int, ...],
) -> SegmentRecord:
    """Prefill a shared segment densely and save its hidden input to ``layers`` in ``store``."""
    start, n = cache.length, len(seg)
    ids = torch.tensor(seg.tokens, device=cache.device)
    rows = segment_rows(start, n, cache.device)
    out = model.forward(ids, rows, cache, logits_rows=None, capture=layers)
    for layer, hidden in out.captured.items():
        store.put(hop.session, seg.tokens, layer, hidden)
    return SegmentRecord(seg.slot, shared.kind, start, n, "dense", n * model.config.n_layers)


def recompute_record(
    seg: Segment,
    shared: SharedSegment,
    start: int,
    pairs: int,
    n_layers: int,
    served: int,
    **details,
) -> SegmentRecord:
    """A reused segment with ``pairs`` recomputed: "reuse" (none), "partial", or "dense" (all).
    ``served`` tokens came from the source (not selected for recomputation)."""
    n = len(seg)
    decision = "reuse" if pairs == 0 else "dense" if pairs >= n * n_layers else "partial"
    served = 0 if decision == "dense" else served
    details = {"source": shared.latest_agent, **details}
    return SegmentRecord(seg.slot, shared.kind, start, n, decision, pairs, served, details=details)
