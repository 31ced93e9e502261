"""``kvcmas bench calibrate``: how KVCMAS's temperature, rank and gate were chosen.

One all-dense pass over a calibration stream (MMLU validation questions by default, never
the test split) records every workflow edge's (source, dense) pairs; replaying them through
fresh pools gives, per (T, r, tau), the share of matched segments the gate would reuse and
their error relative to FullShared's. This is an offline estimate of the correction's effect
on KV error; answer agreement is measured by ``bench compare`` and ``bench accuracy``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvcmas.eval.calibrate_replay import collect_pairs, replay
from kvcmas.methods.anchors import PoolConfig

HELP = "choose KVCMAS's temperature, rank and gate threshold from replayed anchor pairs"
TEMPERATURES = (0.02, 0.05, 0.1, 0.2, 0.5)
RANKS = (4, 8, 32, 0)
TAUS = (0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 1.01)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcmas.experiments.args import add_model_args

    p.add_argument("--workflow", default="roster")
    p.add_argument("--requests", default="mmlu", help="JSONL file or dataset name")
    p.add_argument("--split", default="validation")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--pool-size", type=int, default=10)
    p.add_argument("--out", required=True)
    add_model_args(p)


def smoke_args(out_dir: str) -> list[str]:
    return ["--limit", "4", "--out", out_dir]


def sweep(pairs, pool_size: int) -> list[dict]:
    """Error ratio (corrected / FullShared) of the segments each tau would reuse."""
    rows = []
    for t in TEMPERATURES:
        for r in RANKS:
            cfg = PoolConfig(capacity=pool_size, delta_rank=r or None, base_rank=32, temperature=t)
            matched = [x for x in replay(pairs, cfg) if "corrected_error" in x]
            if not matched:
                continue
            ent = torch.tensor([x["entropy"] for x in matched])
            ratio = torch.tensor([x["corrected_error"] / x["fullshared_error"] for x in matched])
            for tau in TAUS:
                sel = ent < tau
                rows.append(
                    {
                        "temperature": t,
                        "delta_rank": r or "full",
                        "tau": tau,
                        "matched": len(matched),
                        "reuse_share": float(sel.float().mean()),
                        "error_ratio": float(ratio[sel].mean()) if sel.any() else None,
                    }
                )
    return rows


def write(rows: list[dict], setup: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    lines = [
        f"# KVCMAS calibration: {setup['workflow']}, {setup['requests']} requests "
        f"({setup['source']}, split {setup['split']}), {setup['pairs']} edge pairs",
        "",
        f"Model {setup['model']} (fp32), pool size {setup['pool_size']}, base rank 32. "
        "`reuse` is the share of matched segments with entropy below tau; `error ratio` is "
        "their mean KV error after correction divided by FullShared's (below 1 is better).",
        "",
        "| T | delta rank | tau | reuse | error ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["error_ratio"] is None else f"{r['error_ratio']:.3f}"
        lines.append(
            f"| {r['temperature']} | {r['delta_rank']} | {r['tau']} | "
            f"{r['reuse_share']:.2f} | {ratio} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "calibration.png", setup)


def plot(rows: list[dict], path: Path, setup: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in TEMPERATURES:
        for r in (8, 32):
            pts = [
                (x["reuse_share"], x["error_ratio"])
                for x in rows
                if x["temperature"] == t and x["delta_rank"] == r and x["error_ratio"]
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=f"T={t}, r={r}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("share of matched segments reused (tau sweep)")
    ax.set_ylabel("KV error / FullShared's (reused segments)")
    ax.set_title(f"{setup['model']} fp32, {setup['workflow']}, {setup['pairs']} pairs")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import sys

    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.model.loader import load_model

    out = Path(args.out)
    workflow = load_workflow(args.workflow)
    requests = load_requests(args.requests, args.limit, split=args.split)
    loaded = load_model(args.model, "fp32")
    start = time.perf_counter()

    def progress(i, _):
        print(
            f"  dense pass: request {i + 1}/{len(requests)} ({time.perf_counter() - start:.0f}s)",
            file=sys.stderr,
            flush=True,
        )

    pairs = collect_pairs(loaded, workflow, requests, progress)
    print(f"replaying {len(pairs)} pairs ...", file=sys.stderr, flush=True)
    rows = sweep(pairs, args.pool_size)
    setup = {
        "model": loaded.name,
        "workflow": workflow.name,
        "requests": len(requests),
        "source": args.requests,
        "split": args.split,
        "pairs": len(pairs),
        "pool_size": args.pool_size,
    }
    write(rows, setup, out)
    print((out / "table.md").read_text())
    return 0
