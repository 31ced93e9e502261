"""Per-layer truncated-SVD factors of segment KV matrices.

A segment's K (or V) in one layer is an ``n x D`` matrix (tokens by ``n_kv_heads*head_dim``).
Layer 0 is never stored: in the canonical frame its K/V depend only on token and position,
so cross-agent deviations there are exactly zero (METHOD.md section 4.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def as_matrices(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[L, H, n, Dh]`` -> ``[L, n, H*Dh]`` (float32), written into ``out`` when given."""
    n_layers, heads, n, dh = x.shape
    if out is not None:  # one strided, widening copy, no temporary
        out.view(n_layers, n, heads, dh).copy_(x.permute(0, 2, 1, 3))
        return out
    # Reordered in the source dtype, then widened: one strided pass over the narrow type
    # (a bf16 2K-token span: 23 against 38 ms); the same values.
    return x.permute(0, 2, 1, 3).reshape(n_layers, n, heads * dh).float()


class MatrixBuffer:
    """``as_matrices`` into one float32 buffer reused from call to call, grown to the longest
    input seen. A 2K-token span's matrices are 45 MB; freshly allocated, the allocator maps
    them anew and the copy faults them in page by page (measured on the 2-core AMX host:
    40-220 ms for K and V of a 2.3K-token span, against about 9 ms into a reused buffer).
    What ``matrices`` returns is overwritten by its next call: clone what you keep."""

    def __init__(self) -> None:
        self._flat = torch.empty(0)

    def matrices(self, x: torch.Tensor) -> torch.Tensor:
        n_layers, heads, n, dh = x.shape
        size = n_layers * n * heads * dh
        if self._flat.numel() < size:
            self._flat = torch.empty(size)
        return as_matrices(x, out=self._flat[:size].view(n_layers, n, heads * dh))

    def nbytes(self) -> int:
        return self._flat.numel() * self._flat.element_size()


@dataclass
class Factors:
    """``M[l] ≈ a[l] @ b[l]`` for every stored layer; ``b is None`` means ``a`` is ``M`` itself
    (full-dimensional storage, as KVCOMM keeps it)."""

    a: torch.Tensor  # [L', n, r] (or [L', n, D] when b is None)
    b: torch.Tensor | None  # [L', r, D]

    @property
    def length(self) -> int:
        return self.a.shape[1]

    @property
    def rank(self) -> int | None:
        return None if self.b is None else self.a.shape[2]

    def nbytes(self) -> int:
        size = self.a.numel() * self.a.element_size()
        return size + (0 if self.b is None else self.b.numel() * self.b.element_size())

    def layer_rows(self, layer: int, n: int) -> torch.Tensor:
        """The first ``n`` token rows of one stored layer at full width, ``[n, D]``."""
        a = self.a[layer, :n]
        return a if self.b is None else a @ self.b[layer]

    def rows(self, n: int) -> torch.Tensor:
        """The first ``n`` token rows of every layer at full width, ``[L', n, D]``."""
        return self.a[:, :n] if self.b is None else torch.bmm(self.a[:, :n], self.b)


def factorize(
    m: torch.Tensor, rank: int | None, seed: int = 0, oversample: int = 8, power_iters: int = 2
) -> Factors:
    """Rank-``rank`` factors of each ``m[l]`` by a seeded randomized range finder.

    ``rank`` None keeps ``m`` at full dimension, and so does a rank whose factors would not
    be smaller than the matrix. When ``rank + oversample`` reaches the matrix's smaller side,
    an exact SVD is used (truncation is then the only error).
    """
    n_layers, n, d = m.shape
    k = min(rank or n, n, d)
    if rank is None or k * (n + d) >= n * d:
        # Full width is exact, and for short spans (r >= n*D/(n+D)) also the smaller form.
        return Factors(m.float().contiguous(), None)
    m = m.float()
    if k + oversample >= min(n, d):
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
    else:
        # Drawn on the CPU and moved: the same seed gives the same sketch on every device.
        gen = torch.Generator().manual_seed(seed)
        omega = torch.randn(n_layers, d, k + oversample, generator=gen).to(m.device)
        q, _ = torch.linalg.qr(torch.bmm(m, omega))
        mt = m.transpose(1, 2)
        for _ in range(power_iters):  # sharpen the spectrum, re-orthonormalizing each pass
            q, _ = torch.linalg.qr(torch.bmm(mt, q))
            q, _ = torch.linalg.qr(torch.bmm(m, q))
        u_small, s, vh = torch.linalg.svd(torch.bmm(q.transpose(1, 2), m), full_matrices=False)
        u = torch.bmm(q, u_small)
    a = (u[:, :, :k] * s[:, None, :k]).contiguous()
    return Factors(a, vh[:, :k].contiguous())


def energy_rank(m: torch.Tensor, energy: float = 0.9) -> torch.Tensor:
    """Per layer, the number of singular values holding ``energy`` of the squared spectrum."""
    s = torch.linalg.svdvals(m.float())
    cum = (s**2).cumsum(-1) / (s**2).sum(-1, keepdim=True).clamp_min(1e-30)
    return (cum < energy).sum(-1) + 1
