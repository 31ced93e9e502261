"""Segment KV in the canonical frame (METHOD.md section 3).

A segment's keys are stored de-rotated so that its first token sits at position 0; values
are position-free. Placing the segment at absolute start ``p`` rotates its keys by ``p``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvcmas.model.cache import KVCache
from kvcmas.model.rope import rotate_keys, rotation_matrix


@dataclass
class SegmentKV:
    """K and V ``[n_layers, n_kv_heads, n_tokens, head_dim]`` of one span, canonical frame."""

    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @classmethod
    def from_cache(cls, cache: KVCache, start: int, end: int, inv_freq: torch.Tensor) -> SegmentKV:
        """Copy positions ``[start, end)`` out of a context cache into the canonical frame."""
        k, v = cache.span(start, end)
        return cls(rotate_keys(k, -start, inv_freq), v)

    def placed_keys(self, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """Keys rotated to absolute positions ``start ..``."""
        return rotate_keys(self.k, start, inv_freq)


def place_segment(cache: KVCache, segment: SegmentKV, inv_freq: torch.Tensor) -> int:
    """Append ``segment`` at the end of ``cache``; return the start position it was placed at."""
    start = cache.length
    cache.append(segment.placed_keys(start, inv_freq).to(cache.dtype), segment.v.to(cache.dtype))
    return start


def place_layers(
    cache: KVCache,
    k_layers: Iterable[torch.Tensor],
    v_layers: Iterable[torch.Tensor],
    n: int,
    inv_freq: torch.Tensor,
) -> int:
    """Append an ``n``-token segment given one layer at a time (canonical-frame K and V
    ``[n_kv_heads, n, head_dim]`` per layer, any dtype) at the end of ``cache``; return its
    start. The same values as :func:`place_segment` of the stacked layers rounded to the
    cache's dtype, written straight into the cache: no full-size copy of the segment, whose
    fresh pages cost more than the arithmetic on a long span."""
    start = cache.length
    cache.extend_to(start + n)
    rotation = rotation_matrix(start, inv_freq, cache.dtype).to(cache.device)
    rounded = rotated = None  # one layer's keys in the cache's dtype, reused across layers
    layers = 0
    for layer, (k, v) in enumerate(zip(k_layers, v_layers, strict=True)):
        if rounded is None:
            rounded, rotated = (k.new_empty(k.shape, dtype=cache.dtype) for _ in range(2))
        rounded.copy_(k)
        torch.matmul(rounded, rotation, out=rotated)
        cache.k[layer, :, start : start + n] = rotated
        cache.v[layer, :, start : start + n] = v
        layers += 1
    if layers != cache.n_layers:
        raise ValueError(f"placed {layers} layers into a cache of {cache.n_layers}")
    return start
