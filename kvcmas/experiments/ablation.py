"""``kvcmas bench ablation``: KVCMAS's knobs one at a time.

* **(a) rank r and pool size V** against KV error and pool bytes, offline: (source, dense)
  pairs are collected once on a calibration stream (MMLU validation by default) and replayed
  through fresh pools (:func:`kvcmas.eval.calibrate_replay.replay`, which always corrects once two
  anchors exist, and records every pair as an anchor). ``r`` is the rank of bases and deltas.
* **(b) gate threshold tau**: offline, the share of replayed pairs the gate would reuse and
  their error (a dense fallback has none); online, real runs of a few tau values on a small
  stream (MMLU test) against NonShared: reuse, KV error, answer agreement.
* **(c) chained vs non-chained** (``chain=False``: a context-free reference prefill is the
  base of a query), real runs: TTFT of non-first hops and KV error.
* **(d) scale**: nonshared vs kvcmas as the number of agents grows (roster-style chains, each
  agent reads the question and every earlier output) and as debate rounds grow (three
  debaters; each round reads every answer of the round before): TTFT and reuse, measured
  after ``--warmup`` requests that fill the pools.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcmas.eval import calibrate_replay as calibrate
from kvcmas.experiments import common
from kvcmas.experiments.compare import fmt, run_method, summarize
from kvcmas.methods import make_method
from kvcmas.methods.anchors import AnchorPool, PoolConfig
from kvcmas.methods.kvcmas import DEFAULT_TAU, DEFAULT_TEMPERATURE
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.builtin import roster
from kvcmas.workflow.spec import AgentSpec, Workflow

HELP = "KVCMAS ablations: rank and pool size, gate threshold, chaining, agents and rounds"
PARTS = ("a", "b", "c", "d")
DEFAULT_RANK, DEFAULT_POOL = 32, 10
ROLE_POOL = (
    ("analyst", "You are a precise analyst. You identify what a question is really asking."),
    ("solver", "You are a careful problem solver who reasons step by step."),
    ("checker", "You are a skeptical reviewer who looks for mistakes."),
    ("expert", "You are a domain expert. You recall the facts a question depends on."),
    ("planner", "You are a planner. You outline how to approach a question."),
)
DECIDER = (
    "decider",
    "You are the final decision maker. You weigh the team's notes and answer.",
    "Give the final answer in one or two sentences.",
)


# --- workflows for (d) ------------------------------------------------------------------------


def chain_workflow(n_agents: int, output_tokens: int) -> Workflow:
    """``n_agents`` in order (the last one decides); each reads the query and every earlier
    output: :func:`kvcmas.workflow.builtin.roster` with ``n_agents - 1`` task agents."""
    if not 2 <= n_agents <= len(ROLE_POOL) + 1:
        raise ValueError(f"n_agents must be in 2..{len(ROLE_POOL) + 1}")
    roles = tuple(
        (name, system, "Answer the question, building on any notes above.")
        for name, system in ROLE_POOL[: n_agents - 1]
    )
    return roster(f"chain{n_agents}", roles, DECIDER, output_tokens, output_tokens)


def debate_workflow(rounds: int, debaters: int = 3, output_tokens: int = 32) -> Workflow:
    """``debaters`` answer in each of ``rounds`` rounds; from round 2 every debater reads the
    question and all answers of the previous round. The last debater of the last round is
    the final agent."""
    if rounds < 1 or not 1 <= debaters <= len(ROLE_POOL):
        raise ValueError(f"need rounds >= 1 and 1..{len(ROLE_POOL)} debaters")
    agents = []
    for r in range(1, rounds + 1):
        for name, system in ROLE_POOL[:debaters]:
            earlier = "".join(
                f"\n\nAnswer of the {d} in round {r - 1}:\n{{{d}_r{r - 1}}}"
                for d, _ in (ROLE_POOL[:debaters] if r > 1 else ())
            )
            ask = "Answer the question." if r == 1 else "Considering these answers, answer again."
            prompt = f"Question:\n{{query}}{earlier}\n\n{ask}"
            agents.append(AgentSpec(f"{name}_r{r}", system, prompt, output_tokens))
    return Workflow(f"debate{rounds}x{debaters}", tuple(agents), agents[-1].name)


# --- (a) and (b) offline: replayed pairs -------------------------------------------------------


def replay_config(
    pairs: list[calibrate.EdgePair], config: PoolConfig
) -> tuple[list[dict], dict[str, Any]]:
    """Replay rows and the summary of one pool configuration, with its final pool bytes."""
    pools: dict[tuple[str, str], AnchorPool] = {}
    rows = calibrate.replay(pairs, config, pools=pools)
    matched = [r for r in rows if "corrected_error" in r]
    stats = {
        **calibrate.summarize(rows),
        "corrected_error_mean": common.mean(r["corrected_error"] for r in matched),
        "fullshared_error_mean": common.mean(r["fullshared_error"] for r in matched),
        "pool_bytes": sum(p.nbytes() for p in pools.values()),
        "anchors": sum(len(p.anchors) for p in pools.values()),
        "edges": len(pools),
    }
    return rows, stats


def rank_pool_sweep(
    pairs: list[calibrate.EdgePair],
    ranks: list[int | None],
    pool_sizes: list[int],
    temperature: float,
    log: Callable[[str], None],
) -> tuple[list[dict], list[dict]]:
    """(a): every (r, V); also returns the replay rows of the default (r, V) for (b)."""
    out, default_rows = [], []
    for r in ranks:
        for v in pool_sizes:
            cfg = PoolConfig(capacity=v, delta_rank=r, base_rank=r, temperature=temperature)
            rows, stats = replay_config(pairs, cfg)
            out.append({"rank": r, "pool_size": v, **stats})
            if (r, v) == (DEFAULT_RANK, DEFAULT_POOL):
                default_rows = rows
            log(
                f"(a) r={r or 'full'} V={v}: error ratio {fmt(stats.get('error_ratio_mean'))}, "
                f"pool {stats['pool_bytes'] / 2**20:.1f} MiB"
            )
    return out, default_rows


def tau_offline(rows: list[dict], taus: list[float]) -> list[dict]:
    """(b) offline: reuse share and error if the gate reused pairs with entropy below tau.

    A pair the gate sends to dense prefill has zero error; one without enough anchors is dense
    as well. ``error_all_mean`` averages over every pair."""
    out = []
    tokens = sum(r["tokens"] for r in rows)
    for tau in taus:
        reused = [r for r in rows if "entropy" in r and r["entropy"] < tau]
        out.append(
            {
                "tau": tau,
                "pairs": len(rows),
                "reused": len(reused),
                "reuse_ratio_calls": len(reused) / max(len(rows), 1),
                "reuse_ratio_tokens": sum(r["tokens"] for r in reused) / max(tokens, 1),
                "error_reused_mean": common.mean(r["corrected_error"] for r in reused),
                "error_all_mean": sum(r["corrected_error"] for r in reused) / max(len(rows), 1),
                "fullshared_error_reused_mean": common.mean(r["fullshared_error"] for r in reused),
            }
        )
    return out


# --- (b), (c) online and (d): real runs -------------------------------------------------------


class RealRuns:
    """Methods on one request stream with an fp32 reference; NonShared first, memoised."""

    def __init__(
        self,
        loaded: LoadedModel,
        reference: LoadedModel,
        workflow: Workflow,
        requests: list[dict],
        log: Callable[[str], None],
    ):
        self.loaded, self.reference, self.workflow = loaded, reference, workflow
        self.requests, self.log = requests, log
        self._done: dict[str, dict[str, Any]] = {}
        self._baseline = None

    def summary(self, label: str, name: str, **params: Any) -> dict[str, Any]:
        if label in self._done:
            return self._done[label]
        if self._baseline is None and name != "nonshared":
            self.summary("nonshared", "nonshared")
        method = make_method(name, **params)
        n = len(self.requests)

        def progress(i, _):
            self.log(f"{label}: request {i + 1}/{n}")

        results = run_method(
            self.loaded, self.reference, self.workflow, method, self.requests, progress
        )
        if name == "nonshared":
            self._baseline = results
        cfg = self.loaded.config
        s = summarize(results, method, self._baseline, cfg.n_layers, cfg.kv_width)
        self._done[label] = {k: v for k, v in s.items() if k not in ("by_segment_length",)}
        return self._done[label]


def tau_online(runs: RealRuns, taus: list[float]) -> list[dict]:
    return [{"tau": t, **runs.summary(label_for(t, True), "kvcmas", tau=t)} for t in taus]


def chain_rows(runs: RealRuns, tau: float) -> list[dict]:
    return [
        {"chain": c, **runs.summary(label_for(tau, c), "kvcmas", tau=tau, chain=c)}
        for c in (True, False)
    ]


def label_for(tau: float, chain: bool) -> str:
    return f"kvcmas tau={tau}" + ("" if chain else " no-chain")


def scale_runs(
    loaded: LoadedModel,
    workflows: list[tuple[str, int, Workflow]],
    requests: list[dict],
    warmup: int,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """(d): nonshared and kvcmas on each workflow; figures over requests after ``warmup``."""
    out = []
    for axis, value, wf in workflows:
        for name in ("nonshared", "kvcmas"):
            runner = common.trace_runner(loaded, wf, make_method(name), ignore_eos=True)
            results = common.run_stream(runner, requests, log, f"(d) {wf.name} {name}")
            out.append(
                {
                    "axis": axis,
                    "value": value,
                    "workflow": wf.name,
                    "agent_calls": len(wf.agents),
                    "method": name,
                    **common.speed_summary(results[warmup:]),
                }
            )
    base = {(r["axis"], r["value"]): r for r in out if r["method"] == "nonshared"}
    for r in out:
        b = base[(r["axis"], r["value"])]["ttft_nonfirst_mean_s"]
        r["speedup_vs_nonshared"] = b / r["ttft_nonfirst_mean_s"] if b else None
    return out


# --- the experiment ---------------------------------------------------------------------------


def capped(workflow: Workflow, max_new_tokens: int | None) -> Workflow:
    """``workflow`` with every agent's output budget at most ``max_new_tokens``."""
    if max_new_tokens is None:
        return workflow
    agents = tuple(
        replace(a, max_new_tokens=min(a.max_new_tokens, max_new_tokens)) for a in workflow.agents
    )
    return Workflow(workflow.name, agents, workflow.final)


def ablate(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.model.loader import load_model

    loaded = load_model(args.model, args.dtype)
    workflow = capped(load_workflow(args.workflow), args.agent_tokens or None)
    results: dict[str, Any] = {"parts": args.parts}
    if {"a", "b"} & set(args.parts):
        calib = load_requests(args.requests, args.limit, split=args.split)
        log(f"collecting (source, dense) pairs on {len(calib)} calibration requests ...")
        pairs = calibrate.collect_pairs(
            loaded, workflow, calib, lambda i, _: log(f"pairs: request {i + 1}/{len(calib)}")
        )
        ranks = args.ranks if "a" in args.parts else [DEFAULT_RANK]
        sizes = args.pool_sizes if "a" in args.parts else [DEFAULT_POOL]
        if "b" in args.parts:  # (b) replays the default configuration
            ranks = ranks if DEFAULT_RANK in ranks else [*ranks, DEFAULT_RANK]
            sizes = sizes if DEFAULT_POOL in sizes else [*sizes, DEFAULT_POOL]
        grid, default_rows = rank_pool_sweep(pairs, ranks, sizes, args.temperature, log)
        results["pairs"] = len(pairs)
        if "a" in args.parts:
            results["rank_pool"] = grid
        if "b" in args.parts:
            results["tau_offline"] = tau_offline(default_rows, args.taus)
        del pairs
    if {"b", "c"} & set(args.parts):
        reference = loaded if args.dtype == "fp32" else load_model(args.model, "fp32")
        stream = load_requests(args.stream, args.stream_limit, split="test")
        runs = RealRuns(loaded, reference, workflow, stream, log)
        if "b" in args.parts:
            results["tau_online"] = tau_online(runs, args.real_taus)
        if "c" in args.parts:
            results["chain"] = chain_rows(runs, DEFAULT_TAU)
        results["nonshared"] = runs.summary("nonshared", "nonshared")
    if "d" in args.parts:
        stream = load_requests(args.stream, args.warmup + args.scale_requests, split="test")
        wfs = [("agents", n, chain_workflow(n, args.output_tokens)) for n in args.agents]
        wfs += [("rounds", r, debate_workflow(r, 3, args.output_tokens)) for r in args.rounds]
        results["scale"] = scale_runs(loaded, wfs, stream, args.warmup, log)
    results["setup"] = common.setup(
        loaded,
        args.dtype,
        workflow=workflow.name,
        agent_tokens=args.agent_tokens or "workflow's own",
        calibration=f"{args.requests}/{args.split} ({args.limit})",
        stream=f"{args.stream}/test ({args.stream_limit})",
        temperature=args.temperature,
        scale_requests=f"{args.warmup} warm-up + {args.scale_requests} measured",
        output_tokens_scale=args.output_tokens,
    )
    return results


# --- tables and plots -------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    lines = ["# KVCMAS ablations", "", *common.setup_lines(results["setup"]), ""]
    if "rank_pool" in results:
        lines += rank_pool_table(results["rank_pool"], results["pairs"])
    if "tau_offline" in results:
        lines += tau_offline_table(results["tau_offline"])
    if "tau_online" in results:
        lines += online_table(
            "(b) Gate threshold tau: real runs against NonShared (fp32 reference)",
            "tau",
            results["tau_online"],
            results["nonshared"],
        )
    if "chain" in results:
        lines += online_table(
            f"(c) Chained vs non-chained (tau {DEFAULT_TAU})",
            "chain",
            results["chain"],
            results["nonshared"],
        )
    if "scale" in results:
        lines += scale_table(results["scale"])
    return "\n".join(lines) + "\n"


def rank_pool_table(rows: list[dict], pairs: int) -> list[str]:
    out = [
        f"## (a) Rank r and pool size V (offline replay of {pairs} pairs)",
        "",
        "Error ratio: corrected / FullShared relative KV error over matched pairs (lower is "
        "better; 1 = no gain). Pool bytes: all edges' pools at the end of the stream.",
        "",
        "| r | V | matched | error ratio mean | median | corrected err | FullShared err "
        "| anchors | pool MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['rank'] or 'full'} | {r['pool_size']} | {r['matched']} "
            f"| {fmt(r.get('error_ratio_mean'))} | {fmt(r.get('error_ratio_median'))} "
            f"| {fmt(r['corrected_error_mean'], '.4f')} | {fmt(r['fullshared_error_mean'], '.4f')} "
            f"| {r['anchors']} | {r['pool_bytes'] / 2**20:.2f} |"
        )
    return [*out, ""]


def tau_offline_table(rows: list[dict]) -> list[str]:
    out = [
        f"## (b) Gate threshold tau, offline (replay, r={DEFAULT_RANK}, V={DEFAULT_POOL})",
        "",
        "| tau | reuse (pairs) | reuse (tokens) | error of reused | FullShared error of reused "
        "| error over all pairs (dense = 0) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['tau']} | {r['reuse_ratio_calls']:.2f} | {r['reuse_ratio_tokens']:.2f} "
            f"| {fmt(r['error_reused_mean'], '.4f')} "
            f"| {fmt(r['fullshared_error_reused_mean'], '.4f')} | {r['error_all_mean']:.4f} |"
        )
    return [*out, ""]


def online_table(title: str, key: str, rows: list[dict], base: dict) -> list[str]:
    out = [
        f"## {title}",
        "",
        "| run | reuse (tokens) | KV err | KL first (mean) | final agree | TTFT s "
        "| TTFT / NonShared | pool KiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in [{key: "nonshared", **base}, *rows]:
        ratio = r["ttft_nonfirst_mean_s"] / base["ttft_nonfirst_mean_s"]
        out.append(
            f"| {key} {r[key]} | {r['reuse_ratio_tokens']:.2f} | {fmt(r['kv_error_mean'], '.4f')} "
            f"| {fmt(r['first_token_kl_mean'], '.4f')} | {fmt(r.get('final_agreement'), '.2f')} "
            f"| {fmt(r['ttft_nonfirst_mean_s'])} | {ratio:.2f} "
            f"| {r['method_state_bytes'] / 1024:.0f} |"
        )
    return [*out, ""]


def scale_table(rows: list[dict]) -> list[str]:
    out = [
        "## (d) Agents and rounds: nonshared vs kvcmas",
        "",
        "Outputs forced to the token budget (end-of-turn ignored); figures over the measured "
        "requests after the warm-up ones. Agents: roster-style chains (each agent reads the "
        "question and every earlier output); rounds: three debaters, each round reading all "
        "answers of the round before.",
        "",
        "| axis | value | agent calls | method | TTFT s | speedup | reuse (tokens) "
        "| prompt tokens | peak state MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['axis']} | {r['value']} | {r['agent_calls']} | {r['method']} "
            f"| {fmt(r['ttft_nonfirst_mean_s'])} | {fmt(r['speedup_vs_nonshared'], '.2f')} "
            f"| {r['reuse_ratio_tokens']:.2f} | {fmt(r['prompt_tokens_nonfirst_mean'], '.0f')} "
            f"| {r['peak_state_bytes'] / 2**20:.1f} |"
        )
    return [*out, ""]


def plot(results: dict[str, Any], out: Path) -> list[str]:
    s = results["setup"]
    title = f"{s['model']} {s['dtype']}, {s['workflow']}"
    written = []
    if "rank_pool" in results:
        grid = results["rank_pool"]
        sizes = sorted({r["pool_size"] for r in grid})
        ranks = list(dict.fromkeys(r["rank"] for r in grid))
        xs = [r or 256 for r in ranks]  # full rank drawn at 256 (log axis)
        for key, fname, ylabel in (
            ("error_ratio_mean", "rank_pool_error.png", "KV error ratio corrected / FullShared"),
            ("pool_bytes", "rank_pool_bytes.png", "pool bytes (end of stream)"),
        ):
            series = {f"V={v}": (xs, [cell(grid, r, v, key) for r in ranks]) for v in sizes}
            xlabel = "rank r (full drawn at 256)"
            logy = key == "pool_bytes"
            common.line_plot(out / fname, series, xlabel, ylabel, title, logx=True, logy=logy)
            written.append(fname)
    if "tau_offline" in results:
        rows = results["tau_offline"]
        taus = [r["tau"] for r in rows]
        series = {
            "reuse ratio (offline)": (taus, [r["reuse_ratio_calls"] for r in rows]),
            "error over all pairs (offline)": (taus, [r["error_all_mean"] for r in rows]),
        }
        for r in results.get("tau_online", []):
            series.setdefault("reuse ratio (real runs)", ([], []))
            series.setdefault("final agreement (real runs)", ([], []))
            series["reuse ratio (real runs)"][0].append(r["tau"])
            series["reuse ratio (real runs)"][1].append(r["reuse_ratio_tokens"])
            series["final agreement (real runs)"][0].append(r["tau"])
            series["final agreement (real runs)"][1].append(r.get("final_agreement"))
        common.line_plot(out / "tau.png", series, "tau", "value", title)
        written.append("tau.png")
    if "scale" in results:
        for axis in ("agents", "rounds"):
            rows = [r for r in results["scale"] if r["axis"] == axis]
            if not rows:
                continue
            series = {}
            for m in ("nonshared", "kvcmas"):
                mine = [r for r in rows if r["method"] == m]
                series[m] = ([r["value"] for r in mine], [r["ttft_nonfirst_mean_s"] for r in mine])
            fname = f"scale_{axis}.png"
            common.line_plot(out / fname, series, axis, "mean TTFT of non-first hops (s)", title)
            written.append(fname)
    return written


def cell(grid: list[dict], rank: int | None, pool_size: int, key: str) -> Any:
    hit = (r for r in grid if r["rank"] == rank and r["pool_size"] == pool_size)
    return next((r.get(key) for r in hit), None)


# --- command line -----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcmas.experiments.args import add_model_args

    p.add_argument("--parts", type=common.str_list, default=list(PARTS), help="a,b,c,d")
    p.add_argument("--workflow", default="roster", help="workflow of parts a-c")
    p.add_argument(
        "--agent-tokens",
        type=int,
        default=32,
        help="cap agents' output budgets (parts a-c; 0: the workflow's own)",
    )
    p.add_argument("--requests", default="mmlu", help="calibration stream (a, b offline)")
    p.add_argument("--split", default="validation", help="split of the calibration stream")
    p.add_argument("--limit", type=int, default=12, help="calibration requests")
    p.add_argument("--ranks", type=common.rank_list, default=[2, 4, 8, 16, 32, None])
    p.add_argument("--pool-sizes", type=common.int_list, default=[2, 5, 10, 20])
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    p.add_argument("--taus", type=common.float_list, default=[0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.01])
    p.add_argument("--real-taus", type=common.float_list, default=[0.5, DEFAULT_TAU, 1.01])
    p.add_argument("--stream", default="mmlu", help="dataset (test split) of the real runs")
    p.add_argument("--stream-limit", type=int, default=4, help="requests of the real runs")
    p.add_argument("--agents", type=common.int_list, default=[2, 3, 4, 6])
    p.add_argument("--rounds", type=common.int_list, default=[1, 2, 3])
    p.add_argument("--warmup", type=int, default=2, help="(d) warm-up requests")
    p.add_argument("--scale-requests", type=int, default=1, help="(d) measured requests")
    p.add_argument("--output-tokens", type=int, default=24, help="(d) tokens per agent")
    p.add_argument("--out", required=True)
    add_model_args(p)


def check_args(args: argparse.Namespace) -> None:
    from kvcmas.errors import UsageError

    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        raise UsageError(f"unknown part(s) {', '.join(bad)}: choose from {', '.join(PARTS)}")
    if any(v < 1 for v in args.pool_sizes) or any(r is not None and r < 1 for r in args.ranks):
        raise UsageError("ranks and pool sizes must be positive (rank 'full' or 0: full)")
    if any(not 2 <= n <= len(ROLE_POOL) + 1 for n in args.agents):
        raise UsageError(f"--agents values must be in 2..{len(ROLE_POOL) + 1}")
    if any(r < 1 for r in args.rounds) or args.scale_requests < 1 or args.warmup < 0:
        raise UsageError("need rounds >= 1, --scale-requests >= 1 and --warmup >= 0")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    log = common.Progress("ablation")
    results = ablate(args, log)
    return common.finish(args.out, results, log, markdown, plot)


def smoke_args(out_dir: str | Path) -> list[str]:
    return [
        "--agent-tokens", "8",
        "--limit", "3",
        "--ranks", "8,32",
        "--pool-sizes", "2,10",
        "--taus", f"0.9,{DEFAULT_TAU},1.01",
        "--real-taus", str(DEFAULT_TAU),
        "--stream-limit", "1",
        "--agents", "2,3",
        "--rounds", "1,2",
        "--warmup", "0",
        "--output-tokens", "8",
        "--out", str(out_dir),
    ]  # fmt: skip
