"""The ``kvcmas`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvcmas.model.loader import DEFAULT_MODEL, DTYPES


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kvcmas.chat import chat_segments
    from kvcmas.model.generate import greedy_decode, stop_ids
    from kvcmas.model.loader import load_model

    loaded = load_model(args.model, args.dtype)
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
    logits = model.prefill(torch.tensor(tokens), cache)
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
    from kvcmas.bench.forward_speed import machine_description, measure_prefill

    lengths = tuple(int(x) for x in args.lengths.split(","))
    print(f"prefill throughput, model {args.model}, machine: {machine_description()}")
    rows = measure_prefill(args.model, lengths, tuple(args.dtypes.split(",")), args.repeats)
    if args.json:
        print(json.dumps(rows))
    return 0


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

    bench = sub.add_parser("bench", help="benchmarks and experiments")
    bsub = bench.add_subparsers(dest="experiment", required=True)
    f = bsub.add_parser("forward", help="prefill tokens/s: ours vs transformers")
    f.add_argument("--model", default=DEFAULT_MODEL)
    f.add_argument("--lengths", default="1024,4096")
    f.add_argument("--dtypes", default="fp32,bf16")
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_bench_forward)
    return p


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="'smollm2-135m' (embedded default), a HF folder, or a .gguf file",
    )
    p.add_argument("--dtype", default="fp32", help=f"one of {', '.join(DTYPES)}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvcmas.model.config import UnsupportedModelError
    from kvcmas.model.loader import ModelLoadError

    if getattr(args, "dtype", None) is not None and args.dtype not in DTYPES:
        print(
            f"kvcmas: error: unknown dtype {args.dtype!r} (choose {', '.join(DTYPES)})",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "max_new_tokens", 1) < 1:
        print("kvcmas: error: --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (UsageError, ModelLoadError, UnsupportedModelError, FileNotFoundError) as e:
        print(f"kvcmas: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
