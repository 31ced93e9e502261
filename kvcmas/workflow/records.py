"""What a run reports: one record per hop and per request (timing, reuse, memory, output)."""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcmas.methods.base import ReuseCounts


@dataclass
class HopResult:
    agent: str
    method: str
    ttft_s: float  # all critical-path work up to the first output token
    latency_s: float  # the whole hop, decoding included
    prompt_tokens: int
    prefix_tokens: int  # served by the shared system-prompt prefix cache
    prefilled_tokens: int  # run through every layer for this hop (beyond the prefix)
    reuse: ReuseCounts  # shared tokens, tokens served from a source, computed (token, layer)
    output: str
    output_tokens: int
    segments: list[dict[str, Any]]
    kv_bytes: int  # this hop's context cache
    source_bytes: int  # shared-segment caches held for later hops
    method_state_bytes: int  # anchor pools and other state the method keeps
    peak_rss_bytes: int
    output_ids: list[int] = field(default_factory=list, repr=False)
    fidelity: dict[str, Any] | None = None

    @property
    def rho(self) -> float | None:
        return self.reuse.rho

    @property
    def recompute_fraction(self) -> float | None:
        return self.reuse.recompute_fraction

    def to_json(self, full: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not full:
            d.pop("output_ids")
        d["rho"], d["recompute_fraction"] = self.rho, self.recompute_fraction
        fid = d.pop("fidelity")
        if fid:
            d.update({k: v for k, v in fid.items() if k != "reference_output"})
        return d


@dataclass
class RequestResult:
    """One request end to end. ``latency_s`` runs from the request's start to its final output;
    ``background_s`` is deferred work run after it (anchor construction at idle time), and
    ``cpu_s`` the process CPU time (all threads) from its start to the end of that work."""

    request: str
    method: str
    final_answer: str
    hops: list[HopResult]
    latency_s: float = 0.0
    background_s: float = 0.0
    cpu_s: float = 0.0
    reference_final_answer: str | None = None

    @property
    def same_final_answer(self) -> bool | None:
        if self.reference_final_answer is None:
            return None
        return self.final_answer == self.reference_final_answer

    def to_json(self) -> dict[str, Any]:
        d = {
            "request": self.request,
            "method": self.method,
            "final_answer": self.final_answer,
            "latency_s": self.latency_s,
            "background_s": self.background_s,
            "cpu_s": self.cpu_s,
            "hops": [h.to_json() for h in self.hops],
        }
        if self.reference_final_answer is not None:
            d["reference_final_answer"] = self.reference_final_answer
            d["same_final_answer"] = self.same_final_answer
        return d


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: host memory only. On ``--device cuda`` weights,
    caches and pools live in GPU memory, which this does not see (``kv_bytes``,
    ``source_bytes`` and ``method_state_bytes`` count tensor bytes on any device)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
