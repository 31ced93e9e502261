"""The ``kvcmas`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvcmas.errors import KvcmasError, UsageError
from kvcmas.experiments.args import (
    add_method_args,
    add_model_args,
    add_saves_args,
    method_options,
)
from kvcmas.model.loader import DEFAULT_MODEL, DTYPES, parse_device


def cmd_generate(args: argparse.Namespace) -> int:
    from kvcmas.chat import chat_segments
    from kvcmas.model.generate import greedy_decode, stop_ids
    from kvcmas.model.loader import load_model

    loaded = load_model(args.model, args.dtype, args.device)
    tokens = [
        t for s in chat_segments(loaded.tokenizer, args.system, args.prompt) for t in s.tokens
    ]
    limit = loaded.config.max_position
    if len(tokens) >= limit:
        raise UsageError(f"prompt has {len(tokens)} tokens; the model's context is {limit}")
    budget = min(args.max_new_tokens, limit - len(tokens))
    model = loaded.model
    start = time.perf_counter()
    cache = model.new_cache(capacity=len(tokens) + budget)
    logits = model.prefill(tokens, cache)
    int(logits.argmax())
    ttft = time.perf_counter() - start
    out = greedy_decode(model, cache, logits, budget, stop_ids(loaded), feed_last=False)
    total = time.perf_counter() - start
    text = loaded.tokenizer.decode(out.tokens, skip_special_tokens=True)
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "prompt_tokens": len(tokens),
                    "new_tokens": len(out.tokens),
                    "ttft_s": ttft,
                    "total_s": total,
                    "model": loaded.name,
                    "dtype": args.dtype,
                }
            )
        )
    else:
        print(text)
    return 0


def cmd_bench_forward(args: argparse.Namespace) -> int:
    from kvcmas.experiments.forward_speed import measure_prefill
    from kvcmas.experiments.machine import machine_description

    lengths = tuple(int(x) for x in args.lengths.split(","))
    print(f"prefill throughput, model {args.model}, machine: {machine_description()}")
    rows = measure_prefill(args.model, lengths, tuple(args.dtypes.split(",")), args.repeats)
    if args.json:
        print(json.dumps(rows))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from kvcmas.experiments.engine_run import run_on_engine

        return run_on_engine(args)
    from kvcmas.eval.fidelity import FidelityObserver
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.methods import make_method
    from kvcmas.model.loader import load_model
    from kvcmas.workflow.runner import Runner, read_requests

    # Every input is checked before the model loads (a cold load takes most of a minute).
    workflow = load_workflow(args.workflow)
    requests = read_requests(args.requests) if args.requests else [{"query": args.question}]
    for i, r in enumerate(requests, 1):
        workflow.check_request(r, where=f"request {i}")
    method = make_method(args.method, method_options(args))
    loaded = load_model(args.model, args.dtype, args.device)
    observer = reference_runner = None
    if args.compare:
        same = args.reference_dtype == args.dtype
        reference = loaded if same else load_model(args.model, args.reference_dtype, args.device)
        observer = FidelityObserver(reference)
        reference_runner = Runner(reference, workflow, make_method("nonshared"))
    runner = Runner(loaded, workflow, method, observer=observer)
    for i, result in enumerate(runner.run_stream(requests)):
        if reference_runner is not None:  # NonShared's final answer on the reference model
            ref = reference_runner.run(requests[i])
            result.reference_final_answer = ref.final_answer
        if args.json:
            print(json.dumps(result.to_json()), flush=True)
        else:
            print_result_table(i, result)
    return 0


def print_result_table(i, result) -> None:
    print(f"request {result.request} [{result.method}]")
    cols = ["agent", "ttft_s", "latency_s", "prompt", "prefilled", "rho", "recompute", "decisions"]
    compare = result.hops[0].fidelity is not None
    if compare:
        cols += ["kv_err", "kl_first", "kl_cont", "same"]
    print("  " + "  ".join(f"{c:>10}" for c in cols))
    for h in result.hops:
        decisions = ",".join(s["decision"][0] for s in h.segments if s["kind"] != "private")
        row = [
            h.agent,
            f"{h.ttft_s:.3f}",
            f"{h.latency_s:.3f}",
            h.prompt_tokens,
            h.prefilled_tokens,
            "-" if h.rho is None else f"{h.rho:.2f}",
            "-" if h.recompute_fraction is None else f"{h.recompute_fraction:.2f}",
            decisions or "-",
        ]
        if compare:
            f = h.fidelity
            row += [
                f"{f['kv_rel_error']:.4f}",
                f"{f['first_token_kl']:.4f}",
                f"{f['continuation_kl']:.4f}",
                f["same_output"],
            ]
        print("  " + "  ".join(f"{str(c):>10}" for c in row))
    print(f"  final answer: {result.final_answer}")
    print(
        f"  request latency {result.latency_s:.3f} s, background {result.background_s:.3f} s, "
        f"compute {result.cpu_s:.3f} CPU s"
    )
    if result.reference_final_answer is not None:
        print(f"  same final answer as NonShared: {result.same_final_answer}")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvcmas.model.loader import resolve
    from kvcmas.serve.launch import (
        ServeConfig,
        check_method,
        check_port,
        check_sizes,
        check_vllm_args,
        serve,
    )

    # Every argument is checked before the model is resolved (a first use converts it).
    vllm_args = check_vllm_args(args.vllm_args)
    options = method_options(args)
    check_method(args.method, options)
    check_sizes(kv_cache_bytes=args.kv_cache_bytes, store_bytes=args.store_bytes,
                max_model_len=args.max_model_len, min_span=args.min_span,
                max_namespaces=args.max_namespaces, session_state_bytes=args.session_state_bytes,
                min_gain=args.min_gain)
    from kvcmas.serve.span_index import GRAM

    if args.min_span is not None and args.min_span < GRAM:
        raise UsageError(f"--min-span must be at least {GRAM} (the span index's token window)")
    if args.instances != 1:
        from kvcmas.serve.cluster import instance_cores, router_binary

        instance_cores(args.instances)
        router_binary()
    port = check_port(args.port, args.host)
    name, folder = resolve(args.model)
    cfg = ServeConfig(
        folder, name, args.method, args.dtype, args.host, port, args.kv_cache_bytes,
        args.store_bytes, args.max_model_len, options, args.min_span, args.max_namespaces,
        args.session_state_bytes, args.min_gain, args.sync_saves,
        background_saves=args.background_saves, vllm_args=vllm_args,
    )
    if args.instances != 1:
        from kvcmas.serve.cluster import serve_cluster

        return serve_cluster(cfg, args.instances)
    return serve(cfg)


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvcmas.eval.requests import load_requests
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.experiments.compare import compare, write_report
    from kvcmas.methods import METHODS

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UsageError(
            f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}"
        )
    workflow = load_workflow(args.workflow)
    requests = load_requests(args.requests, args.limit)
    for i, r in enumerate(requests, 1):
        workflow.check_request(r, where=f"request {i}")
    report = compare(
        args.model,
        args.dtype,
        workflow,
        requests,
        methods,
        method_options(args),
        noise_floor=not args.no_noise_floor,
        fidelity=not args.no_fidelity,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        device=args.device,
    )
    write_report(report, Path(args.out))
    print((Path(args.out) / "table.md").read_text())
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvcmas.eval.data import ALL_DATASETS, default_data_dir, prepare_datasets

    names = tuple(args.datasets.split(",")) if args.datasets else ALL_DATASETS
    unknown = [n for n in names if n not in ALL_DATASETS]
    if unknown:
        raise UsageError(
            f"unknown dataset(s) {', '.join(unknown)}: choose from {', '.join(ALL_DATASETS)}"
        )
    folder = Path(args.dir) if args.dir else default_data_dir()
    manifest = prepare_datasets(folder, names, progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(manifest, indent=1))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvcmas.experiments.demo import run_demo

    return run_demo(args.model, args.dtype, args.device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcmas", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one chat prompt with the model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None)
    add_model_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="the 4-agent roster with NonShared and KVCMAS side by side")
    add_model_args(d)
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="run requests through a multi-agent workflow")
    r.add_argument("--workflow", required=True, help="built-in name or a YAML/JSON file")
    r.add_argument("--method", required=True)
    q = r.add_mutually_exclusive_group(required=True)
    q.add_argument("--question")
    q.add_argument("--requests", help="JSONL file: one object per line with 'query' and inputs")
    add_model_args(r)
    r.add_argument(
        "--compare",
        action="store_true",
        help="measure every hop against NonShared's dense KV (fidelity)",
    )
    r.add_argument("--reference-dtype", default="fp32")
    r.add_argument("--json", action="store_true")
    r.add_argument("--engine", choices=("local", "vllm"), default="local",
                   help="vllm: send each hop to a `kvcmas serve` server (--base-url)")
    r.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="[--engine vllm]")
    r.add_argument("--namespace", default=None, help="kvcmas namespace (tenant) [--engine vllm]")
    add_method_args(r)
    r.set_defaults(func=cmd_run)

    from kvcmas.serve.launch import DEFAULT_KV_CACHE_BYTES, DEFAULT_STORE_BYTES
    from kvcmas.serve.params import (
        DEFAULT_MIN_GAIN,
        DEFAULT_NAMESPACES,
        DEFAULT_SESSION_STATE_BYTES,
    )

    s = sub.add_parser(
        "serve", help="vLLM's OpenAI server with the kvcmas connector",
        usage="kvcmas serve [options] [-- vLLM's own flags, passed through unchanged]",
    )  # fmt: skip
    add_model_args(s, device=False)  # the connector's runtime belongs on vLLM's device
    s.add_argument("--method", default="kvcmas", help="how the connector builds shared spans: "
                   "exact, fullshared, kvcmas, kvcomm, cacheblend, headrecompute (default "
                   "kvcmas, at its serving defaults, with the spans to build chosen from "
                   "costs measured on this server)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000,
                   help="0 picks a free port (with --instances: the router's)")
    s.add_argument("--instances", type=int, default=1,
                   help="N vLLM instances (cores split between them) behind vllm-router, "
                        "which keeps each session on one instance (X-Session-ID)")
    s.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES,
                   help="size of vLLM's paged KV cache")
    s.add_argument("--store-bytes", type=int, default=DEFAULT_STORE_BYTES,
                   help="bound of the connector's span store (saved sources)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--min-span", type=int, default=None,
                   help="shortest shared span the connector reuses, and shortest exact run "
                        "it copies alone, in tokens (default 32)")
    s.add_argument("--min-gain", type=float, default=None,
                   help="pin a fixed cost rule: build a shared span only if it serves at least "
                        "this many tokens per token the method recomputes of it (its repair "
                        "head; 0 builds every span). Default: no fixed rule; each claim is "
                        "chosen from the engine's and the connector's costs measured on this "
                        f"server (the fixed rule's old default was {DEFAULT_MIN_GAIN:g})")
    add_saves_args(s)
    s.add_argument("--max-namespaces", type=int, default=None,
                   help="namespaces (tenants) whose method state (anchor pools) the connector "
                        "keeps; the least recently used beyond it is dropped "
                        f"(default {DEFAULT_NAMESPACES})")
    s.add_argument("--session-state-bytes", type=int, default=None,
                   help="bound of what each method object keeps per session (non-chained "
                        "KVCMAS's and KVCOMM's reference prefills, GraphFlow's bases); beyond "
                        "it the least recently served sessions' are dropped and recomputed "
                        f"(default {DEFAULT_SESSION_STATE_BYTES >> 20} MiB)")
    add_method_args(s)
    s.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks and experiments")
    bsub = bench.add_subparsers(dest="experiment", required=True)
    f = bsub.add_parser("forward", help="prefill tokens/s: ours vs transformers")
    f.add_argument("--model", default=DEFAULT_MODEL)
    f.add_argument("--lengths", default="1024,4096")
    f.add_argument("--dtypes", default="fp32,bf16")
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_bench_forward)

    c = bsub.add_parser("compare", help="methods side by side on one request stream")
    c.add_argument("--workflow", default="roster")
    c.add_argument(
        "--requests", required=True, help="a JSONL file, or a dataset name (mmlu, gsm8k, humaneval)"
    )
    c.add_argument("--methods", default="nonshared,fullshared,kvcomm,kvcmas")
    c.add_argument("--limit", type=int, default=None)
    c.add_argument("--out", required=True)
    c.add_argument("--no-noise-floor", action="store_true", help="skip the NonShared-in-bf16 row")
    c.add_argument(
        "--no-fidelity",
        action="store_true",
        help="timing run: no fp32 reference per hop (KV error, KL left out)",
    )
    add_model_args(c)
    add_method_args(c)
    c.set_defaults(func=cmd_bench_compare)

    from kvcmas.experiments import register_all

    register_all(bsub)

    data = sub.add_parser("data", help="benchmark data")
    dsub = data.add_subparsers(dest="action", required=True)
    prep = dsub.add_parser("prepare", help="extract MMLU, GSM8K, HumanEval (+MBPP, ARC) offline")
    prep.add_argument("--dir", default=None, help="data folder (default: ./data or $KVCMAS_DATA)")
    prep.add_argument("--datasets", default=None, help="comma-separated names (default: all)")
    prep.set_defaults(func=cmd_data_prepare)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `kvcmas serve [ours] -- [vLLM's own flags]`: the rest goes to vLLM unchanged.
    passed: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, passed = argv[:at], argv[at + 1 :]
    args = build_parser().parse_args(argv)
    if passed and args.func is not cmd_serve:
        print("kvcmas: error: only 'kvcmas serve' passes flags after '--' (to vLLM)",
              file=sys.stderr)  # fmt: skip
        return 2
    args.vllm_args = passed
    for flag in ("dtype", "reference_dtype"):
        value = getattr(args, flag, None)
        if value is not None and value not in DTYPES:
            name = flag.replace("_", "-")
            print(
                f"kvcmas: error: unknown {name} {value!r} (choose {', '.join(DTYPES)})",
                file=sys.stderr,
            )
            return 2
    if getattr(args, "device", None) is not None:
        try:
            parse_device(args.device)  # before any model loads: a clear line, not a traceback
        except KvcmasError as e:
            print(f"kvcmas: error: --device: {e}", file=sys.stderr)
            return 2
    if getattr(args, "max_new_tokens", 1) < 1:
        print("kvcmas: error: --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (KvcmasError, FileNotFoundError) as e:
        print(f"kvcmas: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
