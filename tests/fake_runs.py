"""Hand-made run results for table and plot tests: real ``HopResult``/``RequestResult``
objects, so that their summaries come from :mod:`kvcmas.eval.summary` itself."""

from __future__ import annotations

import struct
from pathlib import Path

from kvcmas.methods.base import ReuseCounts
from kvcmas.workflow.records import HopResult, RequestResult


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG file, from its IHDR chunk."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def fake_hop(agent: str, ttft: float, served: int, computed: int) -> HopResult:
    """A hop with 100 shared tokens over 4 layers, ``served`` of them from a source."""
    return HopResult(
        agent=agent, method="m", ttft_s=ttft, latency_s=2 * ttft, prompt_tokens=300,
        prefix_tokens=10, prefilled_tokens=0, reuse=ReuseCounts(100, served, computed, 400),
        output="", output_tokens=128, segments=[], kv_bytes=2**20, source_bytes=0,
        method_state_bytes=0, peak_rss_bytes=2**29,
    )  # fmt: skip


def fake_run(
    later_ttft: float, latency: float, cpu: float, served: int, requests: int = 1
) -> list[RequestResult]:
    """4-hop requests: hop 1 dense (1 s), hops 2-4 at ``later_ttft`` serving ``served``."""
    out = []
    for i in range(requests):
        hops = [fake_hop("a", 1.0, 0, 400)]
        hops += [fake_hop(a, later_ttft, served, (100 - served) * 4) for a in "bcd"]
        out.append(RequestResult(f"r{i}", "m", "", hops, latency_s=latency, cpu_s=cpu))
    return out
