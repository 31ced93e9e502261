"""The serving benchmark's markdown table and plots (from results.json alone)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcmas.experiments.cells import fmt
from kvcmas.experiments.plots import line_panels
from kvcmas.experiments.serve_bench.plan import BASELINE

MIB = 1 << 20
CHAINED = ("kvcmas", "kvcmas-nochain")


def _dist(d: dict[str, Any], p99: bool = False) -> str:
    cells = [fmt(d["p50"], ".3f"), fmt(d["p95"], ".3f")]
    if p99 and d.get("p99") is not None:
        cells.append(fmt(d["p99"], ".3f"))
    return " / ".join(cells)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _cell(results: dict[str, Any], method: str, size: int, load: float) -> dict | None:
    return next((c for c in results["cells"] if (c["method"], c["size"], c["load"])
                 == (method, size, load)), None)  # fmt: skip


def _later_p50(c: dict[str, Any]) -> float | None:
    return c["ttft_later_s"]["p50"]


def _itl_p50(c: dict[str, Any]) -> float | None:
    return (c.get("itl_s") or {}).get("p50")  # runs from before it was measured have none


def _itl(c: dict[str, Any]) -> str:
    return _dist(c["itl_s"]) if c.get("itl_s") else "-"


def _server_cpu(c: dict[str, Any]) -> float | None:
    return (c.get("compute") or {}).get("server_cpu_s")  # runs before it was measured: None


def _ratio(
    results: dict[str, Any],
    c: dict[str, Any],
    value: Callable[[dict[str, Any]], float | None] = _later_p50,
) -> str:
    """``value`` of the cell over plain vLLM's in the same (S, load) cell."""
    base = _cell(results, BASELINE, c["size"], c["load"])
    if base is not None and base.get("part") != c.get("part"):
        base = None  # merged runs: ratios only within one run (runs differ from run to run)
    mine = value(c)
    theirs = value(base) if base else None
    return "-" if mine is None or not theirs else f"{mine / theirs:.2f}"


def capacity_lines(results: dict[str, Any]) -> list[str]:
    lines = [
        "## Plain vLLM's capacity", "",
        "The highest session arrival rate at which plain vLLM's p50 TTFT (all hops) stays within "
        "2x its idle TTFT (sequential sessions); probes: rate in sessions/s, p50 TTFT, pass (+) "
        "or fail (x).", "",
        "| S | idle TTFT p50 (s) | limit (s) | capacity (sessions/s) | probes |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for size, c in sorted(results["capacity"].items(), key=lambda kv: int(kv[0])):
        if c["given"]:
            lines.append(f"| {size} | - | - | {c['capacity_per_s']:.4f} (given) | - |")
            continue
        probes = ", ".join(
            f"{p['rate_per_s']:.3f}: {fmt(p['p50_ttft_s'], '.3f')} {'+' if p['passed'] else 'x'}"
            for p in c["probes"]
        )
        note = "" if c["found"] else " (none passed: lowest probed)"
        if c["found"] and c["failed_at_per_s"] is None:
            note = " (every probe passed: at least)"
        lines.append(f"| {size} | {c['idle_ttft_s']:.3f} | {c['threshold_s']:.3f} | "
                     f"{c['capacity_per_s']:.4f}{note} | {probes} |")  # fmt: skip
    return lines + [""]


KVCOMM_SERVERS = ("kvcomm-v10", "kvcomm")  # the references of the pool-bytes ratio
REFERENCE_V = (10, 20)  # by the V a KVCOMM server ran with, whatever its name


def _per_token(report: dict[str, Any]) -> float | None:
    return report["pool_bytes"] / report["anchor_tokens"] if report["anchor_tokens"] else None


def pool_lines(results: dict[str, Any]) -> list[str]:
    """Each pooled method's anchor pools after its cells at S, and its bytes per anchor token
    against KVCOMM's at V = 10 and V = 20 (pool bytes at equal V and S scale with this)."""
    reports = results.get("pools") or []
    if not reports:
        return []
    refs = {
        (r["pool_size"], r["size"]): _per_token(r) for r in reports if r["method"] in KVCOMM_SERVERS
    }
    heads = " | ".join(f"KVCOMM V={v} / this, per anchor token" for v in REFERENCE_V)
    lines = [
        "", "## Anchor pools", "",
        "After a method's cells at S, its namespace's pools: one per (producer slot, consumer "
        "agent), each holding at most V anchors; bytes are measured, fp32; 'full width' is the "
        "analytic size of the same anchors kept as full K and V base and delta (KVCOMM's form); "
        "the ratios divide KVCOMM's bytes per anchor token by this method's (at equal V and S, "
        "full pools' bytes are in this ratio). The span store is reported separately above.", "",
        f"| method | S | V | pools | anchors (largest pool) | anchor tokens | MiB | full width "
        f"MiB | bytes per anchor token | {heads} |",
        "|" + "---|" * 11,
    ]  # fmt: skip
    for r in reports:
        mine = _per_token(r)
        ratios = [
            "-" if mine is None or refs.get((v, r["size"])) is None
            else f"{refs[(v, r['size'])] / mine:.2f}"
            for v in REFERENCE_V
        ]
        lines.append(
            f"| {r['method']} | {r['size']} | {r['pool_size']} | {r['pools']} | {r['anchors']} "
            f"({r['largest_pool']}) | {r['anchor_tokens']} | {_mib(r['pool_bytes'])} | "
            f"{_mib(r['analytic_full_bytes'])} | {fmt(mine, '.0f')} | {' | '.join(ratios)} |"
        )
    return lines


def part_lines(parts: list[dict[str, Any]]) -> list[str]:
    """A merged report's runs: what each covered and the settings it chose for itself."""
    lines = [
        "## Parts", "",
        "Runs merged into this report (`kvcmas bench serve --merge`); a cell's ratios to plain "
        "vLLM use plain vLLM's cell from the same run only ('-' where that run had none).", "",
        "| part | run | S | loads | methods | sessions | warm-up | cell time / drain (s) | KV "
        "cache / store (MiB) | wall (min) |",
        "|" + "---|" * 10,
    ]  # fmt: skip
    for p in parts:
        wall = "-" if p.get("wall_s") is None else f"{p['wall_s'] / 60:.0f}"
        store = "-" if p.get("store_bytes") is None else f"{p['store_bytes'] / MIB:.0f}"
        lines.append(
            f"| {p['part']} | {p['dir']} | {', '.join(map(str, p['sizes']))} | "
            f"{', '.join(f'{x:g}' for x in p['loads'])} | {', '.join(p['methods'])} | "
            f"{p['sessions']} | {p['warmup']} | {p['cell_time_s']:g} / {p['drain_s']:g} | "
            f"{p['kv_cache_bytes'] / MIB:.0f} / {store} | {wall} |"
        )
    machines = list(dict.fromkeys(p["machine"] for p in parts))
    return lines + ["", f"Machines: {'; '.join(machines)}.", ""]


def markdown(results: dict[str, Any]) -> str:
    s = results["setup"]
    p99 = any(c["ttft_later_s"]["p99"] is not None for c in results["cells"])
    later = "p50 / p95 / p99" if p99 else "p50 / p95"
    merged = "parts" in s

    def each(key: str, show: Callable[[Any], str] = str, differs: str = "per part (below)") -> str:
        return differs if s.get(key) is None else show(s[key])

    lines = [
        "# Serving under load (kvcmas bench serve)", "",
        f"Model {s['model']} ({s['dtype']}), {s['engine']}, KV cache "
        f"{each('kv_cache_bytes', lambda b: f'{b / MIB:.0f} MiB')}"
        + (f", span store bound {each('store_bytes', lambda b: f'{b / MIB:.0f} MiB')}"
           if "store_bytes" in s else "")
        + f"; machine {each('machine')}.", "",
        f"Trace {s['workflow']}: a chain of {s['agents']} agents, each reading a document of S "
        f"tokens ({s['source']}) and every earlier output, {s['output_tokens']} output tokens "
        f"each (ignore_eos). S: {', '.join(map(str, s['sizes']))}. Up to {each('sessions')} "
        f"sessions per cell arrive by a Poisson process (seed {each('seed')}) at load x plain "
        f"vLLM's capacity (rates below); a cell stops sending after "
        f"{each('cell_time_s', lambda x: f'{x:g} s', 'its time limit (per part, below)')}. "
        f"One server per method; warm-up sessions per S: {each('warmup')}. TTFT is the client's "
        "(request sent to first streamed token), in seconds; 'vs plain' is hops 2+ p50 over "
        "plain vLLM's (nonshared) in the same cell; rho and recompute are over hops 2+. "
        "ITL: the gaps between streamed tokens of every hop (decode stalls). "
        "Server CPU: user + system seconds of the server's processes (API server, engine core, "
        "router) over the whole cell, and that over plain vLLM's in the same cell (the same "
        "sessions are sent to both: compare where both completed them all). "
        "Memory (MiB): vLLM's KV blocks in use at the cell's peak; the connector's span store "
        "and the method's state (anchor pools, KVCMAS's reused matching buffers, and "
        "per-session reference prefills or bases, "
        "bounded by the connector's session_state_bytes) at the cell's peak less what they "
        "held before this S began (each S has its own namespace; the store is an LRU bounded "
        "by the server's --store-bytes, so past its bound it evicts earlier sessions instead "
        "of growing).", "",
    ]  # fmt: skip
    if merged:
        lines += part_lines(s["parts"])
    lines += capacity_lines(results)
    lines += [
        "## Cells", "",
        f"| method | S | load | rate/s | sessions done/sent | TTFT hop 1 p50 / p95 | TTFT hops 2+ "
        f"{later} | vs plain | session p50 / p95 | ITL p50 / p95 | ITL vs plain | "
        "sessions/s | tokens/s | server CPU s "
        "| CPU vs plain | rho | recompute | KV peak | store | method state |"
        + (" part |" if merged else ""),
        "|" + "---|" * (21 if merged else 20),
    ]  # fmt: skip
    for c in results["cells"]:
        m = c["memory"]
        lines.append(
            f"| {c['method']} | {c['size']} | {c['load']:g} | {c['rate_per_s']:.3f} | "
            f"{c['sessions_completed']}/{c['sessions_launched']} | {_dist(c['ttft_first_s'])} | "
            f"{_dist(c['ttft_later_s'], p99)} | {_ratio(results, c)} | "
            f"{_dist(c['session_latency_s'])} | {_itl(c)} | {_ratio(results, c, _itl_p50)} | "
            f"{fmt(c['sessions_per_s'], '.3f')} | "
            f"{fmt(c['output_tokens_per_s'], '.1f')} | {fmt(_server_cpu(c), '.1f')} | "
            f"{_ratio(results, c, _server_cpu)} | {fmt(c['rho_later'], '.2f')} | "
            f"{fmt(c['recompute_later'], '.2f')} | {_mib(m.get('kv_cache_peak_bytes'))} | "
            f"{_mib(m.get('store_bytes_this_size'))} | "
            f"{_mib(m.get('method_state_bytes_this_size'))} |"
            + (f" {c['part']} |" if merged else "")
        )
    lines += pool_lines(results)
    unlogged = sum(c["unlogged_hops"] for c in results["cells"])
    failed = sum(c["sessions_failed"] for c in results["cells"])
    lines += [
        "",
        f"Hops whose connector record the client did not find: {unlogged}; failed sessions: "
        f"{failed}. Server counters at the end: {results['server']}.",
        "",
    ]
    return "\n".join(lines)


def plot_load(results: dict[str, Any]) -> float:
    """The load the per-size plots use: of the loads run at every S (merged runs need not
    share them), 1.0 if there, else the highest; failing any, the highest load run."""
    at_size = [{c["load"] for c in results["cells"] if c["size"] == size}
               for size in results["setup"]["sizes"]]  # fmt: skip
    common = set.intersection(*at_size) if at_size else set()
    loads = common or set(results["setup"]["loads"])
    return 1.0 if 1.0 in loads else max(loads)


def _series(results, methods, xs_of, y_of, fixed) -> dict:
    out = {}
    for m in methods:
        xs, ys = [], []
        for x in xs_of:
            c = _cell(results, m, *fixed(x))
            xs.append(x)
            ys.append(None if c is None else y_of(c))
        out[m] = (xs, ys)
    return out


def plot(results: dict[str, Any], out: Path) -> None:
    """TTFT p50 (hops 2+) against load per S; TTFT and session latency against S at one load;
    chained against non-chained KVCMAS; memory against S."""
    s = results["setup"]
    methods = list(dict.fromkeys(c["method"] for c in results["cells"]))
    if not methods:
        return
    sizes, loads = s["sizes"], s["loads"]
    title = f"{s['model']} ({s['dtype']}) on vLLM, {s['workflow']}, {s['output_tokens']} tokens"
    out.mkdir(parents=True, exist_ok=True)

    def later(c):
        return c["ttft_later_s"]["p50"]

    def per_size(names):
        return [
            (f"S={size}: TTFT p50, hops 2+ (s)",
             _series(results, names, loads, later, lambda x, size=size: (size, x)))
            for size in sizes
        ]  # fmt: skip

    line_panels(out / "ttft_vs_load.png", per_size(methods), "load (x plain vLLM's capacity)",
                title)  # fmt: skip
    load = plot_load(results)

    def at(x):
        return (x, load)

    line_panels(
        out / "ttft_vs_size.png",
        [("TTFT p50, hops 2+ (s)", _series(results, methods, sizes, later, at)),
         ("TTFT p50, hop 1 (s)",
          _series(results, methods, sizes, lambda c: c["ttft_first_s"]["p50"], at)),
         ("session latency p50 (s)",
          _series(results, methods, sizes, lambda c: c["session_latency_s"]["p50"], at))],
        "S (document tokens)", f"{title}; load {load:g}", logx=True,
    )  # fmt: skip
    if all(m in methods for m in CHAINED):  # one of the two alone would repeat ttft_vs_load
        line_panels(
            out / "chained_vs_nonchained.png",
            per_size([m for m in (BASELINE, *CHAINED) if m in methods]),
            "load (x plain vLLM's capacity)",
            f"{title}: KVCMAS chained vs not",
        )

    def mib(key):
        def value(c):
            v = c["memory"].get(key)
            return None if v is None else v / MIB

        return value

    line_panels(
        out / "memory_vs_size.png",
        [(f"{label} (MiB)", _series(results, methods, sizes, mib(key), at))
         for key, label in (("kv_cache_peak_bytes", "vLLM KV cache in use, peak"),
                            ("store_bytes_this_size", "span store, peak added at S"),
                            ("method_state_bytes_this_size", "method state, peak added at S"))],
        "S (document tokens)", f"{title}; load {load:g}", logx=True,
    )  # fmt: skip
