"""Rotary position embeddings in closed form.

Keys are cached after RoPE. Rotating a key by an offset ``o`` multiplies each frequency pair
by a rotation of angle ``o * inv_freq``; rotations compose exactly, R(a)R(b) = R(a+b), which
is what lets a segment's keys move between positions (METHOD.md section 3).
Pairs follow the Hugging Face layout: channel i pairs with channel i + head_dim/2.
"""

from __future__ import annotations

import math

import torch

from kvcmas.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies (float32), with Llama-3 frequency scaling when configured."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s["factor"], inv)
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables [T, head_dim] for integer positions, computed in float32 like HF."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, head_dim] by per-row tables cos/sin [T, head_dim]."""
    return x * cos + rotate_half(x) * sin


def rotation_matrix(offset: int, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``R [head_dim, head_dim]`` with ``k @ R`` = ``k`` rotated by ``offset`` positions: pair
    (i, i + head_dim/2) turns by ``offset * inv_freq[i]``. The angle is formed in float64 so
    that de-rotating and re-rotating round-trips to the dtype's own precision even at large
    offsets; cos and sin are then rounded to ``dtype`` (as :func:`apply_rope`'s tables are)."""
    angle = offset * inv_freq.double()
    cos, sin = angle.cos(), angle.sin()
    half = len(inv_freq)
    i = torch.arange(half)
    r = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    r[i, i] = cos  # out[i] = k[i] cos - k[i+h] sin
    r[i + half, i] = -sin
    r[i + half, i + half] = cos  # out[i+h] = k[i+h] cos + k[i] sin
    r[i, i + half] = sin
    return r.to(dtype=dtype, device=inv_freq.device)


def rotate_keys(keys: torch.Tensor, offset: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate every key (any leading dims, last dim head_dim) by the same position offset.

    One GEMM against :func:`rotation_matrix`: each output sums two products in the GEMM's
    accumulator and is rounded once, in one pass over the keys (the elementwise form,
    ``k * cos + rotate_half(k) * sin``, makes four full-size temporaries: 8-25x slower on a
    2K-token span of every layer, most of it fresh-memory faults).
    """
    if offset == 0:
        return keys
    return keys @ rotation_matrix(offset, inv_freq, keys.dtype).to(keys.device)
