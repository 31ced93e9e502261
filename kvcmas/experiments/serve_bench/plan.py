"""What a serving run covers: the methods (one server each), sizes, loads, sessions and
bounds, and the capacities given instead of searched."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvcmas.errors import UsageError
from kvcmas.experiments.args import add_model_args, add_saves_args
from kvcmas.experiments.common import float_list, int_list, parse_list
from kvcmas.experiments.engine_run import PLAIN
from kvcmas.experiments.machine import serving_dtype
from kvcmas.methods.kvcmas import LONG_CONTEXT
from kvcmas.serve.launch import check_method, check_sizes


@dataclass(frozen=True)
class ServedMethod:
    """A bench method: the server's method and options, and the method its requests name
    (``None``: plain vLLM requests, without kvcmas params)."""

    name: str
    server_method: str
    request_method: str
    options: dict = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        return self.request_method == PLAIN


METHODS = {
    m.name: m
    for m in (
        # Plain vLLM with its prefix cache: requests carry no kvcmas params (the server's
        # connector never acts on them); the reference of every ratio and the capacity.
        ServedMethod("nonshared", "exact", PLAIN),
        ServedMethod("fullshared", "fullshared", "fullshared"),
        # KVCMAS as `kvcmas serve` runs it with no options: its serving defaults (the
        # long-context point) and claims chosen from measured costs.
        ServedMethod("kvcmas", "kvcmas", "kvcmas"),
        # Non-chained: each span's base is a context-free reference prefill, as KVCOMM's.
        ServedMethod("kvcmas-nochain", "kvcmas", "kvcmas", {**LONG_CONTEXT, "chain": False}),
        ServedMethod("kvcomm", "kvcomm", "kvcomm"),  # its own V = 20
        # KVCOMM at KVCMAS's V = 10: anchor-pool bytes compared at equal V.
        ServedMethod("kvcomm-v10", "kvcomm", "kvcomm", {"pool_size": 10}),
        ServedMethod("cacheblend", "cacheblend", "cacheblend"),
        ServedMethod("headrecompute", "headrecompute", "headrecompute"),
        ServedMethod("graphflow", "graphflow", "graphflow"),
    )
}
BASELINE = "nonshared"
# The small grid, which finishes within an hour on 2 cores with bf16 GEMMs: plain vLLM against
# KVCMAS, the comparison the serving targets state. Every other method is a `--methods` part.
DEFAULT_METHODS = [BASELINE, "kvcmas"]
# Bounds sized for the default grid's workload (40 sessions of 128-token outputs over documents
# of up to 2K tokens, loads up to 1.0): the KV cache and span store hold every session in
# flight, per-session state holds non-chained KVCMAS's references, and a cell's last sessions
# finish within the drain. `kvcmas serve` keeps its own, smaller defaults.
BENCH_KV_CACHE_BYTES = 2 << 30
BENCH_STORE_BYTES = 4 << 30
BENCH_SESSION_STATE_BYTES = 4 << 30
BENCH_CELL_TIME_S = 600.0
BENCH_DRAIN_S = 200.0


def method_order(names: list[str]) -> list[str]:
    """Plain vLLM first: its capacity sets every other method's rates."""
    return sorted(dict.fromkeys(names), key=lambda m: m != BASELINE)


def parse_capacity(text: str) -> dict[int, float]:
    """``--capacity 512=0.4,2048=0.1``: plain vLLM's capacity (sessions/s) per size."""
    out = {}
    for item in parse_list(text):
        size, _, rate = item.partition("=")
        try:
            out[int(size)] = float(rate)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--capacity {text!r}: expected S=sessions_per_s, got {item!r}"
            ) from None
        if out[int(size)] <= 0:
            raise argparse.ArgumentTypeError(f"--capacity {item}: a rate must be positive")
    return out


def parse_options(text: str) -> tuple[str, dict[str, str]]:
    """``--options kvcmas:tau=0.5,ratio=0.1``: options of one bench method's server."""
    name, _, rest = text.partition(":")
    if name not in METHODS:
        raise argparse.ArgumentTypeError(
            f"--options {text!r}: unknown method {name!r} (from {', '.join(METHODS)})"
        )
    options = {}
    for item in parse_list(rest) if rest else []:
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"--options {text!r}: expected key=value: {item!r}")
        options[key] = value
    return name, options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=[512, 2048], help="document tokens S")
    p.add_argument(
        "--loads",
        type=float_list,
        default=[0.5, 1.0],
        help="arrival rates as multiples of plain vLLM's capacity at each S (0: sessions "
             "one at a time, each sent as the one before ends; no capacity search)",
    )
    p.add_argument(
        "--methods",
        type=lambda t: parse_list(t, str, list(METHODS)),
        default=DEFAULT_METHODS,
        help=f"comma-separated, from {', '.join(METHODS)} (one server each; default: "
        f"{','.join(DEFAULT_METHODS)})",
    )
    p.add_argument(
        "--sessions", "--max-sessions", type=int, default=40, help="sessions sent per cell"
    )
    p.add_argument("--output-tokens", type=int, default=128, help="tokens per agent output")
    p.add_argument("--warmup", type=int, default=2, help="sequential sessions first, per S")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument(
        "--capacity",
        type=parse_capacity,
        default={},
        help="S=sessions_per_s,...: plain vLLM's capacity, given instead of searched",
    )
    p.add_argument("--idle-sessions", type=int, default=3, help="sequential, for idle TTFT")
    p.add_argument("--probe-sessions", type=int, default=8,
                   help="fewest sessions per capacity probe")
    p.add_argument("--probe-max-sessions", type=int, default=40,
                   help="most sessions per capacity probe")
    p.add_argument("--probe-s", type=float, default=None,
                   help="seconds of arrivals per capacity probe (default: 3 idle sessions' "
                        "latency)")
    p.add_argument("--search-probes", type=int, default=6, help="probes of a capacity search")
    p.add_argument(
        "--cell-time-s", type=float, default=BENCH_CELL_TIME_S,
        help="a cell stops sending after this",
    )
    p.add_argument(
        "--drain-s", type=float, default=BENCH_DRAIN_S,
        help="then waits this long before cancelling",
    )
    p.add_argument(
        "--options",
        type=parse_options,
        action="append",
        default=[],
        help="METHOD:key=value,... options of that method's server (repeatable)",
    )
    p.add_argument("--kv-cache-bytes", type=int, default=BENCH_KV_CACHE_BYTES,
                   help="vLLM's KV cache (per instance)")
    p.add_argument("--store-bytes", type=int, default=BENCH_STORE_BYTES,
                   help="bound of the connector's span store (per instance): at long S it "
                        "must hold the sources of every session in flight")
    p.add_argument("--session-state-bytes", type=int, default=BENCH_SESSION_STATE_BYTES,
                   help="bound of a method's per-session state (reference prefills, bases; "
                        "per instance): to keep it, hold every session in flight")
    p.add_argument(
        "--instances", type=int, default=1,
        help="N servers per method (the cores split between them) behind vllm-router, "
             "each session kept on one (`kvcmas serve --instances N`)",
    )  # fmt: skip
    p.add_argument("--min-gain", type=float, default=None,
                   help="pin the connector's fixed cost rule (`kvcmas serve --min-gain`; "
                        "default: claims chosen from measured costs)")
    add_saves_args(p)
    p.add_argument("--agents", type=int, default=4, help="chain length of the trace")
    p.add_argument("--source", default="mmlu", help="dataset whose questions make documents")
    p.add_argument("--out", required=True)
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="merge these runs' results.json into --out (runs nothing; the runs "
                        "must share the trace and, at each S, plain vLLM's capacity)")  # fmt: skip
    add_model_args(p, device=False)
    # Timing in what a user would serve in on this CPU (bf16 only where it has bf16 GEMMs).
    p.set_defaults(dtype=serving_dtype())


def check_args(args: argparse.Namespace) -> None:
    """Everything checkable before a model is resolved or a server started."""
    if args.sessions < 1 or args.output_tokens < 1 or args.warmup < 0:
        raise UsageError("need --sessions >= 1, --output-tokens >= 1 and --warmup >= 0")
    if args.idle_sessions < 1 or args.probe_sessions < 1 or args.search_probes < 1:
        raise UsageError("need --idle-sessions, --probe-sessions and --search-probes >= 1")
    if args.probe_max_sessions < args.probe_sessions:
        raise UsageError("need --probe-max-sessions >= --probe-sessions")
    if args.probe_s is not None and not args.probe_s > 0:
        raise UsageError(f"--probe-s must be positive, got {args.probe_s}")
    check_sizes(kv_cache_bytes=args.kv_cache_bytes, store_bytes=args.store_bytes,
                session_state_bytes=args.session_state_bytes, min_gain=args.min_gain)
    if args.cell_time_s <= 0 or args.drain_s < 0:
        raise UsageError("need --cell-time-s > 0 and --drain-s >= 0")
    if args.instances != 1:
        from kvcmas.serve.cluster import instance_cores, router_binary

        instance_cores(args.instances)
        router_binary()
    if any(s < 1 for s in args.sizes) or any(x < 0 for x in args.loads):
        raise UsageError("sizes must be positive token counts and loads multiples >= 0 "
                         "(0: sessions one at a time)")
    extra = sorted(set(args.capacity) - set(args.sizes))
    if extra:
        raise UsageError(f"--capacity names sizes not in --sizes: {extra}")
    for name, options in args.options:
        check_method(METHODS[name].server_method, {**METHODS[name].options, **options})


def served_methods(args: argparse.Namespace) -> list[ServedMethod]:
    """The methods in run order, each with its server's options (``--options`` added)."""
    extra: dict[str, dict] = {}
    for name, options in args.options:
        extra.setdefault(name, {}).update(options)
    out = []
    for name in method_order(args.methods):
        m = METHODS[name]
        out.append(ServedMethod(m.name, m.server_method, m.request_method,
                                {**m.options, **extra.get(name, {})}))  # fmt: skip
    return out
