"""Plain vLLM's capacity at one size: the highest session arrival rate at which its p50 TTFT
stays within ``ratio`` (2) times its idle TTFT.

A short search over probe rates: from a start rate, double while the probe passes (halve while
it fails) until the capacity is bracketed, then bisect the bracket geometrically until it is
narrower than ``precision`` or the probes run out. The capacity is the highest passing rate.
The search is a pure function of a ``measure(rate) -> p50 TTFT or None`` callback (None: the
probe did not finish within its time limit, which fails it), so its logic is tested without a
server.

A probe must hold its rate long enough for the server to fill up: a handful of sessions sent
at a high rate is a burst that a batching engine absorbs (8-session probes at 4.2 sessions/s
stayed within 2x idle TTFT at 512 tokens, where 40 sessions at 0.45/s reached 1.84x). So a
probe sends sessions for ``probe_s`` seconds (:func:`probe_size`, within bounds) and its
p50 is over the later half of its sessions, those that arrive into a loaded server.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Probe:
    rate_per_s: float
    p50_ttft_s: float | None
    passed: bool


def probe_size(rate_per_s: float, probe_s: float, fewest: int, most: int) -> int:
    """Sessions of a probe at ``rate_per_s``: ``probe_s`` seconds of arrivals, within
    ``fewest..most`` (a probe above the capacity then fails on its burst alone)."""
    if rate_per_s <= 0 or probe_s <= 0 or not 1 <= fewest <= most:
        raise ValueError("need a positive rate and duration and 1 <= fewest <= most")
    return max(fewest, min(most, math.ceil(rate_per_s * probe_s)))


def later_half(records: list) -> list:
    """The sessions of a probe that arrived into a loaded server: the later half by arrival."""
    ordered = sorted(records, key=lambda r: r.arrival_s)
    return ordered[len(ordered) // 2 :]


@dataclass
class CapacitySearch:
    idle_ttft_s: float | None  # p50 TTFT of sequential sessions (None: capacity was given)
    threshold_s: float | None  # ratio * idle_ttft_s
    capacity_per_s: float  # the highest passing rate (or the given one)
    found: bool  # False: no probe passed; capacity is then the lowest rate probed
    failed_at_per_s: float | None = None  # the lowest failing rate (None: none failed)
    probes: list[Probe] = field(default_factory=list)
    given: bool = False
    probe_s: float | None = None  # seconds of arrivals per probe

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def given_capacity(rate_per_s: float) -> CapacitySearch:
    return CapacitySearch(None, None, rate_per_s, True, given=True)


def start_rate(idle_ttft_s: float, hops_per_session: int) -> float:
    """Where the search starts: the session rate at which the engine would spend all its time
    on prefills at their idle speed. Batching lets the engine serve more than this (decodes
    share its forwards), and queueing makes TTFT grow before it, so the capacity lies within
    a few doublings or halvings. (One session at a time, ``1 / session latency``, started
    about 8x below the capacity on this CPU, and 4 probes never left the passing side.)"""
    if idle_ttft_s <= 0 or hops_per_session < 1:
        raise ValueError("need a positive idle TTFT and at least one hop per session")
    return 1.0 / (hops_per_session * idle_ttft_s)


def search_capacity(
    measure: Callable[[float], float | None],
    idle_ttft_s: float,
    start_rate_per_s: float,
    max_probes: int = 6,
    ratio: float = 2.0,
    precision: float = 1.25,
) -> CapacitySearch:
    """Search as the module says; at most ``max_probes`` calls of ``measure``."""
    if idle_ttft_s <= 0 or start_rate_per_s <= 0 or max_probes < 1:
        raise ValueError("need a positive idle TTFT, a positive start rate and a probe")
    threshold = ratio * idle_ttft_s
    probes: list[Probe] = []

    def passes(rate: float) -> bool:
        p50 = measure(rate)
        probes.append(Probe(rate, p50, p50 is not None and p50 <= threshold))
        return probes[-1].passed

    lo: float | None = None  # highest passing rate
    hi: float | None = None  # lowest failing rate
    rate = start_rate_per_s
    while len(probes) < max_probes and (lo is None or hi is None):
        if passes(rate):
            lo = rate
            rate *= 2
        else:
            hi = rate
            rate /= 2
    while len(probes) < max_probes and lo is not None and hi is not None and hi / lo > precision:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    if lo is None:
        return CapacitySearch(idle_ttft_s, threshold, hi, False, hi, probes)
    return CapacitySearch(idle_ttft_s, threshold, lo, True, hi, probes)
