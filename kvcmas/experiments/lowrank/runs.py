"""Running the low-rank analysis: (source, dense) pairs on a calibration stream, prefix-induced
deviations of glue text between agents, and the spectra of every family."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from kvcmas.chat import render_segments, tokenize
from kvcmas.eval.anchor_pairs import EdgePair
from kvcmas.experiments import common
from kvcmas.experiments.lowrank.claims import claims
from kvcmas.experiments.lowrank.plan import GLUE_TEXTS, LONG_SEGMENT
from kvcmas.experiments.lowrank.spectra import ENERGY, Family
from kvcmas.kv.lowrank import as_matrices
from kvcmas.kv.segment import SegmentKV
from kvcmas.model.loader import LoadedModel


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
        out.append((as_matrices(kv.k[1:]), as_matrices(kv.v[1:])))
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


def analyse(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from kvcmas.eval.anchor_pairs import collect_pairs
    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.model.loader import load_model
    from kvcmas.workflow.builtin import roster

    loaded = load_model(args.model, args.dtype, args.device)
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
