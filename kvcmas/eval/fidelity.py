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


def hop_fidelity(
    ref_model: Transformer,
    ref_prefix: KVCache,
    prompt: list[int],
    method_model: Transformer,
    method_cache: KVCache,
    method_first_logits: torch.Tensor,
    method_output: list[int],
    max_new_tokens: int,
    stop: set[int],
    shared_spans: list[tuple[int, int]] = (),
) -> HopFidelity:
    """Compare a method's prompt cache with a dense reference prefill of the same tokens.

    ``method_cache`` must hold the prompt (it is truncated back to it); ``ref_prefix`` holds
    the reference model's system prefix and is not modified.
    """
    prefix_len, n = ref_prefix.length, len(prompt)
    ref = ref_prefix.clone()
    ref_logits = ref_model.prefill(prompt[prefix_len:], ref)
    ref_k, ref_v = ref.k[:, :, prefix_len:n], ref.v[:, :, prefix_len:n]
    mk, mv = method_cache.k[:, :, prefix_len:n], method_cache.v[:, :, prefix_len:n]
    k_err, k_layers, k_diff, k_norm = relative_errors(mk, ref_k)
    v_err, v_layers, v_diff, v_norm = relative_errors(mv, ref_v)
    both = float(((k_diff.sum() + v_diff.sum()) / (k_norm.sum() + v_norm.sum())).sqrt())
    segment_errors = []
    for a, b in shared_spans:
        num = (method_cache.k[:, :, a:b].float() - ref.k[:, :, a:b].float()).pow(2).sum()
        num += (method_cache.v[:, :, a:b].float() - ref.v[:, :, a:b].float()).pow(2).sum()
        den = ref.k[:, :, a:b].float().pow(2).sum() + ref.v[:, :, a:b].float().pow(2).sum()
        segment_errors.append(float((num / den).sqrt()))
    ref_out = greedy_decode(ref_model, ref, ref_logits, max_new_tokens, stop, feed_last=False)
    forced = ref_out.tokens or [int(ref_logits.argmax())]
    ref_rows = teacher_forced_logits(ref_model, ref, n, ref_logits, forced)
    method_rows = teacher_forced_logits(method_model, method_cache, n, method_first_logits, forced)
    kl = kl_divergence(ref_rows, method_rows)
    return HopFidelity(
        kv_rel_error=both,
        k_rel_error=k_err,
        v_rel_error=v_err,
        k_rel_error_per_layer=k_layers,
        v_rel_error_per_layer=v_layers,
        first_token_kl=float(kl[0]),
        continuation_kl=float(kl.mean()),
        same_output=ref_out.tokens == method_output,
        reference_output=ref_out.tokens,
        segment_errors=segment_errors,
    )


class FidelityObserver:
    """A :class:`~kvcmas.workflow.runner.Runner` observer: every hop against a dense prefill
    of the same tokens on ``reference`` (fp32 by default), with its own system-prefix caches."""

    def __init__(self, reference: LoadedModel):
        self.reference = reference
        self.prefixes = PrefixCache()

    def __call__(self, view: HopView) -> dict[str, Any]:
        hop, build = view.hop, view.build
        ref_prefix = self.prefixes.get(self.reference.model, hop.segments[0].tokens)
        spans = [(r.start, r.start + r.length) for r in build.records if r.slot is not None]
        return asdict(
            hop_fidelity(
                self.reference.model,
                ref_prefix,
                hop.tokens,
                view.model,
                build.cache,
                view.first_logits,
                view.output_ids,
                view.max_new_tokens,
                view.stop,
                spans,
            )
        )
