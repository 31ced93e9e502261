"""Reconstruction coverage: how much of the KV reuse error a selective recomputation touches.

For every hop that reuses shared segments, FullShared (run through the workflow, chained) is
compared with a dense prefill of the same token sequence: ``E[t, l]`` is the squared error of
K plus V over heads and channels, for shared token ``t`` and layer ``l``. A selection rule
picks a subset of (token, layer) pairs of a given budget (fraction of all pairs); its
**coverage** is the share of ``sum E`` inside the subset. Recomputing a pair removes at most
its own error (recomputation also shifts other pairs, not modelled), so ``1 - coverage`` is a
lower bound on the share of the reuse error a rule leaves in place. The paper reports that at
least half stays outside for every rule.

Rules, at equal budgets (token rules take ``round(b n)`` tokens in every layer, layer rules
``round(b L)`` layers for every token; the ``pair_fraction`` column gives the exact share):

* ``cacheblend``: tokens with the largest ``sum (V_fresh - V_reused)^2`` at the check layer
  (layer 1), CacheBlend's own score (fresh = dense there, since layers up to the check layer
  are recomputed for all tokens; that full recompute is not charged to the budget);
* ``attention``: tokens receiving the most attention from the last 10 prompt tokens, in the
  FullShared context, averaged over layers and heads (RelayCaching's/H2O-style importance);
* ``random``: uniformly random tokens (seeded; mean over draws);
* ``layer_block``: the contiguous block of layers holding the most error over all hops
  (DroidSpeak-style; chosen in-sample, so optimistic);
* ``layer_middle``: the band centred on the middle layer (RelayCaching-style);
* ``oracle_tokens`` / ``oracle_pairs``: tokens / pairs ranked by their own error: the best
  any rule could do at that budget (reported for scale, excluded from the claim check).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcmas.eval.replay import RecordedHop, record_hops
from kvcmas.methods.relaycaching import received_attention
from kvcmas.model.cache import KVCache
from kvcmas.model.transformer import Transformer

RULES = (
    "cacheblend",
    "attention",
    "random",
    "layer_block",
    "layer_middle",
    "oracle_tokens",
    "oracle_pairs",
)
ORACLES = ("oracle_tokens", "oracle_pairs")


@dataclass
class HopError:
    """Reuse error of one hop's shared tokens and the scores the rules rank them by."""

    request: int
    agent: str
    error: torch.Tensor  # [n_tokens, n_layers] squared K + V error
    check_score: torch.Tensor  # [n_tokens] CacheBlend deviation at the check layer
    attention: torch.Tensor  # [n_tokens] attention received from the last prompt tokens


def shared_rows(spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in spans])


def pair_error(reused: KVCache, dense: KVCache, rows: torch.Tensor) -> torch.Tensor:
    """``[n_rows, n_layers]`` squared error of K plus V over heads and channels."""
    dk = (reused.k[:, :, rows].float() - dense.k[:, :, rows].float()).pow(2).sum((1, 3))
    dv = (reused.v[:, :, rows].float() - dense.v[:, :, rows].float()).pow(2).sum((1, 3))
    return (dk + dv).T


def last_token_attention(
    model: Transformer, cache: KVCache, tokens: list[int], rows: torch.Tensor, last: int = 10
) -> torch.Tensor:
    """Attention ``rows`` receive from the prompt's last ``last`` tokens, in ``cache``'s
    context, averaged over layers and heads (the last tokens are re-run on a copy)."""
    n = len(tokens)
    pos = torch.arange(max(0, n - last), n, device=cache.device)
    work = cache.clone()
    layers = tuple(range(model.config.n_layers))
    ids = torch.tensor(tokens, device=cache.device)[pos]
    out = model.forward(ids, pos, work, logits_rows=None, capture=layers)
    total = torch.zeros(n, device=cache.device)
    with torch.inference_mode():
        for layer in layers:
            q, _, _ = model.project_kv(layer, out.captured[layer], pos)
            total += received_attention(q, work.keys(layer), pos, 0)
    return total[rows] / len(layers)


def hop_error(
    model: Transformer,
    reused: KVCache,
    dense: KVCache,
    tokens: list[int],
    spans: list[tuple[int, int]],
    check_layer: int = 1,
    last: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair error, CacheBlend score and received attention of the shared ``spans``."""
    rows = shared_rows(spans)
    err = pair_error(reused, dense, rows)
    dv = reused.v[check_layer, :, rows].float() - dense.v[check_layer, :, rows].float()
    score = dv.pow(2).sum((0, 2))
    return err, score, last_token_attention(model, reused, tokens, rows, last)


# --- selections ------------------------------------------------------------------------------


def token_mask(scores: torch.Tensor, budget: float, n_layers: int) -> torch.Tensor:
    """Top ``round(budget * n)`` tokens (at least one when the budget is positive), all layers."""
    n = len(scores)
    k = min(n, max(1, round(budget * n))) if budget > 0 else 0
    mask = torch.zeros(n, n_layers, dtype=torch.bool)
    mask[torch.topk(scores, k).indices] = True
    return mask


def layer_count(budget: float, n_layers: int) -> int:
    return min(n_layers, max(1, round(budget * n_layers))) if budget > 0 else 0


def layer_mask(n_tokens: int, n_layers: int, start: int, width: int) -> torch.Tensor:
    mask = torch.zeros(n_tokens, n_layers, dtype=torch.bool)
    mask[:, start : start + width] = True
    return mask


def pair_mask(error: torch.Tensor, budget: float) -> torch.Tensor:
    k = min(error.numel(), max(1, round(budget * error.numel()))) if budget > 0 else 0
    mask = torch.zeros(error.numel(), dtype=torch.bool)
    mask[torch.topk(error.flatten(), k).indices] = True
    return mask.view_as(error)


def best_block(per_layer: torch.Tensor, width: int) -> int:
    """Start of the contiguous ``width``-layer block with the largest sum."""
    if width == 0:
        return 0
    return int(per_layer.unfold(0, width, 1).sum(1).argmax())


def coverage(error: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of ``error`` inside ``mask`` (1.0 for an error-free hop with everything selected)."""
    total = float(error.sum())
    if total == 0:
        return float(mask.all())
    return float(error[mask].sum()) / total


def rule_masks(
    h: HopError, budget: float, block_start: int, seed: int, draws: int
) -> dict[str, list[torch.Tensor]]:
    n, n_layers = h.error.shape
    w = layer_count(budget, n_layers)
    g = torch.Generator().manual_seed(seed)
    return {
        "cacheblend": [token_mask(h.check_score, budget, n_layers)],
        "attention": [token_mask(h.attention, budget, n_layers)],
        "random": [token_mask(torch.rand(n, generator=g), budget, n_layers) for _ in range(draws)],
        "layer_block": [layer_mask(n, n_layers, block_start, w)],
        "layer_middle": [layer_mask(n, n_layers, (n_layers - w) // 2, w)],
        "oracle_tokens": [token_mask(h.error.sum(1), budget, n_layers)],
        "oracle_pairs": [pair_mask(h.error, budget)],
    }


def coverage_rows(
    hops: list[HopError], budgets: tuple[float, ...], seed: int = 0, draws: int = 10
) -> list[dict[str, Any]]:
    """One row per (rule, budget): coverage averaged over hops and pooled over all error."""
    per_layer = sum(h.error.sum(0) for h in hops)
    rows = []
    for budget in budgets:
        width = layer_count(budget, hops[0].error.shape[1])
        start = best_block(per_layer, width)
        cov: dict[str, list[float]] = {r: [] for r in RULES}
        inside: dict[str, float] = dict.fromkeys(RULES, 0.0)
        frac: dict[str, list[float]] = {r: [] for r in RULES}
        for i, h in enumerate(hops):
            for rule, masks in rule_masks(h, budget, start, seed + i, draws).items():
                cov[rule].append(sum(coverage(h.error, m) for m in masks) / len(masks))
                inside[rule] += sum(float(h.error[m].sum()) for m in masks) / len(masks)
                frac[rule].append(float(masks[0].float().mean()))
        total = sum(float(h.error.sum()) for h in hops)
        for rule in RULES:
            row = {
                "rule": rule,
                "budget": budget,
                "pair_fraction": sum(frac[rule]) / len(hops),
                "coverage_mean": sum(cov[rule]) / len(hops),
                "coverage_pooled": inside[rule] / total if total else 0.0,
            }
            row["outside_mean"] = 1 - row["coverage_mean"]
            if rule == "layer_block":
                row["block"] = [start, start + width]
            rows.append(row)
    return rows


def claim_holds(rows: list[dict[str, Any]]) -> bool:
    """The paper's claim: every (non-oracle) rule leaves at least half of the error outside."""
    return all(r["coverage_mean"] <= 0.5 for r in rows if r["rule"] not in ORACLES)


# --- the experiment --------------------------------------------------------------------------


def errors_of(rh: RecordedHop, model: Transformer, check_layer: int, last: int) -> HopError | None:
    spans = [
        (r.start, r.length) for r in rh.records if r.slot is not None and r.decision == "reuse"
    ]
    if not spans:
        return None
    dense, _ = rh.dense(model)
    err, score, att = hop_error(model, rh.cache, dense, rh.hop.tokens, spans, check_layer, last)
    return HopError(rh.hop.request_index, rh.hop.agent, err, score, att)


def run_coverage(
    loaded,
    workflow,
    requests: list[dict],
    budgets: tuple[float, ...] = (0.1, 0.2),
    progress: Callable[[str], None] | None = print,
    check_layer: int = 1,
    last_tokens: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    """Run FullShared through ``workflow`` on ``requests`` and measure every rule's coverage."""
    recorded = record_hops(loaded, workflow, requests, reuse=True, progress=progress)
    hops = [h for rh in recorded if (h := errors_of(rh, loaded.model, check_layer, last_tokens))]
    if not hops:
        raise ValueError("no hop reused a shared segment: nothing to measure")
    if progress:
        progress(f"measured {len(hops)} hops")
    rows = coverage_rows(hops, tuple(budgets), seed)
    return {
        "model": loaded.name,
        "dtype": str(loaded.model.dtype).replace("torch.", ""),
        "workflow": workflow.name,
        "requests": len(requests),
        "hops": [
            {
                "request": h.request,
                "agent": h.agent,
                "shared_tokens": h.error.shape[0],
                "total_error": float(h.error.sum()),
            }
            for h in hops
        ],
        "rows": rows,
        "claim_at_least_half_outside": claim_holds(rows),
    }


def coverage_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Reconstruction coverage ({result['model']}, {result['dtype']}, "
        f"workflow {result['workflow']}, {result['requests']} requests, "
        f"{len(result['hops'])} hops)",
        "",
        "| rule | budget | pairs | coverage (mean over hops) | coverage (pooled) | outside |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        name = r["rule"] + (f" {r['block'][0]}:{r['block'][1]}" if "block" in r else "")
        lines.append(
            f"| {name} | {r['budget']:.2f} | {r['pair_fraction']:.3f} | {r['coverage_mean']:.3f} "
            f"| {r['coverage_pooled']:.3f} | {r['outside_mean']:.3f} |"
        )
    verdict = "holds" if result["claim_at_least_half_outside"] else "does not hold"
    lines += [
        "",
        f"Paper's claim (every non-oracle rule leaves at least half of the error outside the "
        f"recomputed subset): **{verdict}**.",
    ]
    return "\n".join(lines) + "\n"


def write_coverage(result: dict[str, Any], folder: str | Path) -> tuple[Path, Path]:
    """Write ``coverage.json`` and ``coverage.md`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    js, md = folder / "coverage.json", folder / "coverage.md"
    js.write_text(json.dumps(result, indent=1))
    md.write_text(coverage_markdown(result))
    return js, md


def main(argv: list[str] | None = None) -> int:
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.model.loader import load_model

    p = argparse.ArgumentParser(description="reconstruction coverage of selective recomputation")
    p.add_argument("--workflow", default="roster")
    p.add_argument("--question", action="append", required=True)
    p.add_argument("--budgets", default="0.1,0.2")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--out", default="results/coverage")
    args = p.parse_args(argv)
    budgets = tuple(float(b) for b in args.budgets.split(","))
    if any(not 0 <= b <= 1 or math.isnan(b) for b in budgets):
        p.error("budgets must be fractions in [0, 1]")
    result = run_coverage(
        load_model(args.model, args.dtype),
        load_workflow(args.workflow),
        [{"query": q} for q in args.question],
        budgets,
    )
    write_coverage(result, args.out)
    print(coverage_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
