"""``kvcmas bench lowrank``: how low-rank are cross-agent KV deviations and base caches?

Three families of ``n x D`` matrices per layer (layers 1..L-1, canonical frame, K and V apart):

* **delta**: ``dense - source`` of slot contents (query, agent outputs), from the (source,
  dense) pairs that :func:`kvcmas.eval.calibrate_replay.collect_pairs` records on a calibration
  stream (the anchors' deltas);
* **base**: the source caches of the same pairs (the anchors' bases);
* **prefix-induced (PF)**: recurring private text. The same glue text (``"Notes from the
  solver:"``, an instruction) is prefilled after two agents' system prompts with the same
  question in between; the deviation of the glue's canonical KV between the two agents.
  Reported per instance and stacked over questions (one ``(Q*n) x D`` matrix per glue and
  agent pair: the subspace a profile computed once would have to capture).

For each: effective rank (singular values holding 90% of the squared spectrum), the energy
kept at rank 8 and 32, energy curves and per-layer effective rank. An ``n x D`` matrix has rank
at most ``min(n, D)``: short segments are below 32 trivially, so lengths are reported and the
delta claim is also checked on segments of at least 64 tokens.

Claims checked (paper): delta effective rank below 32; PF effective rank around 4-6 (taken
as a mean between 3 and 7) with rank 8 keeping over 90% of the energy; bases low-rank too,
with slightly higher effective rank than deltas.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcmas.chat import render_segments, tokenize
from kvcmas.eval.calibrate_replay import EdgePair
from kvcmas.experiments import common
from kvcmas.kv.lowrank import as_matrices, energy_rank
from kvcmas.kv.segment import SegmentKV
from kvcmas.model.loader import LoadedModel

HELP = "singular-value energy and effective rank of KV deltas, bases and prefix deviations"
GLUE_TEXTS = (
    "Notes from the solver:",
    "State the key facts needed to answer it, in two sentences.",
    "Point out any error in the notes above and give the corrected answer.",
    "Answer the question, building on the notes above. Reason step by step, check every "
    "step against the question, and finish with one line that states the final answer.",
)
ENERGY = 0.9
CURVE_RANKS = 64
LONG_SEGMENT = 64


# --- spectra ---------------------------------------------------------------------------------


def energy_curve(m: torch.Tensor, max_rank: int = CURVE_RANKS) -> torch.Tensor:
    """``[L, max_rank]``: share of the squared spectrum of each ``m[l]`` in its top k values,
    k = 1..max_rank (1.0 past the matrix's rank)."""
    s2 = torch.linalg.svdvals(m.float()).pow(2)
    cum = s2.cumsum(-1) / s2.sum(-1, keepdim=True).clamp_min(1e-30)
    if cum.shape[-1] >= max_rank:
        return cum[:, :max_rank]
    pad = torch.ones(cum.shape[0], max_rank - cum.shape[-1])
    return torch.cat([cum, pad], dim=-1)


@dataclass
class Family:
    """Spectra of one family of matrices (e.g. delta K of query slots), instance by instance."""

    name: str
    lengths: list[int] = field(default_factory=list)
    bounds: list[int] = field(default_factory=list)  # min(n, D): the largest possible rank
    ranks: list[torch.Tensor] = field(default_factory=list)  # [L] effective rank each
    curves: list[torch.Tensor] = field(default_factory=list)  # [L, CURVE_RANKS] each

    def add(self, m: torch.Tensor) -> None:
        """One instance: ``[L, n, D]`` matrices (layers 1..L-1)."""
        self.lengths.append(m.shape[1])
        self.bounds.append(min(m.shape[1], m.shape[2]))
        self.ranks.append(energy_rank(m, ENERGY).float())
        self.curves.append(energy_curve(m))

    def summary(self, min_length: int = 0, name: str | None = None) -> dict[str, Any] | None:
        """Means over instances of at least ``min_length`` tokens (None when there are none)."""
        keep = [i for i, n in enumerate(self.lengths) if n >= min_length]
        if not keep:
            return None
        ranks = torch.stack([self.ranks[i] for i in keep])  # [I, L]
        curves = torch.stack([self.curves[i] for i in keep])  # [I, L, K]
        lengths = torch.tensor([self.lengths[i] for i in keep], dtype=torch.float)
        bounds = torch.tensor([self.bounds[i] for i in keep], dtype=torch.float)
        return {
            "family": name or self.name,
            "instances": len(keep),
            "tokens_mean": float(lengths.mean()),
            "tokens_min": int(lengths.min()),
            "tokens_max": int(lengths.max()),
            "effective_rank_mean": float(ranks.mean()),
            "effective_rank_median": float(ranks.median()),
            "effective_rank_p90": float(ranks.flatten().quantile(0.9)),
            "effective_rank_max": int(ranks.max()),
            "share_below_32": float((ranks < 32).float().mean()),
            "rank_fraction_mean": float((ranks / bounds[:, None]).mean()),
            "energy_at_8": float(curves[:, :, 7].mean()),
            "energy_at_32": float(curves[:, :, 31].mean()),
            "energy_at_8_min": float(curves[:, :, 7].min()),
            "rank_per_layer": ranks.mean(0).tolist(),
            "energy_curve": curves.mean((0, 1)).tolist(),
        }


# --- prefix-induced deviations ---------------------------------------------------------------


def glue_kv(
    model, tokenizer, system: str, query: tuple[int, ...], glues: list[tuple[int, ...]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Canonical KV ``[L, n, D]`` (K, V) of each glue prefilled after ``system`` + question."""
    segs = render_segments(
        tokenizer, system, "Question:\n{query}\n\n{glue}", {"query": query, "glue": ()}
    )
    head: list[int] = []
    for seg in segs:
        if seg.slot == "glue":
            break
        head.extend(seg.tokens)
    context = model.new_cache(capacity=len(head) + max(len(g) for g in glues))
    model.prefill(head, context)
    out = []
    for g in glues:
        cache = context.clone()
        cache.reserve(context.length + len(g))
        model.prefill(list(g), cache)
        kv = SegmentKV.from_cache(cache, context.length, cache.length, model.inv_freq)
        out.append((as_matrices(kv.k)[1:], as_matrices(kv.v)[1:]))
    return out


def prefix_deviations(
    loaded: LoadedModel,
    systems: list[str],
    queries: list[str],
    glue_texts: tuple[str, ...],
    log: Callable[[str], None],
) -> dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(glue, agent a, agent b) -> [(dK, dV) per query]``: KV of the glue after agent b's
    system prompt minus after agent a's, for consecutive agent pairs."""
    tok, model = loaded.tokenizer, loaded.model
    glues = [tokenize(tok, g) for g in glue_texts]
    out: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for qi, q in enumerate(queries):
        kvs = [glue_kv(model, tok, s, tokenize(tok, q), glues) for s in systems]
        for a in range(len(systems) - 1):
            for g in range(len(glues)):
                (ak, av), (bk, bv) = kvs[a][g], kvs[a + 1][g]
                out.setdefault((g, a, a + 1), []).append((bk - ak, bv - av))
        log(f"prefix deviations: question {qi + 1}/{len(queries)}")
    return out


# --- the experiment --------------------------------------------------------------------------


def families_from_pairs(pairs: list[EdgePair]) -> dict[str, Family]:
    """Delta and base matrices of every pair, by slot kind (query / agent output) and all."""
    fams: dict[str, Family] = {}
    for p in pairs:
        kind = "query" if p.kind == "query" else "agent"
        for part, m in (
            ("delta K", p.y_k - p.x_k),
            ("delta V", p.y_v - p.x_v),
            ("base K", p.x_k),
            ("base V", p.x_v),
        ):
            for group in (f"{part} ({kind})", f"{part} (all)"):
                fams.setdefault(group, Family(group)).add(m)
    return fams


def families_from_deviations(
    devs: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]],
) -> dict[str, Family]:
    """PF deviations one by one, and stacked over questions per (glue, agent pair)."""
    fams = {n: Family(n) for n in ("PF K", "PF V", "PF K (stacked)", "PF V (stacked)")}
    for items in devs.values():
        for dk, dv in items:
            fams["PF K"].add(dk)
            fams["PF V"].add(dv)
        fams["PF K (stacked)"].add(torch.cat([dk for dk, _ in items], dim=1))
        fams["PF V (stacked)"].add(torch.cat([dv for _, dv in items], dim=1))
    return fams


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


def analyse(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from kvcmas.eval.calibrate_replay import collect_pairs
    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.model.loader import load_model
    from kvcmas.workflow.builtin import roster

    loaded = load_model(args.model, args.dtype)
    workflow = load_workflow(args.workflow)
    requests = load_requests(args.requests, args.limit, split=args.split)
    log(f"collecting (source, dense) pairs on {len(requests)} requests ...")
    pairs = collect_pairs(
        loaded, workflow, requests, lambda i, _: log(f"pairs: request {i + 1}/{len(requests)}")
    )
    fams = families_from_pairs(pairs)
    del pairs
    systems = [a.system for a in roster().agents]
    queries = [r["query"] for r in requests[: args.pf_questions]]
    log(f"prefix deviations: {len(GLUE_TEXTS)} glue texts after {len(systems)} system prompts")
    devs = prefix_deviations(loaded, systems, queries, GLUE_TEXTS, log)
    fams.update(families_from_deviations(devs))
    summaries = {}
    for part in ("delta", "base"):
        for x in "KV":
            for group in ("query", "agent", "all"):
                name = f"{part} {x} ({group})"
                summaries[name] = fams[name].summary() if name in fams else None
            long = f"{part} {x} (all, >= {LONG_SEGMENT} tokens)"
            every = fams.get(f"{part} {x} (all)")
            summaries[long] = every.summary(LONG_SEGMENT, long) if every else None
    summaries.update({name: f.summary() for name, f in fams.items() if name.startswith("PF")})
    return {
        "setup": common.setup(
            loaded,
            args.dtype,
            workflow=workflow.name,
            requests=f"{args.requests}/{args.split} ({len(requests)})",
            pf_questions=len(queries),
            glue_texts=len(GLUE_TEXTS),
            energy=ENERGY,
        ),
        "glue_texts": list(GLUE_TEXTS),
        "summaries": summaries,
        "claims": claims(summaries),
    }


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Low-rank structure of KV deviations and base caches",
        "",
        *common.setup_lines(results["setup"]),
        "",
        "Per layer (1..L-1) and instance, canonical frame. Effective rank: singular values "
        "holding 90% of the squared spectrum. Averages run over instances and layers. A matrix "
        "of n tokens has rank at most min(n, D).",
        "",
        "| family | instances | tokens (mean, min-max) | eff. rank mean | median | p90 | max "
        "| share < 32 | eff. rank / min(n, D) | energy @8 | energy @32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["summaries"].values():
        if s is None:
            continue
        lines.append(
            f"| {s['family']} | {s['instances']} | {s['tokens_mean']:.0f} "
            f"({s['tokens_min']}-{s['tokens_max']}) | {s['effective_rank_mean']:.1f} "
            f"| {s['effective_rank_median']:.0f} | {s['effective_rank_p90']:.0f} "
            f"| {s['effective_rank_max']} | {s['share_below_32']:.2f} "
            f"| {s['rank_fraction_mean']:.2f} | {s['energy_at_8']:.3f} "
            f"| {s['energy_at_32']:.3f} |"
        )
    lines += ["", "## The paper's claims", "", "| claim | measured | verdict |", "|---|---|---|"]
    for name, c in results["claims"].items():
        measured = "; ".join(
            f"{k.replace('measured_', '')}: {format_pair(v)}"
            for k, v in c.items()
            if k.startswith("measured")
        )
        verdict = "holds" if c["holds"] else "does not hold"
        if c.get("holds_on_long_segments") is not None:
            verdict += (
                f" (on segments >= {LONG_SEGMENT} tokens: "
                f"{'holds' if c['holds_on_long_segments'] else 'does not hold'})"
            )
        lines.append(f"| {name.replace('_', ' ')} | {measured} | **{verdict}** |")
    return "\n".join(lines) + "\n"


def format_pair(v: list[float | None] | None) -> str:
    return "-" if v is None or None in v else " / ".join(f"{x:.2f}" for x in v)


PLOTTED = ("delta K (all)", "delta V (all)", "base K (all)", "base V (all)", "PF K", "PF V")


def plot(results: dict[str, Any], out: Path) -> None:
    s = results["setup"]
    title = f"{s['model']} {s['dtype']}, {s['workflow']} ({s['requests']})"
    sums = {k: results["summaries"].get(k) for k in PLOTTED}
    common.line_plot(
        out / "energy_curves.png",
        {k: (range(1, CURVE_RANKS + 1), v["energy_curve"]) for k, v in sums.items() if v},
        "rank k",
        "share of squared singular-value energy in top k",
        title,
        hline=ENERGY,
    )
    common.line_plot(
        out / "effective_rank_per_layer.png",
        {
            k: (range(1, len(v["rank_per_layer"]) + 1), v["rank_per_layer"])
            for k, v in sums.items()
            if v
        },
        "layer",
        "effective rank (90% energy), mean over instances",
        title,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcmas.experiments.args import add_model_args

    p.add_argument("--workflow", default="roster")
    p.add_argument("--requests", default="mmlu", help="JSONL file or dataset name")
    p.add_argument("--split", default="validation")
    p.add_argument("--limit", type=int, default=16, help="calibration requests for pairs")
    p.add_argument("--pf-questions", type=int, default=16, help="questions for PF deviations")
    p.add_argument("--out", required=True)
    add_model_args(p)


def run(args: argparse.Namespace) -> int:
    log = common.Progress("lowrank")
    results = analyse(args, log)
    return common.finish(args.out, results, log, markdown, plot)


def smoke_args(out_dir: str | Path) -> list[str]:
    return ["--limit", "2", "--pf-questions", "2", "--out", str(out_dir)]
