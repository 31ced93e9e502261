"""Offline profiles that choose the layer ranges of DroidSpeak and RelayCaching.

Both run a calibration split through the workflow densely (:mod:`kvcmas.eval.replay`) and
then study each hop that has shared segments with sources *one hop at a time*: the sources
are the previous consumers' exact caches (prefix-induced deviation only, not deviation
chained through earlier approximate hops). Results are JSON files whose ``block`` / ``layers``
entry the methods accept directly (``--block profile.json``, ``--relay-layers profile.json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from kvcmas.eval.fidelity import kl_divergence
from kvcmas.eval.replay import RecordedHop, record_hops
from kvcmas.methods import make_method
from kvcmas.methods.fullshared import FullShared

WIDTH_FRACTIONS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


def block_candidates(
    n_layers: int, widths: Iterable[int] | None = None, stride: int | None = None
) -> list[tuple[int, int]]:
    """Blocks ``[s, s+w)`` for each width (default: 10..100% of the layers), starts every
    ``stride`` layers (default L/10) plus the last possible start, narrowest first."""
    if widths is None:
        widths = {max(1, round(f * n_layers)) for f in WIDTH_FRACTIONS}
    stride = stride or max(1, n_layers // 10)
    out = []
    for w in sorted(set(widths)):
        starts = sorted({*range(0, n_layers - w + 1, stride), n_layers - w})
        out += [(s, s + w) for s in starts]
    return out


def first_token_kl(hops: list[RecordedHop], model, method_factory: Callable[[], Any]) -> float:
    """Mean first-token KL(dense || method) over ``hops``, each replayed by a fresh method
    whose saved hidden states (if it keeps any) are seeded from the recorded source hops."""
    kls = []
    for rh in hops:
        method = method_factory()
        if method.needs_hidden_states:
            for slot, states in rh.source_hidden.items():
                tokens = rh.hop.shared[slot].tokens
                for layer, hidden in states.items():
                    method.hidden_store.put(rh.hop.session, tokens, layer, hidden)
        out = rh.replay(method, model)
        kls.append(float(kl_divergence(rh.last_logits[None], out.last_logits[None])[0]))
    return sum(kls) / len(kls)


def profile_droidspeak_block(
    loaded,
    workflow,
    requests: list[dict],
    tolerance: float = 0.005,
    widths: Iterable[int] | None = None,
    stride: int | None = None,
    path: str | Path | None = None,
    progress: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """The smallest DroidSpeak block whose mean first-token KL against dense is within
    ``tolerance`` on ``requests`` (the lowest KL among blocks of that width); ``(0, L)`` when
    none is. Written to ``path`` as JSON when given."""
    n_layers = loaded.config.n_layers
    candidates = block_candidates(n_layers, widths, stride)
    starts = tuple(sorted({s for s, _ in candidates if s > 0}))
    hops = [h for h in record_hops(loaded, workflow, requests, capture=starts) if h.has_sources]
    if not hops:
        raise ValueError("the calibration requests gave no hop that reuses a shared segment")
    model = loaded.model
    fullshared = first_token_kl(hops, model, FullShared)
    tried, chosen = [], None
    for width in sorted({e - s for s, e in candidates}):
        row = []
        for s, e in (c for c in candidates if c[1] - c[0] == width):
            kl = first_token_kl(
                hops, model, lambda b=f"{s}:{e}": make_method("droidspeak", block=b)
            )
            row.append({"block": [s, e], "first_token_kl": kl})
        tried += row
        best = min(row, key=lambda r: r["first_token_kl"])
        if progress:
            progress(f"width {width}: best block {best['block']} KL {best['first_token_kl']:.5f}")
        if best["first_token_kl"] <= tolerance:
            chosen = best["block"]
            break
    result = {
        "method": "droidspeak",
        "block": chosen or [0, n_layers],
        "n_layers": n_layers,
        "model": loaded.name,
        "tolerance": tolerance,
        "metric": "mean first-token KL vs dense, one-hop replay from dense sources",
        "hops": len(hops),
        "fullshared_first_token_kl": fullshared,
        "candidates": tried,
    }
    _write(result, path)
    return result


def layer_deviation(hops: list[RecordedHop], model) -> dict[str, list[float]]:
    """Per-layer relative error of reused (FullShared) K and V against the dense hop cache,
    over every shared token that had a source."""
    n_layers = model.config.n_layers
    diff = {name: torch.zeros(n_layers, device=model.device) for name in ("k", "v")}
    norm = {name: torch.zeros(n_layers, device=model.device) for name in ("k", "v")}
    for rh in hops:
        out = rh.replay(FullShared(), model)
        for rec in out.records:
            if rec.slot is None or rec.decision != "reuse":
                continue
            span = slice(rec.start, rec.start + rec.length)
            for name in ("k", "v"):
                got = getattr(out.cache, name)[:, :, span].float()
                ref = getattr(rh.cache, name)[:, :, span].float()
                diff[name] += (got - ref).pow(2).sum((1, 2, 3))
                norm[name] += ref.pow(2).sum((1, 2, 3))
    return {n: (diff[n] / norm[n].clamp_min(1e-30)).sqrt().tolist() for n in ("k", "v")}


def concentrated_band(per_layer: list[float], mass: float = 0.5) -> tuple[int, int]:
    """The shortest contiguous layer range ``[a, e]`` (inclusive) holding at least ``mass`` of
    the total; the one with the most deviation among equally short ones."""
    x = torch.tensor(per_layer, dtype=torch.float64)
    total = float(x.sum())
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), x.cumsum(0)])
    for width in range(1, len(per_layer) + 1):
        sums = csum[width:] - csum[:-width]
        a = int(sums.argmax())
        if float(sums[a]) >= mass * total - 1e-12:
            return a, a + width - 1
    return 0, len(per_layer) - 1


def relay_bands(per_layer: list[float], mass: float = 0.5, full_fraction: float = 0.25):
    """``(L_start, L_det, L_end)``: the band where ``mass`` of the deviation concentrates, its
    first ``full_fraction`` (at least one layer) recomputed for all tokens."""
    a, e = concentrated_band(per_layer, mass)
    d = min(e, a + max(1, round(full_fraction * (e - a + 1))))
    return a, d, e


def profile_relay_layers(
    loaded,
    workflow,
    requests: list[dict],
    mass: float = 0.5,
    full_fraction: float = 0.25,
    path: str | Path | None = None,
    progress: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """RelayCaching bands from where reuse deviation concentrates on ``requests``: the
    per-layer relative error of reused K and V (summed), its shortest band holding ``mass``."""
    hops = [h for h in record_hops(loaded, workflow, requests) if h.has_sources]
    if not hops:
        raise ValueError("the calibration requests gave no hop that reuses a shared segment")
    dev = layer_deviation(hops, loaded.model)
    per_layer = [k + v for k, v in zip(dev["k"], dev["v"], strict=True)]
    layers = relay_bands(per_layer, mass, full_fraction)
    if progress:
        progress(f"relay layers {layers} from per-layer deviation over {len(hops)} hops")
    result = {
        "method": "relaycaching",
        "layers": list(layers),
        "n_layers": loaded.config.n_layers,
        "model": loaded.name,
        "mass": mass,
        "full_fraction": full_fraction,
        "hops": len(hops),
        "k_rel_error_per_layer": dev["k"],
        "v_rel_error_per_layer": dev["v"],
    }
    _write(result, path)
    return result


def _write(result: dict, path: str | Path | None) -> None:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))
