"""Calibration and ablation run KVCMAS online, as it runs live: gate, pools, eviction, chained
sources, every figure from the one summary. Tiny random-weight Llama with the real tokenizer
(milliseconds per hop); one end-to-end CLI run on a tiny model saved as a folder."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvcmas.errors import UsageError
from kvcmas.experiments import ablation
from kvcmas.experiments.ablation import plan as ablation_plan
from kvcmas.experiments.ablation import report as ablation_report
from kvcmas.experiments.ablation import runs as ablation_runs
from kvcmas.experiments.calibrate import plan as cal_plan
from kvcmas.experiments.calibrate import report as cal_report
from kvcmas.experiments.calibrate.runs import OnlineRuns, reused_error_vs_fullshared, run_grid
from kvcmas.methods.anchors import PoolConfig
from kvcmas.methods.kvcmas import DEFAULT_TAU, DEFAULT_TEMPERATURE, KVCMASConfig
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.builtin import roster
from tests.conftest import tiny_loaded

PNG = b"\x89PNG\r\n\x1a\n"
REQUESTS = [{"id": f"q{i}", "query": f"What is {i} plus {i + 3}? Give a number."} for i in range(4)]


@pytest.fixture(scope="module")
def tiny() -> tuple[LoadedModel, object]:
    """A tiny random Llama with the default model's tokenizer (and chat template)."""
    torch.set_num_threads(1)  # a loaded 2-core machine: one thread is the fast setting
    return tiny_loaded()


@pytest.fixture(scope="module")
def runs(tiny) -> OnlineRuns:
    loaded, _ = tiny
    workflow = roster(task_tokens=4, final_tokens=4)
    return OnlineRuns(loaded, loaded, workflow, REQUESTS)


def shared_segments(results, later_only: bool = True):
    for r in results:
        for h in r.hops[1:] if later_only else r.hops:
            yield from (s for s in h.segments if s["kind"] != "private")


def options(**kw):
    return {"rank": 8, "temperature": DEFAULT_TEMPERATURE, **kw}


# --- the gate and the pools, online -----------------------------------------------------------


def test_tau_zero_reuses_nothing_and_the_pool_never_exceeds_v(runs):
    s = runs.summary("tau0", "kvcmas", **options(tau=0.0, pool_size=2))
    assert s["rho_all"] == 0.0 and s["recompute_all"] == 1.0
    assert s["reused_segments"] == 0 and s["error_ratio"] is None
    pools = runs.methods["tau0"].pools.values()
    # Every dense fallback records an anchor: 4 requests, 4 anchors per edge, 2 kept.
    assert max(p.steps for p in pools) == len(REQUESTS)
    assert max(len(p.anchors) for p in pools) == 2 == s["pool_anchors_max"]


def test_tau_above_one_reuses_every_matched_segment_once_min_anchors_exist(runs):
    s = runs.summary("tau>1", "kvcmas", **options(tau=1.01))
    decisions = []
    for seg in shared_segments(runs.results["tau>1"]):
        if "anchors" not in seg.get("details", {}):
            continue  # a first consumer: no source, dense, nothing learned
        enough = seg["details"]["anchors"] >= KVCMASConfig().min_anchors
        decisions.append(seg["decision"])
        assert (seg["decision"] == "reuse") == enough, seg
    assert "reuse" in decisions and "dense" in decisions  # the pools filled, then reuse began
    assert s["reuse_share_of_matched"] == 1.0
    # Anchors come only from dense fallbacks: none after the pools reach min_anchors.
    assert {len(p.anchors) for p in runs.methods["tau>1"].pools.values()} == {2}
    # KVCMAS reuses a segment in every layer or prefills it: rho and recompute add up to 1.
    assert s["rho_later"] + s["recompute_later"] == pytest.approx(1.0)
    assert 0 < s["rho_later"] < 1 and s["error_ratio"] is not None


def test_reused_error_is_paired_with_fullshared_on_the_same_segments(runs):
    full, dense = runs.run("fullshared", "fullshared"), runs.run("nonshared", "nonshared")
    same = reused_error_vs_fullshared(full, full)
    assert same["error_ratio"] == pytest.approx(1.0)
    assert same["reused_segments"] == sum(
        s["decision"] != "dense" for s in shared_segments(full, later_only=False)
    )
    assert reused_error_vs_fullshared(dense, full)["reused_segments"] == 0


def test_grid_points_each_carry_rho_recompute_and_costs(runs):
    plan = cal_plan.Plan(
        (cal_plan.GridPoint(0.2, 8, 1.01), cal_plan.GridPoint(0.2, None, 0.0)), limit=4
    )
    rows = run_grid(runs, plan)
    assert [(r["rank"], r["tau"]) for r in rows] == [(8, 1.01), (None, 0.0)]
    for r in rows:
        for key in ("rho_all", "rho_later", "recompute_all", "recompute_later"):
            assert 0.0 <= r[key] <= 1.0, key
        for key in (
            "ttft_later_ratio",
            "latency_ratio",
            "compute_ratio",
            "first_token_kl_all_mean",
        ):
            assert r[key] is not None, key
    assert rows[0]["rho_later"] > 0 and rows[1]["rho_later"] == 0
    assert rows[0]["options"]["rank"] == 8 and rows[1]["options"]["rank"] == 0  # 0: full
    base = runs.baseline_summaries()
    assert base["nonshared"]["rho_all"] == 0 and base["nonshared"]["recompute_all"] == 1
    assert base["fullshared"]["rho_later"] == 1 and base["fullshared"]["recompute_later"] == 0
    assert base["nonshared"]["ttft_later_ratio"] == 1.0
    results = {
        "setup": {"model": "tiny", "dtype": "fp32", "machine": "cpu", "torch": "2",
                  "workflow": "roster", "requests": "x", "split": "validation", "limit": 4},
        "grid": rows,
        "baselines": base,
    }  # fmt: skip
    md = cal_report.markdown(results)
    assert md.count("\n| T=0.2 r=") == 2 and "| T=0.2 r=full tau=0.0 | 0.00 / 0.00 |" in md
    assert "| nonshared | 0.00 / 0.00 | 1.00 / 1.00 |" in md


# --- plan and command line ----------------------------------------------------------------------


def test_plan_grid_quick_size_and_bad_input():
    assert cal_plan.GridPoint(DEFAULT_TEMPERATURE, 32, DEFAULT_TAU) in cal_plan.DEFAULT_GRID
    assert len(cal_plan.DEFAULT_GRID) == 7
    assert cal_plan.parse_points("0.2:full:1.01, 0.05:8:0.9") == (
        cal_plan.GridPoint(0.2, None, 1.01),
        cal_plan.GridPoint(0.05, 8, 0.9),
    )
    with pytest.raises(argparse.ArgumentTypeError, match="T:r:tau"):
        cal_plan.parse_points("0.2:32")
    from kvcmas.cli import build_parser

    parser = build_parser()
    quick = cal_plan.plan_from_args(
        parser.parse_args(["bench", "calibrate", "--quick", "--out", "x"])
    )
    assert (len(quick.points), quick.limit, quick.agent_tokens) == (2, 3, 8)
    for bad in (["--split", "test"], ["--limit", "0"], ["--points", "0:32:0.9"]):
        args = parser.parse_args(["bench", "calibrate", *bad, "--out", "x"])
        with pytest.raises(UsageError):
            cal_plan.plan_from_args(args)


def test_registered_and_smoke_args_parse(tmp_path):
    from kvcmas.cli import build_parser
    from kvcmas.experiments import EXPERIMENT_MODULES, calibrate

    parser = build_parser()
    for name, module in (("calibrate", calibrate), ("ablation", ablation)):
        assert EXPERIMENT_MODULES[name] == module.__name__
        args = parser.parse_args(["bench", name, *module.smoke_args(tmp_path / name)])
        assert args.func is module.run
    quick = parser.parse_args(["bench", "calibrate", *calibrate.smoke_args(tmp_path)])
    assert cal_plan.plan_from_args(quick) == cal_plan.QUICK
    ablation.check_args(parser.parse_args(["bench", "ablation", *ablation.smoke_args(tmp_path)]))


def test_one_default_temperature():
    with pytest.raises(TypeError):
        PoolConfig()  # the pool takes its temperature from the method's config
    assert KVCMASConfig().pool_config().temperature == DEFAULT_TEMPERATURE


def test_calibrate_command_end_to_end(tiny, tmp_path):
    from kvcmas.cli import main

    loaded, hf = tiny
    folder = tmp_path / "tiny-model"
    hf.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    requests = tmp_path / "calib.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS[:2]))
    out = tmp_path / "out"
    argv = ["bench", "calibrate", "--quick", "--requests", str(requests), "--model", str(folder)]
    assert main([*argv, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in results["grid"]] == [p.label for p in cal_plan.QUICK_GRID]
    assert all(r["rho_later"] is not None and r["recompute_later"] is not None
               for r in results["grid"])  # fmt: skip
    assert set(results["baselines"]) == {"nonshared", "fullshared"}
    assert (out / "calibration.png").read_bytes().startswith(PNG)
    assert "T=0.2 r=32 tau=1.01" in (out / "table.md").read_text()


# --- ablation -------------------------------------------------------------------------------------


def test_ablation_workflows():
    for n in (2, 3, 4, 6):
        wf = ablation_plan.chain_workflow(n, 32)
        assert len(wf.agents) == n and wf.final == "decider"
        assert wf.agents[-1].slots == ["query", *wf.order[:-1]]
    wf = ablation_plan.debate_workflow(3, debaters=3, output_tokens=16)
    assert len(wf.agents) == 9 and wf.final == wf.order[-1] == "checker_r3"
    assert wf.agent("analyst_r1").slots == ["query"]
    assert wf.agent("solver_r2").slots == ["query", "analyst_r1", "solver_r1", "checker_r1"]
    assert wf.agent("solver_r2").system == wf.agent("solver_r1").system  # prefix cache shared
    capped = cal_plan.capped(wf, 8)
    assert {a.max_new_tokens for a in capped.agents} == {8}
    assert cal_plan.capped(wf, None) is wf


def test_ablation_bad_arguments_are_usage_errors():
    from kvcmas.cli import build_parser

    parser = build_parser()
    for bad in (["--parts", "a,z"], ["--pool-sizes", "0"], ["--agents", "9"], ["--taus", "-1"]):
        args = parser.parse_args(["bench", "ablation", *bad, "--out", "x"])
        with pytest.raises(UsageError):
            ablation.check_args(args)
    ablation.check_args(parser.parse_args(["bench", "ablation", "--out", "x"]))


def test_ablation_rank_and_pool_size_run_online(tiny, runs, tmp_path):
    # tau 0: every hop falls back and records an anchor, so pools fill to V and evict.
    rows = ablation_runs.rank_pool_rows(runs, [2, None], [1, 3], tau=0.0)
    cell = {(r["rank"], r["pool_size"]): r for r in rows}
    assert set(cell) == {(2, 10), (None, 10), (32, 1), (32, 3)}  # one knob at a time
    for (_, v), r in cell.items():
        assert r["pool_anchors_max"] == min(v, len(REQUESTS))
    assert cell[(32, 1)]["pool_bytes"] < cell[(32, 3)]["pool_bytes"]
    assert cell[(2, 10)]["pool_bytes"] < cell[(None, 10)]["pool_bytes"]
    taus = ablation_runs.tau_rows(runs, [0.0], rank=2)
    assert taus[0]["label"] == cell[(2, 10)]["label"]  # equal settings run once
    loaded, _ = tiny
    wf = [("agents", 2, ablation_plan.chain_workflow(2, 3))]
    scale = ablation_runs.scale_rows(loaded, wf, REQUESTS[:2], 1, lambda _: None)
    assert [r["method"] for r in scale] == ["nonshared", "kvcmas"]
    assert scale[0]["speedup"] == 1.0 and scale[0]["rho_later"] == 0.0
    assert all(r["requests"] == 1 for r in scale)  # the warm-up request is left out
    results = {
        "setup": {"model": "tiny", "dtype": "fp32", "machine": "cpu", "torch": "2",
                  "workflow": "roster"},
        "baselines": runs.baseline_summaries(),
        "rank_pool": rows,
        "tau": taus,
        "chain": [{"chain": c, **cell[(2, 10)]} for c in (True, False)],
        "scale": scale,
    }  # fmt: skip
    md = ablation_report.markdown(results)
    assert "| r=2 V=10 | 0.00 / 0.00 | 1.00 / 1.00 |" in md and "| chain False |" in md
    assert "| agents | 2 | 2 | kvcmas |" in md
    written = ablation_report.plot(results, tmp_path)
    assert set(written) == {"rank_pool_error.png", "rank_pool_bytes.png", "tau.png",
                            "scale_agents.png"}  # fmt: skip
    assert all((tmp_path / f).read_bytes().startswith(PNG) for f in written)
    from tests.fake_runs import png_size

    tau_width = png_size(tmp_path / "tau.png")[0]
    assert png_size(tmp_path / "scale_agents.png")[0] > 2.5 * tau_width  # TTFT, latency, compute
