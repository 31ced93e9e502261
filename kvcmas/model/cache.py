"""The KV cache of one context: explicit per-layer keys and values at absolute positions."""

from __future__ import annotations

import torch


class KVCache:
    """Keys/values of positions ``0..length-1`` for every layer.

    ``k`` and ``v`` are ``[n_layers, n_kv_heads, capacity, head_dim]``; keys are stored after
    RoPE at their absolute positions. Capacity grows by doubling so that decoding appends in
    amortized O(1) copies.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity: int = 256,
        device: torch.device | str = "cpu",
    ):
        shape = (n_layers, n_kv_heads, max(capacity, 1), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions, keeping what is stored."""
        cap = self.k.shape[2]
        if length <= cap:
            return
        new_cap = max(length, 2 * cap)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
            grown[:, :, :cap] = old
            setattr(self, name, grown)

    def extend_to(self, length: int) -> None:
        self.reserve(length)
        self.length = max(self.length, length)

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer, :, : self.length]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer, :, : self.length]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows ``k, v [n_kv_heads, T, head_dim]`` at ``positions`` (on the cache's
        device) of one layer."""
        self.k[layer].index_copy_(1, positions, k)
        self.v[layer].index_copy_(1, positions, v)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append a span ``k, v [n_layers, n_kv_heads, n, head_dim]`` at the end."""
        start, n = self.length, k.shape[2]
        self.extend_to(start + n)
        self.k[:, :, start : start + n] = k
        self.v[:, :, start : start + n] = v

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of all layers' K and V for positions ``[start, end)``."""
        return self.k[:, :, start:end].clone(), self.v[:, :, start:end].clone()

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def clone(self) -> KVCache:
        out = KVCache.__new__(KVCache)
        out.k = self.k[:, :, : self.length].clone()
        out.v = self.v[:, :, : self.length].clone()
        out.length = self.length
        return out

    def nbytes(self) -> int:
        """Bytes of the live positions (capacity slack is not counted)."""
        per_pos = self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        return 2 * per_pos * self.length
