"""The pure parts of the experiments (context-sweep, lowrank, coverage): traces,
workflows, spectra arithmetic, tables and plots on synthetic results, and
argument parsing. One tiny real-model computation (glue KV deviations)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvcmas.chat import tokenize
from kvcmas.cli import build_parser
from kvcmas.errors import UsageError
from kvcmas.eval.anchor_pairs import EdgePair
from kvcmas.eval.summary import run_summary
from kvcmas.experiments import (
    EXPERIMENT_MODULES,
    common,
    context_sweep,
    coverage_exp,
    lowrank,
)
from kvcmas.experiments.child import in_child
from kvcmas.experiments.context_sweep import documents as sweep_docs
from kvcmas.experiments.context_sweep import plan as sweep_plan
from kvcmas.experiments.context_sweep import report as sweep_report
from kvcmas.experiments.context_sweep import runs as sweep_runs
from kvcmas.experiments.lowrank import claims as lowrank_claims
from kvcmas.experiments.lowrank import report as lowrank_report
from kvcmas.experiments.lowrank import runs as lowrank_runs
from kvcmas.experiments.lowrank import spectra
from tests.fake_runs import fake_run, png_size

MINE = {
    "context-sweep": context_sweep,
    "lowrank": lowrank,
    "coverage": coverage_exp,
}


# --- argument parsing -------------------------------------------------------------------------


def test_experiments_are_registered_and_their_smoke_args_parse(tmp_path):
    parser = build_parser()
    for name, module in MINE.items():
        assert EXPERIMENT_MODULES[name] == module.__name__
        argv = module.smoke_args(tmp_path / name)
        args = parser.parse_args(["bench", name, *argv])
        assert args.func is module.run
        assert args.out == str(tmp_path / name)


def test_context_sweep_defaults_are_the_papers_trace_in_bf16():
    args = build_parser().parse_args(["bench", "context-sweep", "--out", "x"])
    assert args.sizes == [512, 1024, 2048, 4096, 8192]
    assert args.methods == ["nonshared", "fullshared", "kvcmas", "kvcomm"]
    assert (args.dtype, args.output_tokens, args.agents, args.isolate) == ("bf16", 128, 4, True)


def test_list_parsers():
    assert common.int_list("1, 2,4") == [1, 2, 4]
    assert common.float_list("0.5,1.01") == [0.5, 1.01]
    assert common.rank_list("2,32,full,0") == [2, 32, None, None]
    assert common.choice_list(["a", "b"])("b, a") == ["b", "a"]
    with pytest.raises(argparse.ArgumentTypeError, match="empty item"):
        common.int_list("1,,2")
    with pytest.raises(argparse.ArgumentTypeError, match="bad list"):
        common.int_list("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown c: choose from a, b"):
        common.choice_list(["a", "b"])("a,c")


@pytest.mark.parametrize("experiment", ["context-sweep", "accuracy"])
def test_unknown_method_is_refused_while_parsing(experiment, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["bench", experiment, "--methods", "nope", "--out", "x"])
    assert info.value.code == 2
    assert "unknown nope: choose from nonshared," in capsys.readouterr().err


def test_bad_arguments_are_usage_errors():
    from kvcmas.cli import main

    parser = build_parser()
    args = parser.parse_args(["bench", "context-sweep", "--agents", "1", "--out", "x"])
    with pytest.raises(UsageError, match="--agents must be in 2..6"):
        sweep_plan.check_args(args)
    assert main(["bench", "context-sweep", "--measure", "0", "--out", "x"]) == 2


# --- traces and workflows ---------------------------------------------------------------------


def test_trace_workflow_chains_every_earlier_output():
    wf = sweep_plan.trace_workflow(4, 128)
    assert wf.order == ("reader", "analyst", "critic", "writer")
    assert wf.inputs() == ["doc"]
    for i, agent in enumerate(wf.agents):
        assert agent.slots == ["doc", *wf.order[:i]]
        assert agent.max_new_tokens == 128
    assert wf.final == "writer"


def test_trace_lengths_and_size_cap(real_model, monkeypatch):
    tok = real_model.tokenizer
    wf = sweep_plan.trace_workflow(4, 128)
    overhead = sweep_plan.overhead_tokens(tok, wf)
    # The last agent holds three earlier outputs and generates 128 more.
    assert 3 * 128 + 128 < overhead < 3 * 128 + 128 + 200
    limit = real_model.config.max_position - overhead
    sizes, capped = sweep_plan.cap_sizes([512, 8192, 9000], limit)
    assert sizes == [512, limit] and capped == {8192: limit, 9000: limit}
    texts = [
        f"Question {i}: what is {i} plus {i + 1}? Think about it carefully." for i in range(80)
    ]
    docs = sweep_docs.documents(tok, texts, 100, 3)
    assert [len(tokenize(tok, d.strip())) for d in docs] == [100, 100, 100]
    assert len(set(docs)) == 3  # different content, same size
    with pytest.raises(ValueError, match="not enough text"):
        sweep_docs.documents(tok, texts[:5], 100, 3)
    # A block that no cut fits is skipped, not fatal: the next texts make the document.
    real_cut, calls = sweep_docs.exact_prefix, []

    def first_block_fails(tokenizer, ids, n):
        calls.append(n)
        if len(calls) == 1:
            raise ValueError("no cut")
        return real_cut(tokenizer, ids, n)

    monkeypatch.setattr(sweep_docs, "exact_prefix", first_block_fails)
    skipped = sweep_docs.documents(tok, texts, 100, 3)
    assert len(calls) == 4 and skipped[0] == docs[1]


def test_keeps_state():
    from kvcmas.methods import make_method

    assert not sweep_runs.keeps_state(make_method("nonshared"))
    assert not sweep_runs.keeps_state(make_method("fullshared"))
    assert sweep_runs.keeps_state(make_method("kvcmas"))
    assert sweep_runs.keeps_state(make_method("kvcomm"))
    assert sweep_runs.keeps_state(make_method("graphflow"))  # residuals learned per path
    assert not sweep_runs.keeps_state(make_method("droidspeak"))  # hidden states: per session


# --- spectra ----------------------------------------------------------------------------------


def planted(spectrum: list[float], n: int = 40, d: int = 24, layers: int = 3) -> torch.Tensor:
    """``[layers, n, d]`` matrices with exactly the given singular values."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        u, _ = torch.linalg.qr(torch.randn(n, len(spectrum), generator=g))
        v, _ = torch.linalg.qr(torch.randn(d, len(spectrum), generator=g))
        out.append(u @ torch.diag(torch.tensor(spectrum)) @ v.T)
    return torch.stack(out)


def test_effective_rank_and_energy_of_planted_spectra():
    # Energies 16, 9, 4, 1 of 30: top-1 53%, top-2 83%, top-3 97% -> 90% needs 3.
    m = planted([4.0, 3.0, 2.0, 1.0])
    fam = spectra.Family("x")
    fam.add(m)
    s = fam.summary()
    assert s["effective_rank_mean"] == 3 and s["effective_rank_max"] == 3
    assert s["energy_at_8"] == pytest.approx(1.0) and s["energy_at_32"] == pytest.approx(1.0)
    curve = spectra.energy_curve(m)
    assert curve.shape == (3, spectra.CURVE_RANKS)
    assert curve[0, :4].tolist() == pytest.approx([16 / 30, 25 / 30, 29 / 30, 1.0], abs=1e-5)
    flat = planted([1.0] * 20)  # flat spectrum of rank 20: 90% needs 18
    fam.add(flat)
    assert fam.summary()["effective_rank_max"] == 18
    assert fam.summary(min_length=41) is None


def test_rank_bound_by_short_segments():
    fam = spectra.Family("short")
    fam.add(torch.randn(2, 5, 64))  # 5 tokens: rank at most 5
    s = fam.summary()
    assert s["effective_rank_max"] <= 5 and s["tokens_max"] == 5


def test_families_and_claims():
    n, d = 12, 8

    def pair(kind, seed):
        g = torch.Generator().manual_seed(seed)
        x = [torch.randn(2, n, d, generator=g) for _ in range(2)]
        y = [t + 0.1 * torch.randn(2, n, d, generator=g) for t in x]
        return EdgePair(("query", "b"), kind, x[0], x[1], y[0], y[1])

    fams = lowrank_runs.families_from_pairs([pair("query", 0), pair("agent", 1)])
    assert fams["delta K (all)"].lengths == [n, n]
    assert len(fams["base V (query)"].lengths) == 1
    devs = {(0, 0, 1): [(torch.randn(2, 4, d), torch.randn(2, 4, d)) for _ in range(3)]}
    pf = lowrank_runs.families_from_deviations(devs)
    assert pf["PF K"].lengths == [4, 4, 4] and pf["PF K (stacked)"].lengths == [12]
    summaries = {k: f.summary() for k, f in {**fams, **pf}.items()}
    c = lowrank_claims.claims(summaries)
    assert c["delta_effective_rank_below_32"]["holds"]  # 12 tokens: trivially
    assert c["delta_effective_rank_below_32"]["holds_on_long_segments"] is None
    md = lowrank_report.markdown({"setup": synthetic_setup(), "summaries": summaries, "claims": c})
    assert "| PF K |" in md and "delta effective rank below 32" in md


def test_glue_deviation_is_zero_for_the_same_prefix_and_not_otherwise(real_model):
    """The one real-model computation: a few short prefills."""
    systems = ["You are a solver.", "You are a solver.", "You are a harsh critic of plans."]
    devs = lowrank_runs.prefix_deviations(real_model, systems, ["What is 2+2?"], ("Notes:",), print)
    ((same_k, same_v),) = devs[(0, 0, 1)]
    ((diff_k, _),) = devs[(0, 1, 2)]
    n = len(tokenize(real_model.tokenizer, "Notes:"))
    assert same_k.shape == (real_model.config.n_layers - 1, n, real_model.config.kv_width)
    assert same_k.abs().max() == 0 and same_v.abs().max() == 0
    assert diff_k.abs().max() > 1e-3


# --- tables and plots on synthetic results ----------------------------------------------------


def synthetic_setup(**sizes):
    return {
        "model": "m",
        "dtype": "fp32",
        "machine": "cpu",
        "torch_threads": 1,
        "python": "3",
        "torch": "2",
        **sizes,
    }


def test_context_sweep_table_and_plots(tmp_path, monkeypatch):
    """Summaries from eval.summary: KVCMAS faster to first token but slower end to end here,
    and the table shows both, with rho beside the recompute fraction."""
    runs = [
        {"size": n, "method": "nonshared", "summary": run_summary(fake_run(1.0, 10.0, 20.0, 0))}
        for n in (512, 1024)
    ] + [
        {"size": n, "method": "kvcmas", "summary": run_summary(fake_run(0.6, 12.0, 15.0, 80))}
        for n in (512, 1024)
    ]
    failed = {"size": 1024, "method": "kvcomm", "summary": None, "error": "...\nOOM: killed\n"}
    runs.append(failed)
    sweep_runs.add_size_ratios(runs)
    kv = runs[3]["summary"]
    assert kv["ttft_later_ratio"] == pytest.approx(0.6)
    assert kv["ttft_all_ratio"] == pytest.approx((1 + 3 * 0.6) / 4)
    assert (kv["latency_ratio"], kv["compute_ratio"]) == pytest.approx((1.2, 0.75))
    assert runs[0]["summary"]["ttft_later_ratio"] == 1.0
    results = {
        "setup": synthetic_setup(
            agents=4, output_tokens=128, warmup_requests=3, measured_requests=2, sizes=[512]
        ),
        "capped": {"8192": 7500},
        "context_limit": 8192,
        "non_doc_tokens_max": 692,
        "isolated_processes": True,
        "runs": runs,
    }
    md = sweep_report.markdown(results)
    # TTFT all / 2+, its ratio, latency (ratio), compute (ratio), rho all / 2+, recompute.
    assert (
        "| 1024 | kvcmas | 0.700 / 0.600 | 0.70 / 0.60 | 12.000 (1.20) | 15.0 (0.75) "
        "| 0.60 / 0.80 | 0.40 / 0.20 | 300 | 128 |"
    ) in md
    assert "| 512 | nonshared | 1.000 / 1.000 | 1.00 / 1.00 | 10.000 (1.00) | 20.0 (1.00) " in md
    assert "capped to 7500" in md and "Model m (fp32)" in md
    failed_row = next(line for line in md.splitlines() if "| kvcomm |" in line)
    assert "failed: OOM: killed" in failed_row
    header = next(line for line in md.splitlines() if line.startswith("| N |"))
    assert failed_row.count("|") == header.count("|")  # a failed run keeps the columns

    drawn = {}
    monkeypatch.setattr(
        sweep_report, "line_panels", lambda path, panels, *a, **k: drawn.update({path.name: panels})
    )
    sweep_report.plot(results, tmp_path)
    cost, ratio = drawn["cost_vs_size.png"], drawn["ratio_vs_size.png"]
    assert [label.split()[0] for label, _ in cost] == ["mean", "request", "compute:"]
    assert cost[1][1]["kvcmas"] == ([512, 1024], [12.0, 12.0])  # latency beside the TTFT
    assert ratio[2][1]["kvcmas"][1] == pytest.approx([0.75, 0.75])
    assert ratio[0][1]["kvcomm"] == ([1024], [None])  # a failed run is a gap, not a crash
    monkeypatch.undo()
    sweep_report.plot(results, tmp_path)
    assert png_size(tmp_path / "cost_vs_size.png") == (3 * 704, 462)  # three 6.4x4.2 panels


def test_coverage_claim_by_budget_table_and_plot(tmp_path):
    from kvcmas.eval.coverage import RULES

    rows = [
        {
            "rule": rule,
            "budget": b,
            "pair_fraction": b,
            "coverage_mean": b * (3 if rule.startswith("oracle") else 2),
            "coverage_pooled": b,
            "outside_mean": 1 - b,
        }
        for b in (0.1, 0.3)
        for rule in RULES
    ]
    assert coverage_exp.claim_by_budget(rows) == {0.1: True, 0.3: False}
    cov = {
        "model": "m",
        "dtype": "float32",
        "workflow": "roster",
        "requests": 2,
        "hops": [{"request": 0, "agent": "a", "shared_tokens": 5, "total_error": 1.0}],
        "rows": rows,
        "claim_at_least_half_outside": False,
    }
    results = {"setup": synthetic_setup(), "coverage": cov, "claim_by_budget": {0.1: True}}
    md = coverage_exp.markdown(results)
    assert md.startswith("# Reconstruction coverage") and "budget 0.10: holds" in md
    coverage_exp.plot(results, tmp_path / "c.png")
    assert png_size(tmp_path / "c.png") == (704, 462)


# --- child processes --------------------------------------------------------------------------


def _square(x: int) -> int:
    return x * x


def _fail() -> None:
    raise ValueError("boom")


def test_in_child_returns_values_and_reports_failures():
    assert in_child(_square, 7) == 49
    with pytest.raises(RuntimeError, match="boom"):
        in_child(_fail)
