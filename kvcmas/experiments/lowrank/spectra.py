"""Spectra of families of ``n x D`` matrices: effective rank and energy kept at rank k."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvcmas.kv.lowrank import energy_rank

ENERGY = 0.9  # effective rank: singular values holding this share of the squared spectrum
CURVE_RANKS = 64


def energy_curve(m: torch.Tensor, max_rank: int = CURVE_RANKS) -> torch.Tensor:
    """``[L, max_rank]``: share of the squared spectrum of each ``m[l]`` in its top k values,
    k = 1..max_rank (1.0 past the matrix's rank)."""
    s2 = torch.linalg.svdvals(m.float()).pow(2)
    cum = s2.cumsum(-1) / s2.sum(-1, keepdim=True).clamp_min(1e-30)
    if cum.shape[-1] >= max_rank:
        return cum[:, :max_rank]
    pad = torch.ones(cum.shape[0], max_rank - cum.shape[-1])
    return torch.cat([cum, pad], dim=-1)


@dataclass
class Family:
    """Spectra of one family of matrices (e.g. delta K of query slots), instance by instance."""

    name: str
    lengths: list[int] = field(default_factory=list)
    bounds: list[int] = field(default_factory=list)  # min(n, D): the largest possible rank
    ranks: list[torch.Tensor] = field(default_factory=list)  # [L] effective rank each
    curves: list[torch.Tensor] = field(default_factory=list)  # [L, CURVE_RANKS] each

    def add(self, m: torch.Tensor) -> None:
        """One instance: ``[L, n, D]`` matrices (layers 1..L-1)."""
        self.lengths.append(m.shape[1])
        self.bounds.append(min(m.shape[1], m.shape[2]))
        self.ranks.append(energy_rank(m, ENERGY).float())
        self.curves.append(energy_curve(m))

    def summary(self, min_length: int = 0, name: str | None = None) -> dict[str, Any] | None:
        """Means over instances of at least ``min_length`` tokens (None when there are none)."""
        keep = [i for i, n in enumerate(self.lengths) if n >= min_length]
        if not keep:
            return None
        ranks = torch.stack([self.ranks[i] for i in keep])  # [I, L]
        curves = torch.stack([self.curves[i] for i in keep])  # [I, L, K]
        lengths = torch.tensor([self.lengths[i] for i in keep], dtype=torch.float)
        bounds = torch.tensor([self.bounds[i] for i in keep], dtype=torch.float)
        return {
            "family": name or self.name,
            "instances": len(keep),
            "tokens_mean": float(lengths.mean()),
            "tokens_min": int(lengths.min()),
            "tokens_max": int(lengths.max()),
            "effective_rank_mean": float(ranks.mean()),
            "effective_rank_median": float(ranks.median()),
            "effective_rank_p90": float(ranks.flatten().quantile(0.9)),
            "effective_rank_max": int(ranks.max()),
            "share_below_32": float((ranks < 32).float().mean()),
            "rank_fraction_mean": float((ranks / bounds[:, None]).mean()),
            "energy_at_8": float(curves[:, :, 7].mean()),
            "energy_at_32": float(curves[:, :, 31].mean()),
            "energy_at_8_min": float(curves[:, :, 7].min()),
            "rank_per_layer": ranks.mean(0).tolist(),
            "energy_curve": curves.mean((0, 1)).tolist(),
        }
