"""``kvcmas bench context-sweep``: TTFT of non-first hops as the shared context grows.

A controlled four-agent trace (the paper's serving traces): a chain of agents where every
agent reads the shared document ``{doc}`` (a request input of exactly N tokens, built
deterministically from benchmark questions) and the output of every earlier agent. Each
agent output is exactly ``--output-tokens`` tokens: the end-of-turn token is ignored (vLLM's
``ignore_eos``; the token, if chosen, stays in the output as an ordinary token). Methods that
keep state across requests (anchor pools, residuals) first run ``--warmup`` requests on other
documents of the same size; every method is measured on the same ``--measure`` requests.
Each (size, method) runs in a spawned child process, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcmas.chat import render_segments, tokenize
from kvcmas.experiments import common
from kvcmas.experiments.args import add_method_args, add_model_args
from kvcmas.experiments.args import method_options as method_params
from kvcmas.experiments.compare import fmt
from kvcmas.methods import METHODS, make_method
from kvcmas.methods.base import Method
from kvcmas.workflow.spec import AgentSpec, Workflow

HELP = "TTFT of non-first hops and speedup over NonShared as the shared document grows"
DOC_SLOT = "doc"
ROLES = (
    (
        "reader",
        "You are a careful reader. You pick out what matters in long documents.",
        "Summarize the main points of the document.",
    ),
    (
        "analyst",
        "You are an analyst. You find patterns and connections between facts.",
        "Analyze the document, building on the notes above.",
    ),
    (
        "critic",
        "You are a skeptical critic who looks for mistakes and gaps.",
        "Point out errors or gaps in the notes above.",
    ),
    (
        "writer",
        "You are a writer. You turn notes into a clear final report.",
        "Write the final report.",
    ),
    (
        "checker",
        "You are a fact checker. You verify claims against the source.",
        "List any claim above that the document does not support.",
    ),
    (
        "editor",
        "You are an editor. You make reports correct and concise.",
        "Give the corrected final report in a few sentences.",
    ),
)


def trace_workflow(n_agents: int = 4, output_tokens: int = 128) -> Workflow:
    """A chain of ``n_agents``: each reads ``{doc}`` and every earlier agent's output."""
    if not 1 <= n_agents <= len(ROLES):
        raise ValueError(f"n_agents must be in 1..{len(ROLES)}")
    agents, earlier = [], []
    for name, system, instruction in ROLES[:n_agents]:
        notes = "".join(f"\n\nNotes from the {e}:\n{{{e}}}" for e in earlier)
        prompt = f"Document:\n{{{DOC_SLOT}}}{notes}\n\n{instruction}"
        agents.append(AgentSpec(name, system, prompt, output_tokens))
        earlier.append(name)
    return Workflow(name=f"trace{n_agents}", agents=tuple(agents), final=earlier[-1])


def overhead_tokens(tokenizer: Any, workflow: Workflow) -> int:
    """Largest, over agents, of the prompt tokens besides ``{doc}`` plus the new tokens, with
    every earlier output at its full budget."""
    worst = 0
    for agent in workflow.agents:
        slots = {s: (0,) * workflow.agent(s).max_new_tokens for s in agent.slots if s != DOC_SLOT}
        segs = render_segments(tokenizer, agent.system, agent.prompt, {DOC_SLOT: (), **slots})
        worst = max(worst, sum(len(s) for s in segs) + agent.max_new_tokens)
    return worst


def cap_sizes(sizes: list[int], limit: int) -> tuple[list[int], dict[int, int]]:
    """Sizes above ``limit`` become ``limit`` (once); returns the sizes and what was capped."""
    capped = {s: limit for s in sizes if s > limit}
    used = sorted({min(s, limit) for s in sizes})
    return used, capped


def exact_prefix(tokenizer, ids: list[int], n: int, slack: int = 8) -> str:
    """Text whose tokenization (after ``strip``) is exactly ``n`` tokens, cut from ``ids``.

    Cuts near ``n`` are tried first; where stripping a trailing space leaves one token short
    at every cut (digits split off a space token), a final ``.`` supplies the last token."""
    cuts = [n + d for d in sorted(range(-slack, slack + 1), key=abs) if 0 < n + d <= len(ids)]
    for suffix in ("", "."):
        for cut in cuts:
            text = tokenizer.decode(ids[:cut]).strip() + suffix
            if len(tokenize(tokenizer, text)) == n:
                return text
    raise ValueError(f"no cut near {n} tokens re-tokenizes to exactly {n} tokens")


def documents(tokenizer, texts: list[str], n_tokens: int, count: int) -> list[str]:
    """``count`` documents of exactly ``n_tokens`` tokens, each from the next ``texts``.

    Where no cut of a block of text re-tokenizes to exactly ``n_tokens`` (seen at 1024), the
    block is skipped and the next texts are tried."""
    docs, pos = [], 0
    while len(docs) < count:
        parts, total = [], 0
        while total < n_tokens + 16:
            if pos >= len(texts):
                raise ValueError(f"not enough text for {count} documents of {n_tokens} tokens")
            parts.append(texts[pos])
            total += len(tokenize(tokenizer, texts[pos])) + 1
            pos += 1
        ids = list(tokenize(tokenizer, "\n\n".join(parts)))
        try:
            docs.append(exact_prefix(tokenizer, ids, n_tokens))
        except ValueError:
            continue
    return docs


def source_texts(source: str) -> list[str]:
    from kvcmas.eval.requests import load_requests

    return [r["query"] for r in load_requests(source, None, split="test")]


def keeps_state(method: Method) -> bool:
    """Methods whose state persists across requests need warm-up requests first."""
    return type(method).memory_bytes is not Method.memory_bytes


def run_one(
    loaded,
    workflow: Workflow,
    name: str,
    params: dict[str, Any],
    docs: list[str],
    warmup: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One method on the trace: warm-ups (when it keeps state), then the measured requests."""
    method = make_method(name, params, strict=False)
    runner = common.trace_runner(loaded, workflow, method, ignore_eos=True)
    n_warm = warmup if keeps_state(method) else 0
    requests = [{"id": f"doc{i}", DOC_SLOT: d} for i, d in enumerate(docs)][warmup - n_warm :]
    results = common.run_stream(runner, requests, log, name)[n_warm:]
    return {
        "method": name,
        "params": method.params(),
        "warmup_requests": n_warm,
        "summary": common.speed_summary(results),
        "requests": [r.to_json() for r in results],
    }


def run_one_loading(model_spec: str, dtype: str, *call: Any) -> dict[str, Any]:
    """``run_one`` in a child process, which loads the model from the local cache first."""
    from kvcmas.model.loader import load_model

    return run_one(load_model(model_spec, dtype), *call)


def sweep(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from kvcmas.model.loader import load_model

    loaded = load_model(args.model, args.dtype)
    workflow = trace_workflow(args.agents, args.output_tokens)
    overhead = overhead_tokens(loaded.tokenizer, workflow)
    limit = loaded.config.max_position - overhead
    sizes, capped = cap_sizes(args.sizes, limit)
    for s, c in capped.items():
        log(f"size {s} capped to {c}: the context is {loaded.config.max_position} tokens")
    texts = source_texts(args.source)
    methods = ["nonshared"] + [m for m in args.methods if m != "nonshared"]
    params = method_params(args)
    runs: list[dict[str, Any]] = []
    # Every size's documents first: a size without documents fails in seconds, not hours.
    all_docs = {s: documents(loaded.tokenizer, texts, s, args.warmup + args.measure) for s in sizes}
    for size, docs in all_docs.items():
        for name in methods:
            log(f"size {size}: {name} ...")
            call = (workflow, name, params, docs, args.warmup, log)
            try:
                if args.isolate:  # the child loads the model itself (a second or so)
                    run = common.in_child(run_one_loading, args.model, args.dtype, *call)
                else:
                    run = run_one(loaded, *call)
            except RuntimeError as e:  # e.g. a full-dimensional pool out of memory
                run = {"method": name, "summary": None, "error": str(e)[-2000:]}
                log(f"size {size}: {name} FAILED: {str(e).strip().splitlines()[-1]}")
            run["size"] = size
            runs.append(run)
            if s := run["summary"]:
                log(
                    f"size {size}: {name} TTFT {s['ttft_nonfirst_mean_s']:.3f}s, "
                    f"reuse {s['reuse_ratio_tokens']:.2f}"
                )
    add_speedups(runs)
    return {
        "setup": common.setup(
            loaded,
            args.dtype,
            sizes=sizes,
            requested_sizes=args.sizes,
            agents=args.agents,
            output_tokens=args.output_tokens,
            warmup_requests=args.warmup,
            measured_requests=args.measure,
            source=args.source,
        ),
        "context_limit": loaded.config.max_position,
        "non_doc_tokens_max": overhead,
        "capped": {str(k): v for k, v in capped.items()},
        "isolated_processes": args.isolate,
        "runs": runs,
    }


def add_speedups(runs: list[dict[str, Any]]) -> None:
    """Speedup of each run's non-first-hop TTFT over NonShared's at the same size."""
    ttft = {id(r): r["summary"]["ttft_nonfirst_mean_s"] if r["summary"] else None for r in runs}
    base = {r["size"]: ttft[id(r)] for r in runs if r["method"] == "nonshared"}
    for r in runs:
        t, b = ttft[id(r)], base.get(r["size"])
        r["speedup_vs_nonshared"] = b / t if b and t else None


def markdown(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        f"# Context sweep: {s['agents']}-agent controlled trace",
        "",
        *common.setup_lines(s),
        "",
        f"Each agent reads the shared document of N tokens and every earlier agent's output; "
        f"outputs are exactly {s['output_tokens']} tokens (end-of-turn ignored). TTFT is the "
        f"mean over hops 2-{s['agents']} of {s['measured_requests']} measured requests; methods "
        f"with state ran {s['warmup_requests']} warm-up requests on other documents first. "
        "Peak state is the largest KV + held sources + method state of any hop; peak RSS is "
        "the process high-water mark of the run"
        + (" (each run in its own child process)." if results["isolated_processes"] else "."),
    ]
    for req, used in results["capped"].items():
        lines.append(
            f"Size {req} exceeds the model's {results['context_limit']}-token context once the "
            f"prompt, earlier outputs and new tokens ({results['non_doc_tokens_max']}) are "
            f"added: capped to {used}."
        )
    lines += [
        "",
        "| N | method | TTFT s | speedup | reuse (tokens) | prompt tokens | output tokens "
        "| peak state MiB | method state MiB | peak RSS MiB | first hop TTFT s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        m = r["summary"]
        if m is None:
            why = r["error"].strip().splitlines()[-1] if r.get("error") else "no result"
            lines.append(f"| {r['size']} | {r['method']} | failed: {why} |" + " |" * 8)
            continue
        o = m["output_tokens"]
        lines.append(
            f"| {r['size']} | {r['method']} | {fmt(m['ttft_nonfirst_mean_s'])} "
            f"| {fmt(r['speedup_vs_nonshared'], '.2f')} | {m['reuse_ratio_tokens']:.2f} "
            f"| {fmt(m['prompt_tokens_nonfirst_mean'], '.0f')} | {o['min']}-{o['max']} "
            f"| {m['peak_state_bytes'] / 2**20:.1f} | {m['method_state_bytes'] / 2**20:.1f} "
            f"| {m['peak_rss_bytes'] / 2**20:.0f} | {fmt(m['ttft_first_mean_s'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> None:
    s = results["setup"]
    by_method: dict[str, tuple[list, list, list]] = {}
    for r in results["runs"]:
        xs, ttft, speed = by_method.setdefault(r["method"], ([], [], []))
        xs.append(r["size"])
        ttft.append(r["summary"]["ttft_nonfirst_mean_s"] if r["summary"] else None)
        speed.append(r["speedup_vs_nonshared"])
    title = f"{s['model']} {s['dtype']}, {s['agents']}-agent trace, {s['machine']}"
    common.line_plot(
        out / "ttft_vs_size.png",
        {m: (x, t) for m, (x, t, _) in by_method.items()},
        "shared document tokens",
        "mean TTFT of non-first hops (s)",
        title,
        logx=True,
        logy=True,
    )
    common.line_plot(
        out / "speedup_vs_size.png",
        {m: (x, v) for m, (x, _, v) in by_method.items()},
        "shared document tokens",
        "TTFT speedup over NonShared",
        title,
        logx=True,
        hline=1.0,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=common.int_list, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument(
        "--methods",
        type=common.str_list,
        default=["nonshared", "fullshared", "kvcmas", "kvcomm"],
        help=f"comma-separated, from {', '.join(METHODS)}",
    )
    p.add_argument("--agents", type=int, default=4, help=f"chain length (1-{len(ROLES)})")
    p.add_argument("--output-tokens", type=int, default=128, help="tokens per agent output")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests (stateful methods)")
    p.add_argument("--measure", type=int, default=2, help="measured requests per size")
    p.add_argument("--source", default="mmlu", help="dataset whose questions make documents")
    p.add_argument(
        "--no-isolate",
        dest="isolate",
        action="store_false",
        help="run everything in this process (peak RSS then accumulates over runs)",
    )
    p.add_argument("--out", required=True)
    add_model_args(p)
    p.set_defaults(dtype="bf16")
    add_method_args(p)


def check_args(args: argparse.Namespace) -> None:
    from kvcmas.errors import UsageError

    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        known = ", ".join(METHODS)
        raise UsageError(f"unknown method(s) {', '.join(unknown)}: choose from {known}")
    if args.warmup < 0 or args.measure < 1 or args.output_tokens < 1:
        raise UsageError("need --warmup >= 0, --measure >= 1 and --output-tokens >= 1")
    if any(s < 1 for s in args.sizes):
        raise UsageError("sizes must be positive token counts")
    if not 2 <= args.agents <= len(ROLES):
        raise UsageError(f"--agents must be in 2..{len(ROLES)}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    log = common.Progress("context-sweep")
    results = sweep(args, log)
    return common.finish(args.out, results, log, markdown, plot)


def smoke_args(out_dir: str | Path) -> list[str]:
    return [
        "--sizes", "32,64",
        "--warmup", "2",
        "--measure", "1",
        "--output-tokens", "8",
        "--out", str(out_dir),
    ]  # fmt: skip
