"""The paper's low-rank statements checked against the measured family summaries."""

from __future__ import annotations

from typing import Any

from kvcmas.experiments.lowrank.plan import LONG_SEGMENT


def claims(s: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The paper's statements against the measured summaries."""

    def get(name: str, key: str):
        return s[name][key] if s.get(name) else None

    delta = [get(f"delta {x} (all)", "effective_rank_mean") for x in "KV"]
    delta_long = [
        get(f"delta {x} (all, >= {LONG_SEGMENT} tokens)", "effective_rank_mean") for x in "KV"
    ]
    pf = [get(f"PF {x}", "effective_rank_mean") for x in "KV"]
    pf8 = [get(f"PF {x}", "energy_at_8") for x in "KV"]
    base = [get(f"base {x} (all)", "effective_rank_mean") for x in "KV"]
    known = all(v is not None for v in delta + pf + pf8 + base)
    return {
        "delta_effective_rank_below_32": {
            "measured_mean_KV": delta,
            "measured_mean_KV_long_segments": delta_long,
            "holds": known and max(delta) < 32,
            "holds_on_long_segments": None if None in delta_long else max(delta_long) < 32,
        },
        "pf_effective_rank_around_4_to_6": {
            "measured_mean_KV": pf,
            "holds": known and all(3 <= v <= 7 for v in pf),
        },
        "pf_rank8_keeps_over_90pct_energy": {
            "measured_KV": pf8,
            "holds": known and min(pf8) > 0.9,
        },
        "base_low_rank_slightly_above_delta": {
            "measured_mean_KV": base,
            "holds": known and all(b >= d for b, d in zip(base, delta, strict=True)),
        },
    }
