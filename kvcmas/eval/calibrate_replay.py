"""Calibrate KVCMAS's temperature and gate offline from (source, dense) pairs.

One all-dense pass (KVCMAS with ``tau = 0``) through a request stream records, for every
(slot, consumer) edge, the source cache X the consumer would have reused and its exact dense
cache Y. Replaying those pairs in order through a fresh :class:`AnchorPool` answers, for any
temperature, rank and pool size, what the correction would have done: its error against Y
beside FullShared's (X against Y), and the gate's entropy, without rerunning the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcmas.methods.anchors import AnchorPool, PoolConfig
from kvcmas.methods.kvcmas import KVCMAS
from kvcmas.workflow.runner import Runner


@dataclass
class EdgePair:
    edge: tuple[str, str]  # (slot, consumer)
    kind: str
    x_k: torch.Tensor  # [L-1, n, D] source, canonical frame
    x_v: torch.Tensor
    y_k: torch.Tensor  # dense
    y_v: torch.Tensor


def collect_pairs(loaded, workflow, requests, progress=None) -> list[EdgePair]:
    """Run the stream densely, chaining dense sources, and keep every edge's (X, Y) in order."""
    recorder = KVCMAS(tau=0.0, pool_size=10**9, rank=0, base_rank=0)
    runner = Runner(loaded, workflow, recorder)
    for _ in runner.run_stream(requests, progress):
        pass
    pairs = []
    kinds = {s: workflow.slot_kind(s) for s, _ in recorder.pools}
    for edge, pool in recorder.pools.items():
        for a in pool.anchors:
            x_k, x_v = a.base_k.a, a.base_v.a
            pairs.append(
                EdgePair(edge, kinds[edge[0]], x_k, x_v, x_k + a.delta_k.a, x_v + a.delta_v.a)
            )
    return pairs


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def replay(
    pairs: list[EdgePair],
    config: PoolConfig,
    min_anchors: int = 2,
    pools: dict[tuple[str, str], AnchorPool] | None = None,
) -> list[dict]:
    """For each pair in order: match against the pool of earlier pairs of its edge, correct,
    measure; then record the pair (as a dense fallback would). Pass ``pools`` (a dict, empty
    or holding pools to start from) to keep the final pools, e.g. to measure their bytes."""
    pools = {} if pools is None else pools
    rows = []
    for p in pairs:
        pool = pools.setdefault(p.edge, AnchorPool(config))
        n = p.x_k.shape[1]
        full_err = relative(torch.cat([p.x_k, p.x_v]), torch.cat([p.y_k, p.y_v]))
        row = {"edge": "/".join(p.edge), "kind": p.kind, "tokens": n, "fullshared_error": full_err}
        if len(pool.eligible(n)) >= min_anchors:
            m = pool.match(p.x_k, p.x_v)
            ck, cv = pool.correction(m, n)
            row["corrected_error"] = relative(
                torch.cat([p.x_k + ck, p.x_v + cv]), torch.cat([p.y_k, p.y_v])
            )
            row["entropy"] = m.entropy
            row["anchors"] = len(m.anchors)
        pool.add(p.x_k, p.x_v, p.y_k, p.y_v)
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Mean error ratio corrected / FullShared over matched pairs, and the entropy spread."""
    matched = [r for r in rows if "corrected_error" in r]
    if not matched:
        return {"matched": 0}
    ratio = torch.tensor([r["corrected_error"] / r["fullshared_error"] for r in matched])
    ent = torch.tensor([r["entropy"] for r in matched])
    return {
        "matched": len(matched),
        "error_ratio_mean": float(ratio.mean()),
        "error_ratio_median": float(ratio.median()),
        "improved_share": float((ratio < 1).float().mean()),
        "entropy_p10": float(ent.quantile(0.1)),
        "entropy_median": float(ent.median()),
        "entropy_p90": float(ent.quantile(0.9)),
    }
