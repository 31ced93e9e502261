"""Record every workflow edge's (source, dense) cache pair of a request stream.

One run of KVCMAS with ``tau = 0`` (every shared segment with a source falls back to dense
prefill and records a full-width anchor in an unbounded pool) keeps, per (slot, consumer)
edge, the source cache X the consumer would have reused (chained: the latest earlier hop's,
which is dense here) and its exact dense cache Y. The low-rank analysis studies these deltas
``Y - X`` and bases ``X``; no policy is replayed from them (calibration runs online).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvcmas.methods.kvcmas import KVCMAS, KVCMASConfig
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow


@dataclass
class EdgePair:
    edge: tuple[str, str]  # (slot, consumer)
    kind: str
    x_k: torch.Tensor  # [L-1, n, D] source, canonical frame
    x_v: torch.Tensor
    y_k: torch.Tensor  # dense
    y_v: torch.Tensor


def collect_pairs(
    loaded: LoadedModel,
    workflow: Workflow,
    requests: Iterable[dict],
    progress: Callable[[int, RequestResult], None] | None = None,
) -> list[EdgePair]:
    """Run the stream densely (chained dense sources) and keep every edge's (X, Y) in order."""
    recorder = KVCMAS(KVCMASConfig(tau=0.0, pool_size=10**9, rank=0, base_rank=0))
    runner = Runner(loaded, workflow, recorder)
    for _ in runner.run_stream(requests, progress):
        pass  # the runner flushes deferred anchor construction after each request
    pairs = []
    for edge, pool in recorder.pools.items():
        kind = workflow.slot_kind(edge[0])
        for a in pool.anchors:
            x_k, x_v = a.base_k.a, a.base_v.a
            pairs.append(EdgePair(edge, kind, x_k, x_v, x_k + a.delta_k.a, x_v + a.delta_v.a))
    return pairs
