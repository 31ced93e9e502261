"""Fidelity of a hop's context KV against NonShared's dense KV of the same token sequence.

The reference model may differ in dtype from the method's (fp32 by default), so NonShared
run in bf16 with a comparison measures the numerical noise floor (METHOD.md section 2, rule 6).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvcmas.model.cache import KVCache
from kvcmas.model.generate import greedy_decode
from kvcmas.model.loader import LoadedModel
from kvcmas.model.transformer import Transformer
from kvcmas.workflow.runner import HopView, PrefixCache


@dataclass
class HopFidelity:
    kv_rel_error: float  # over K and V of every prompt position after the system prefix
    k_rel_error: float
    v_rel_error: float
    k_rel_error_per_layer: list[float]
    v_rel_error_per_layer: list[float]
    first_token_kl: float
    continuation_kl: float  # mean KL along the reference's own greedy output, teacher-forced
    same_output: bool
    reference_output: list[int]
    segment_errors: list[float]  # K and V relative error of each shared segment, in order


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row, from float logits."""
    ref = F.log_softmax(ref_logits.float(), dim=-1)
    other = F.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - other)).sum(-1)


def relative_errors(
    approx: torch.Tensor, ref: torch.Tensor
) -> tuple[float, list[float], torch.Tensor, torch.Tensor]:
    """Overall and per-layer ||a - r|| / ||r|| of ``[L, H, T, Dh]`` tensors (float32)."""
    diff = (approx.float() - ref.float()).pow(2).sum(dim=(1, 2, 3))
    norm = ref.float().pow(2).sum(dim=(1, 2, 3))
    per_layer = (diff / norm.clamp_min(1e-30)).sqrt().tolist()
    return float((diff.sum() / norm.sum()).sqrt()), per_layer, diff, norm


def teacher_forced_logits(
    model: Transformer,
    cache: KVCache,
    prompt_len: int,
    first_logits: torch.Tensor,
    tokens: list[int],
) -> torch.Tensor:
    """Logits predicting each of ``tokens`` given the prompt and the tokens before it."""
    cache.truncate(prompt_len)
    rows = [first_logits[None]]
    if len(tokens) > 1:
        ids = torch.tensor(tokens[:-1], device=cache.device)
        pos = torch.arange(prompt_len, prompt_len + len(ids), device=cache.device)
        rows.append(model.forward(ids, pos, cache, logits_rows=slice(None)).logits)
    cache.truncate(prompt_len)
    return torch.cat(rows)


def forced_tokens(output: list[int], first_logits: torch.Tensor) -> list[int]:
    """What a reference is teacher-forced along: its greedy output, or the first token's
    argmax where the output is empty (a stop token came first)."""
    return output or [int(first_logits.argmax())]


@dataclass(frozen=True)
class ReferenceHop:
    """A dense reference prefill of one prompt, what a method's hop is compared against: its
    K and V after the system prefix, its greedy output, and its logits teacher-forced along
    ``forced`` (that output, or the first token's argmax if it is empty; row 0 predicts the
    first token)."""

    prefix_len: int
    k: torch.Tensor  # [L, H, prompt - prefix, Dh]
    v: torch.Tensor
    output: list[int]
    rows: torch.Tensor  # [len(forced), vocab]

    @property
    def forced(self) -> list[int]:
        return forced_tokens(self.output, self.rows[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.rows))


def reference_hop(
    ref_model: Transformer, ref_prefix: KVCache, prompt: list[int], max_new_tokens: int,
    stop: set[int],
) -> ReferenceHop:  # fmt: skip
    """The reference's dense prefill of ``prompt`` after ``ref_prefix`` (not modified), its
    greedy output and its teacher-forced logits along it."""
    prefix_len, n = ref_prefix.length, len(prompt)
    ref = ref_prefix.clone()
    ref_logits = ref_model.prefill(prompt[prefix_len:], ref)
    k, v = ref.k[:, :, prefix_len:n].clone(), ref.v[:, :, prefix_len:n].clone()
    out = greedy_decode(ref_model, ref, ref_logits, max_new_tokens, stop, feed_last=False)
    forced = forced_tokens(out.tokens, ref_logits)
    rows = teacher_forced_logits(ref_model, ref, n, ref_logits, forced)
    return ReferenceHop(prefix_len, k, v, out.tokens, rows)


def hop_fidelity(
    reference: ReferenceHop,
    method_model: Transformer,
    method_cache: KVCache,
    method_first_logits: torch.Tensor,
    method_output: list[int],
    shared_spans: list[tuple[int, int]] = (),
) -> HopFidelity:
    """Compare a method's prompt cache with the dense reference of the same tokens.

    ``method_cache`` must hold the prompt (it is truncated back to it).
    """
    p0 = reference.prefix_len
    n = p0 + reference.k.shape[2]
    ref_k, ref_v = reference.k, reference.v
    mk, mv = method_cache.k[:, :, p0:n], method_cache.v[:, :, p0:n]
    k_err, k_layers, k_diff, k_norm = relative_errors(mk, ref_k)
    v_err, v_layers, v_diff, v_norm = relative_errors(mv, ref_v)
    both = float(((k_diff.sum() + v_diff.sum()) / (k_norm.sum() + v_norm.sum())).sqrt())
    segment_errors = []
    for a, b in shared_spans:
        if a < p0:
            raise ValueError(f"shared span {a}:{b} starts inside the system prefix (0:{p0})")
        at = slice(a - p0, b - p0)
        num = (mk[:, :, at].float() - ref_k[:, :, at].float()).pow(2).sum()
        num += (mv[:, :, at].float() - ref_v[:, :, at].float()).pow(2).sum()
        den = ref_k[:, :, at].float().pow(2).sum() + ref_v[:, :, at].float().pow(2).sum()
        segment_errors.append(float((num / den).sqrt()))
    forced = reference.forced
    method_rows = teacher_forced_logits(method_model, method_cache, n, method_first_logits, forced)
    kl = kl_divergence(reference.rows, method_rows)
    return HopFidelity(
        kv_rel_error=both,
        k_rel_error=k_err,
        v_rel_error=v_err,
        k_rel_error_per_layer=k_layers,
        v_rel_error_per_layer=v_layers,
        first_token_kl=float(kl[0]),
        continuation_kl=float(kl.mean()),
        same_output=reference.output == method_output,
        reference_output=reference.output,
        segment_errors=segment_errors,
    )


# For an observer watching many runs of the same requests: every hop of a pareto size's 12
# documents on Qwen2.5-0.5B at 1K tokens (about 50 MB a hop). Once full, the memo keeps what it
# has (see ReferenceMemo). Observers of a single run keep nothing (0): nothing would be reused,
# and runs that report their memory would count the memo's.
MEMO_BYTES = 4 << 30


class ReferenceMemo:
    """Reference hops by the tokens they read, shared by every run an observer watches.

    Experiments run many methods (or knob points) over the same requests. Every run's first
    hop, and every later hop whose earlier outputs match an earlier run's, reads exactly the
    tokens an earlier run's hop read, so its reference prefill, decode and teacher-forced
    pass are done once (deterministic: the same model on the same tokens). Bounded in bytes;
    once full it keeps what it has and stores nothing new: runs revisit the requests in the
    same order, where dropping the oldest entry would drop the next one needed.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: dict[tuple, ReferenceHop] = {}
        self.bytes = 0
        self.hits = self.misses = 0

    def get_or_compute(self, key: tuple, compute) -> ReferenceHop:
        if key in self.entries:
            self.hits += 1
            return self.entries[key]
        self.misses += 1
        hop = compute()
        if self.bytes + hop.nbytes <= self.max_bytes:
            self.entries[key] = hop
            self.bytes += hop.nbytes
        return hop


class FidelityObserver:
    """A :class:`~kvcmas.workflow.runner.Runner` observer: every hop against a dense prefill
    of the same tokens on ``reference`` (fp32 by default), with its own system-prefix caches.
    One observer can watch several runs (methods or knob points on the same requests); given
    ``memo_bytes`` its :class:`ReferenceMemo` computes each distinct hop's reference once."""

    def __init__(self, reference: LoadedModel, memo_bytes: int = 0):
        self.reference = reference
        self.prefixes = PrefixCache()
        self.memo = ReferenceMemo(memo_bytes)

    def __call__(self, view: HopView) -> dict[str, Any]:
        hop, build = view.hop, view.build
        model = self.reference.model
        ref_prefix = self.prefixes.get(model, hop.segments[0].tokens)
        key = (tuple(hop.tokens), ref_prefix.length, view.max_new_tokens, frozenset(view.stop))
        reference = self.memo.get_or_compute(
            key,
            lambda: reference_hop(model, ref_prefix, hop.tokens, view.max_new_tokens, view.stop),
        )
        spans = [(r.start, r.start + r.length) for r in build.records if r.slot is not None]
        fid = hop_fidelity(
            reference, view.model, build.cache, view.first_logits, view.output_ids, spans
        )
        return asdict(fid)
