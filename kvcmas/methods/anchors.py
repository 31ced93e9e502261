"""The anchor pool shared by KVCMAS and KVCOMM (METHOD.md sections 4.2-4.5).

An anchor remembers, for one (slot, consumer) edge, a source cache X of some earlier content
(the *base*) and how the consumer's dense cache differed from it (the *delta*). A new source
is matched against the bases token by token; the deltas of close anchors, weighted by a
softmax over scale-free distances, estimate the new correction. All tensors here are
``[L-1, n, D]`` matrices over layers 1..L-1 in the canonical frame, float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvcmas.kv.lowrank import Factors, factorize

# Bases up to this many floats are expanded for all layers at once (one batched GEMM);
# longer ones one layer at a time, so a long anchor is never held at full width.
_BATCH_FLOATS = 1 << 22


def _abs_mean(x: torch.Tensor) -> torch.Tensor:
    """Per-token mean ``|x|`` over layers and channels, without a full-width ``|x|`` copy."""
    return torch.linalg.vector_norm(x, 1, dim=(0, 2)) / (x.shape[0] * x.shape[2])


def _gap_scratch(x: torch.Tensor) -> torch.Tensor:
    """Room for :func:`_abs_gap`'s expanded layers of ``x`` (or of any prefix of its tokens)."""
    n_layers, n, d = x.shape
    return x.new_empty(min(n_layers * n * d, max(_BATCH_FLOATS, n * d)))


def _abs_gap(
    x: torch.Tensor, base: Factors, m: int, scratch: torch.Tensor | None
) -> torch.Tensor:
    """Per-token mean ``|x - base|`` over layers and channels, for the first ``m`` tokens.

    A low-rank base is expanded as ``x - a @ b`` in one fused GEMM, a few layers at a time
    (at most ``_BATCH_FLOATS`` floats), so a long anchor is never held at full width. The
    layers are expanded into ``scratch`` (from :func:`_gap_scratch`; only a low-rank base
    needs it), reused across anchors: a fresh 16 MB tensor per step costs more in page faults
    than the GEMM (1.7x at 2K)."""
    n_layers, d = x.shape[0], x.shape[2]
    if base.b is None:
        return _abs_mean(x[:, :m] - base.a[:, :m])
    step = max(1, _BATCH_FLOATS // max(1, m * d))
    total = x.new_zeros(m)
    for lo in range(0, n_layers, step):
        hi = min(n_layers, lo + step)
        gap = scratch[: (hi - lo) * m * d].view(hi - lo, m, d)
        torch.baddbmm(x[lo:hi, :m], base.a[lo:hi, :m], base.b[lo:hi], alpha=-1, out=gap)
        total += gap.abs_().mean(dim=2).sum(dim=0)
    return total / n_layers


@dataclass
class Anchor:
    base_k: Factors
    base_v: Factors
    delta_k: Factors
    delta_v: Factors
    created: int  # pool step at creation: the age used by eviction
    uses: int = 0

    @property
    def length(self) -> int:
        return self.base_k.length

    def nbytes(self) -> int:
        return sum(f.nbytes() for f in (self.base_k, self.base_v, self.delta_k, self.delta_v))


@dataclass
class Match:
    """The outcome of matching one source against a pool."""

    anchors: list[int]  # indices of the anchors that took part
    token_weights: torch.Tensor  # [A, n]: per-token softmax over covering anchors (0 elsewhere)
    span_weights: torch.Tensor  # [A]: softmax of span-level distances
    span_distance: torch.Tensor  # [A]
    entropy: float  # normalized entropy of span_weights in [0, 1]


@dataclass(frozen=True)
class CorrectionCheck:
    """A correction measured against exact rows (:meth:`AnchorPool.check_correction`)."""

    keep: bool  # the corrected rows are closer to exact than the source's
    corrected: float  # relative squared error of source + correction
    source: float  # relative squared error of the source alone


@dataclass(frozen=True)
class PoolConfig:
    """How a pool stores and matches anchors; built by the methods' configs, which hold the
    defaults (:class:`~kvcmas.methods.kvcmas.KVCMASConfig`)."""

    temperature: float  # T
    capacity: int = 10  # V
    delta_rank: int | None = 32  # r for deltas; None = full dimension
    base_rank: int | None = 32  # r for bases; None = full dimension
    eviction: str = "least-used"  # or "kvcomm": least used among the 5 oldest
    full_cover_only: bool = False  # KVCOMM: only anchors at least as long as the source
    seed: int = 0


@dataclass
class AnchorPool:
    config: PoolConfig
    anchors: list[Anchor] = field(default_factory=list)
    steps: int = 0

    def nbytes(self) -> int:
        return sum(a.nbytes() for a in self.anchors)

    def add(
        self, x_k: torch.Tensor, x_v: torch.Tensor, y_k: torch.Tensor, y_v: torch.Tensor
    ) -> None:
        """Record an anchor from source X and dense Y (``[L-1, n, D]`` each)."""
        c = self.config
        seed = c.seed + self.steps  # deterministic: same inputs in the same order, same factors
        anchor = Anchor(
            base_k=factorize(x_k, c.base_rank, seed),
            base_v=factorize(x_v, c.base_rank, seed + 1),
            delta_k=factorize(y_k - x_k, c.delta_rank, seed + 2),
            delta_v=factorize(y_v - x_v, c.delta_rank, seed + 3),
            created=self.steps,
        )
        self.steps += 1
        if len(self.anchors) >= c.capacity:
            self.anchors.pop(self._victim())
        self.anchors.append(anchor)

    def _victim(self) -> int:
        candidates = list(range(len(self.anchors)))
        if self.config.eviction == "kvcomm":
            candidates = sorted(candidates, key=lambda i: self.anchors[i].created)[:5]
        # Lowest use count; oldest first on ties.
        return min(candidates, key=lambda i: (self.anchors[i].uses, self.anchors[i].created))

    def eligible(self, n: int) -> list[int]:
        if self.config.full_cover_only:
            return [i for i, a in enumerate(self.anchors) if a.length >= n]
        return list(range(len(self.anchors)))

    def match(self, x_k: torch.Tensor, x_v: torch.Tensor) -> Match | None:
        """Scale-free, position-aligned distances of source X to every eligible anchor's base.

        Bases are reconstructed one anchor at a time, only for the tokens they share with X.
        """
        n = x_k.shape[1]
        idx = self.eligible(n)
        if not idx:
            return None
        t_ = self.config.temperature
        # Per-token |X| averaged over layers and channels: the distances' scale.
        scale_k = _abs_mean(x_k).clamp_min(1e-12)
        scale_v = _abs_mean(x_v).clamp_min(1e-12)
        dist = x_k.new_full((len(idx), n), float("inf"))
        span = x_k.new_empty(len(idx))
        # Full-width bases (KVCOMM's) are subtracted directly: no scratch for them.
        low_rank = any(b.b is not None for i in idx
                       for b in (self.anchors[i].base_k, self.anchors[i].base_v))
        scratch = _gap_scratch(x_k) if low_rank else None
        for j, i in enumerate(idx):
            a = self.anchors[i]
            m = min(n, a.length)
            dk, dv = _abs_gap(x_k, a.base_k, m, scratch), _abs_gap(x_v, a.base_v, m, scratch)
            dist[j, :m] = 0.5 * (dk / scale_k[:m] + dv / scale_v[:m])
            span[j] = dist[j, :m].mean()
        token_w = torch.softmax(-dist / t_, dim=0).nan_to_num(0.0)  # uncovered tokens: all -inf
        span_w = torch.softmax(-span / t_, dim=0)
        ent = -(span_w * span_w.clamp_min(1e-30).log()).sum().item()
        entropy = ent / math.log(len(idx)) if len(idx) > 1 else 0.0
        return Match(idx, token_w, span_w, span, entropy)

    def correction(self, match: Match, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted deltas ``[L-1, n, D]`` for K and V.

        With low-rank deltas this is one batched GEMM per K/V over every layer: the weighted
        ``A`` factors of all anchors are concatenated along the rank axis against the stacked
        ``B`` factors. Tokens no anchor covers get zero correction.
        """
        return self._correction(match, n, "k"), self._correction(match, n, "v")

    def corrected_layers(self, match: Match, x: torch.Tensor, which: str) -> Iterator[torch.Tensor]:
        """``X + correction`` one layer at a time, ``[n, D]`` float32 in one buffer that each
        step overwrites (copy what you keep). Per layer the low-rank GEMM adds onto ``X`` in a
        buffer that stays in cache, so a caller writing the span in its own layout and dtype
        never makes a full-width float32 copy. ``which`` is "k" or "v"."""
        full, a_cat, b_cat = self._terms(match, x.shape[1], which)
        buffer = x.new_empty(x.shape[1:])
        for layer in range(x.shape[0]):
            if full is None:
                buffer.copy_(x[layer])
            else:
                torch.add(x[layer], full[layer], out=buffer)
            if a_cat is not None:
                buffer.addmm_(a_cat[layer], b_cat[layer])
            yield buffer

    def _correction(self, match: Match, n: int, which: str) -> torch.Tensor:
        full, a_cat, b_cat = self._terms(match, n, which)
        if a_cat is None:
            return full
        return torch.bmm(a_cat, b_cat) if full is None else torch.baddbmm(full, a_cat, b_cat)

    def _terms(self, match: Match, n: int, which: str):
        """The weighted correction as (the full-width anchors' sum or None, A, B): the low-rank
        anchors' token-weighted ``A`` factors concatenated along the rank axis (None if there
        are none) against their stacked ``B`` factors."""
        parts_a, parts_b, full = [], [], None
        for j, i in enumerate(match.anchors):
            f = getattr(self.anchors[i], f"delta_{which}")
            m = min(n, f.length)
            w = match.token_weights[j, :m][None, :, None]
            weighted = f.a.new_zeros(f.a.shape[0], n, f.a.shape[2])
            weighted[:, :m] = w * f.a[:, :m]
            if f.b is None:
                full = weighted if full is None else full + weighted
            else:
                parts_a.append(weighted)
                parts_b.append(f.b)
        if not parts_a:
            return full, None, None
        return full, torch.cat(parts_a, dim=2), torch.cat(parts_b, dim=1)

    def check_correction(
        self,
        match: Match,
        x: tuple[torch.Tensor, torch.Tensor],
        y: tuple[torch.Tensor, torch.Tensor],
        first_row: int,
    ) -> CorrectionCheck:
        """Does ``match``'s correction bring source ``x`` (K, V over the whole span) closer to
        exact rows ``y`` (K, V of the span's first ``h`` tokens)? Compared on rows
        ``first_row..h-1`` as relative squared errors, K's and V's added."""
        h = y[0].shape[1]
        deltas = self.correction(match, h)
        corrected = source = 0.0
        for x_m, d, y_m in zip(x, deltas, y, strict=True):
            exact, rows = y_m[:, first_row:h], slice(first_row, h)
            gap = exact - x_m[:, rows]
            scale = exact.pow(2).sum().clamp_min(1e-30)
            source += float(gap.pow(2).sum() / scale)
            corrected += float((gap - d[:, rows]).pow(2).sum() / scale)
        return CorrectionCheck(corrected < source, corrected, source)

    def count_uses(self, match: Match) -> None:
        """A use is a reuse on which the anchor's span weight is at least 1/|A|."""
        threshold = (1.0 - 1e-6) / len(match.anchors)  # a uniform weight counts as a use
        for j, i in enumerate(match.anchors):
            if match.span_weights[j] >= threshold:
                self.anchors[i].uses += 1
