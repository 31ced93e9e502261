"""Segment KV in the canonical frame (METHOD.md section 3).

A segment's keys are stored de-rotated so that its first token sits at position 0; values
are position-free. Placing the segment at absolute start ``p`` rotates its keys by ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcmas.model.cache import KVCache
from kvcmas.model.rope import rotate_keys


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


def place_segment(
    cache: KVCache, segment: SegmentKV, inv_freq: torch.Tensor, frame_offset: int = 0
) -> int:
    """Append ``segment`` at the end of ``cache``; return the start position it was placed at.

    ``frame_offset`` is the position of the segment's first token in its canonical frame: a
    span's tail cut after its first ``h`` tokens sits at ``h`` there, and is rotated by the
    span's start, not its own."""
    start = cache.length
    keys = segment.placed_keys(start - frame_offset, inv_freq)
    cache.append(keys.to(cache.dtype), segment.v.to(cache.dtype))
    return start
