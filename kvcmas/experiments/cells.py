"""Table cells every cost table shares: TTFT (all hops / hops 2+) and its ratio to NonShared,
beside end-to-end latency and compute seconds with theirs, so no table shows one without the
others. Values are :func:`kvcmas.eval.summary.run_summary` figures after ``add_ratios``."""

from __future__ import annotations

from typing import Any


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def pair(m: dict[str, Any], key: str, spec: str = ".3f") -> str:
    """``all / later`` cell for a figure keyed ``key.format("all")`` and ``"later"``."""
    return f"{fmt(m.get(key.format('all')), spec)} / {fmt(m.get(key.format('later')), spec)}"


COST_HEADER = "TTFT s | TTFT / NS | latency s (/NS) | compute s (/NS)"


def cost_cells(m: dict[str, Any]) -> str:
    """The four cells of :data:`COST_HEADER`, joined by `` | ``."""
    return (
        f"{pair(m, 'ttft_{}_mean_s')}"
        f" | {fmt(m.get('ttft_all_ratio'), '.2f')} / {fmt(m.get('ttft_later_ratio'), '.2f')}"
        f" | {fmt(m.get('latency_request_mean_s'))} ({fmt(m.get('latency_ratio'), '.2f')})"
        f" | {fmt(m.get('compute_s'), '.1f')} ({fmt(m.get('compute_ratio'), '.2f')})"
    )


def reuse_cells(m: dict[str, Any]) -> str:
    """rho beside the recompute fraction, each all hops / hops 2+."""
    return f"{pair(m, 'rho_{}', '.2f')} | {pair(m, 'recompute_{}', '.2f')}"
