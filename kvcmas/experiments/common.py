"""Helpers shared by the experiments: progress, setup lines, output files, plots, runs.

Per-method figures that need a fidelity reference come from :mod:`kvcmas.experiments.compare`
(``summarize``); :func:`speed_summary` covers the reference-free speed runs (TTFT, reuse, state
bytes, RSS), where no fp32 reference is computed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvcmas.experiments.forward_speed import machine_description
from kvcmas.methods.base import Method
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow


class Progress:
    """Progress lines on stderr, each stamped with the seconds since the experiment began."""

    def __init__(self, name: str, stream=None):
        self.name = name
        self.start = time.perf_counter()
        self.stream = stream or sys.stderr

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{self.name} {elapsed:6.0f}s] {message}", file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    # A child process (see ``in_child``) gets the name and start, and logs to its own stderr;
    # perf_counter is system-wide on Linux, so its stamps continue the parent's.
    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "start": self.start}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, stream=sys.stderr)


def parse_list(text: str, kind: Callable[[str], Any] = int) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]``; an empty item is an error."""
    items = [t.strip() for t in str(text).split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"empty item in list {text!r}")
    try:
        return [kind(t) for t in items]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: {e}") from None


def int_list(text: str) -> list[int]:
    return parse_list(text, int)


def float_list(text: str) -> list[float]:
    return parse_list(text, float)


def str_list(text: str) -> list[str]:
    return parse_list(text, str)


def rank_list(text: str) -> list[int | None]:
    """Ranks; ``full`` (or 0) means full dimension (``None``)."""
    return parse_list(text, lambda t: None if t in ("full", "0") else int(t))


def setup(loaded: LoadedModel, dtype: str, **sizes: Any) -> dict[str, Any]:
    """What every results.json and table states: model, dtype, sizes and machine."""
    import torch

    return {
        "model": loaded.name,
        "dtype": dtype,
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, {machine_description()}",
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **sizes,
    }


def cpu_name() -> str:
    """The CPU model (Linux ``/proc/cpuinfo``), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def setup_lines(s: dict[str, Any]) -> list[str]:
    """Markdown lines stating the setup of a results dict (model, dtype, sizes, machine)."""
    fixed = ("model", "dtype", "machine", "torch_threads", "python", "torch")
    sizes = ", ".join(f"{k} {fmt_value(v)}" for k, v in s.items() if k not in fixed)
    return [
        f"Model {s['model']} ({s['dtype']}); machine {s['machine']}; torch {s['torch']}.",
        "",
        f"Sizes: {sizes}." if sizes else "",
    ]


def fmt_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(fmt_value(x) for x in v)
    if v is None:
        return "full"
    return str(v)


def write_results(out: Path, results: dict[str, Any], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "table.md").write_text(table)


def finish(out_dir, results: dict[str, Any], log, markdown: Callable, plot: Callable) -> int:
    """The common end of an experiment: stamp wall time, write JSON, table and plots, print."""
    results["wall_s"] = log.elapsed
    out = Path(out_dir)
    write_results(out, results, markdown(results))
    plot(results, out)
    log(f"wrote {out}/results.json, table.md and plots")
    print(markdown(results))
    return 0


def mean(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


# --- runs ------------------------------------------------------------------------------------


def trace_runner(
    loaded: LoadedModel, workflow: Workflow, method: Method, ignore_eos: bool = False
) -> Runner:
    """A Runner; with ``ignore_eos`` every agent generates exactly its ``max_new_tokens``.

    Like vLLM's ``ignore_eos``: the stop set is emptied, so an end-of-turn token the model
    chooses is kept as an ordinary output token and generation goes on (controlled traces).
    """
    runner = Runner(loaded, workflow, method)
    if ignore_eos:
        runner.stop = set()
    return runner


def run_stream(
    runner: Runner, requests: Sequence[dict], log: Callable[[str], None], label: str
) -> list[RequestResult]:
    start = time.perf_counter()
    out = []
    for i, result in enumerate(runner.run_stream(requests)):
        out.append(result)
        log(f"{label}: request {i + 1}/{len(requests)} ({time.perf_counter() - start:.0f}s)")
    return out


def speed_summary(results: list[RequestResult]) -> dict[str, Any]:
    """Reference-free figures of a run: non-first-hop TTFT, reuse, output lengths, memory."""
    hops = [h for r in results for h in r.hops]
    later = [h for r in results for h in r.hops[1:]]
    segs = [s for h in later for s in h.segments if s["kind"] != "private"]
    shared = sum(s["length"] for s in segs)
    per_agent: dict[str, list[float]] = {}
    for h in later:
        per_agent.setdefault(h.agent, []).append(h.ttft_s)
    outputs = [h.output_tokens for h in hops]
    return {
        "requests": len(results),
        "hops": len(hops),
        "ttft_nonfirst_mean_s": mean(h.ttft_s for h in later),
        "ttft_nonfirst_median_s": statistics.median(h.ttft_s for h in later) if later else None,
        "ttft_per_agent_s": {a: mean(v) for a, v in per_agent.items()},
        "ttft_first_mean_s": mean(r.hops[0].ttft_s for r in results),
        "latency_request_mean_s": mean(sum(h.latency_s for h in r.hops) for r in results),
        "reuse_ratio_tokens": sum(s["length"] for s in segs if s["decision"] != "dense")
        / max(shared, 1),
        "reuse_ratio_calls": sum(s["decision"] != "dense" for s in segs) / max(len(segs), 1),
        "prompt_tokens_nonfirst_mean": mean(h.prompt_tokens for h in later),
        "output_tokens": {"min": min(outputs), "max": max(outputs), "mean": mean(outputs)},
        "peak_state_bytes": max(h.kv_bytes + h.source_bytes + h.method_state_bytes for h in hops),
        "method_state_bytes": hops[-1].method_state_bytes,
        "peak_rss_bytes": max(h.peak_rss_bytes for h in hops),
    }


def in_child(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a fresh child process, so that its peak RSS is the run's own high-water
    mark; ``fn`` must be a module-level function and the arguments and result picklable.

    The child is spawned, not forked: a fork taken while torch's OpenMP threads exist can
    deadlock in the child (seen: a context-sweep child asleep on a futex for minutes).
    """
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, fn, args))
    child.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:
        ok, value = False, "the child process died without an answer (out of memory?)"
    child.join()
    if not ok:
        raise RuntimeError(f"experiment run failed in its child process:\n{value}")
    return value


def _child_main(send, fn: Callable[..., Any], args: tuple) -> None:
    import traceback

    try:
        result = (True, fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        result = (False, traceback.format_exc())
    send.send(result)
    send.close()


# --- plots -----------------------------------------------------------------------------------


def line_plot(
    path: Path,
    series: dict[str, tuple[Sequence[float], Sequence[float | None]]],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
) -> None:
    """One line per label; ``None`` values are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o" if len(pts) <= 16 else None, label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
