"""``kvcmas bench pareto``: the frontier computation and the plan's validation (no model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvcmas.errors import UsageError
from kvcmas.experiments.pareto.plan import (
    KNOBS,
    MAX_POINTS,
    NOISE_FLOOR,
    Point,
    add_arguments,
    check_args,
    plan_points,
)
from kvcmas.experiments.pareto.report import (
    add_frontiers,
    frontier,
    frontiers,
    headline_against,
    markdown,
    within_floor,
)


def test_frontier_keeps_exactly_the_undominated_points():
    # (speedup, KL): point 1 beats point 3 on both axes; point 5 has no speed.
    pts = [(1.0, 0.0), (3.0, 0.01), (2.0, 0.005), (2.5, 0.02), (4.0, 0.05), (None, 0.0)]
    assert frontier(pts) == [4, 1, 2, 0]
    assert frontier([(2.0, 0.1), (2.0, 0.1)]) == [0, 1]  # equal points do not beat each other
    assert frontier([(1.0, 0.1), (1.0, 0.2)]) == [0]  # as fast and closer: beaten
    assert frontier([]) == []


def test_frontiers_are_per_method():
    rows = [
        {"method": "a", "label": "a1", "x": 2.0, "first_token_kl": 0.1},
        {"method": "a", "label": "a2", "x": 1.0, "first_token_kl": 0.2},
        {"method": "b", "label": "b1", "x": 1.0, "first_token_kl": 0.2},
    ]
    assert frontiers(rows, "x") == {"a": ["a1"], "b": ["b1"]}


def _pt(method, label, x, kl):
    return {"method": method, "label": label, "x": x, "first_token_kl": kl}


def test_kvcmas_is_on_or_above_a_method_only_where_it_covers_every_point():
    rows = [
        _pt("nonshared", "nonshared", 1.0, 0.0),
        _pt("kvcmas", "k1", 3.0, 0.01),
        _pt("kvcmas", "k2", 2.0, 0.001),
        _pt("headrecompute", "h1", 3.0, 0.01),  # matched exactly by k1: covered
        _pt("headrecompute", "h2", 1.5, 0.0005),  # closer than any KVCMAS point
        _pt("cacheblend", "c1", 1.0, 0.01),
        _pt("fullshared", "fullshared", 10.0, 0.3),  # faster than any KVCMAS point
        _pt("nonshared-bf16", "nonshared-bf16", 1.0, 0.002),  # the noise floor: no method
        _pt("droidspeak", "d1", None, 0.0),  # not timed: no verdict either way
    ]
    assert headline_against(rows, "x") == {
        "headrecompute": ["h2"], "cacheblend": [], "fullshared": ["fullshared"]
    }
    assert headline_against([r for r in rows if r["method"] != "kvcmas"], "x") == {}


def test_the_calibration_rule_takes_the_fastest_point_within_the_noise_floor():
    rows = [
        _pt("nonshared", "nonshared", 1.0, 0.0),
        _pt("nonshared-bf16", "nonshared-bf16", 1.0, 0.002),
        _pt("kvcmas", "k-fast", 4.0, 0.01),  # too far
        _pt("kvcmas", "k-ok", 3.0, 0.002),  # at the floor: within
        _pt("kvcmas", "k-slow", 2.0, 0.0001),
        _pt("fullshared", "fullshared", 10.0, 0.3),  # never within
    ]
    assert within_floor(rows, "x") == {"kvcmas": "k-ok"}
    assert within_floor([r for r in rows if r["label"] != "nonshared-bf16"], "x") == {}


def _two_point_results() -> dict:
    """A timed run at one size: KVCMAS slower than head recompute on TTFT, faster end to end."""
    rows = [
        {**_pt("kvcmas", "k1", 3.0, 0.01), "e2e_speedup": 1.5},
        {**_pt("headrecompute", "h1", 4.0, 0.01), "e2e_speedup": 1.2},
    ]
    for r in rows:
        r["ttft_speedup_later"] = r.pop("x")
        r.update(rho_later=0.9, recompute_later=0.1, compute_ratio=0.8, continuation_kl=None,
                 final_agreement=1.0)  # fmt: skip
    setup = {"agents": 4, "source": "mmlu", "output_tokens": 32, "measured_requests": 4,
             "warmup_requests": 2, "model": "m", "dtype": "bf16", "machine": "test cpu",
             "torch": "x"}  # fmt: skip
    return {"setup": setup, "sizes": [{"size": 64, "points": rows}]}


def test_the_table_states_where_kvcmas_is_not_on_or_above():
    results = _two_point_results()
    add_frontiers(results)
    text = markdown(results)
    assert "on TTFT speedup, hops 2+ and KL: headrecompute not covered: h1." in text
    assert "on end-to-end speedup and KL: headrecompute on or above." in text


def test_reuse_gives_a_verdict_on_points_without_timing():
    results = _two_point_results()
    rows = results["sizes"][0]["points"]
    rows[0]["recompute_later"] = 0.2  # KVCMAS recomputes more than head recompute...
    untimed = {**_pt("droidspeak", "d1", None, 0.02), "e2e_speedup": None, "rho_later": 1.0,
               "recompute_later": 0.7, "compute_ratio": None, "continuation_kl": None,
               "final_agreement": 0.0}  # fmt: skip
    untimed["ttft_speedup_later"] = untimed.pop("x")
    rows.append(untimed)  # ...and covers DroidSpeak, which has fidelity only
    add_frontiers(results)
    assert [r["reuse_later"] for r in rows] == pytest.approx([0.8, 0.9, 0.3])
    against = results["sizes"][0]["kvcmas_against"]
    assert against["reuse_later"] == {"headrecompute": ["h1"], "droidspeak": []}
    assert "droidspeak" not in against["ttft_speedup_later"]  # no timing: no verdict
    assert "on reuse (pairs not run), hops 2+ and KL: headrecompute not covered: h1; " \
        "droidspeak on or above." in markdown(results)


def test_a_partial_runs_table_says_so():
    results = _two_point_results()
    add_frontiers(results)
    assert "Partial" not in markdown(results)
    assert "**Partial: what is finished so far**" in markdown({**results, "partial": True})


def test_rerender_rewrites_an_earlier_runs_table(tmp_path):
    from kvcmas.experiments import pareto

    (tmp_path / "results.json").write_text(json.dumps(_two_point_results()))
    args = parse("--rerender", "--out", str(tmp_path))
    assert pareto.run(args) == 0
    assert "headrecompute not covered: h1" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "pareto_64.png").is_file()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["sizes"][0]["kvcmas_against"]["e2e_speedup"] == {"headrecompute": []}
    with pytest.raises(UsageError, match="no results.json"):
        pareto.run(parse("--rerender", "--out", str(tmp_path / "none")))


def test_a_timing_only_run_draws_no_empty_plot(tmp_path):
    from kvcmas.experiments.pareto.report import plot

    results = _two_point_results()
    add_frontiers(results)
    plot(results, tmp_path)
    assert (tmp_path / "pareto_64.png").is_file()
    # a point timed but without fidelity beside one with (what --timing-from adds) is left off
    results["sizes"][0]["points"].append({**results["sizes"][0]["points"][0], "label": "k2",
                                          "first_token_kl": None})  # fmt: skip
    add_frontiers(results)
    (tmp_path / "pareto_64.png").unlink()
    plot(results, tmp_path)
    assert (tmp_path / "pareto_64.png").is_file()
    for r in results["sizes"][0]["points"]:
        r["first_token_kl"] = None  # what --no-fidelity records
    add_frontiers(results)
    untimed = tmp_path / "timing-only"
    untimed.mkdir()
    plot(results, untimed)
    assert not list(untimed.iterdir())


def _part(tmp_path, name: str, labels: list[tuple[str, str, float, float]], **setup) -> str:
    """A pareto run's folder at one size with NonShared and the given (method, label, TTFT
    speedup, KL) points."""
    results = _two_point_results()
    base = results["sizes"][0]["points"][0]
    rows = [{**base, "method": "nonshared", "label": "nonshared", "ttft_speedup_later": 1.0,
             "first_token_kl": 0.0}]  # fmt: skip
    rows += [
        {**base, "method": m, "label": lb, "ttft_speedup_later": x, "first_token_kl": kl}
        for m, lb, x, kl in labels
    ]
    results["sizes"][0]["points"] = rows
    results["setup"].update(setup)
    results["wall_s"] = 60.0
    folder = tmp_path / name
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results))
    return str(folder)


def test_merge_draws_every_parts_methods_on_one_frontier_plot(tmp_path):
    from kvcmas.experiments import pareto

    a = _part(tmp_path, "a", [("kvcmas", "k1", 3.0, 0.01)])
    b = _part(tmp_path, "b", [("headrecompute", "h1", 4.0, 0.001)], machine="other cpu",
              dtype="fidelity fp32, timing none")
    out = tmp_path / "merged"
    assert pareto.run(parse("--merge", a, b, "--out", str(out))) == 0
    merged = json.loads((out / "results.json").read_text())
    rows = merged["sizes"][0]["points"]
    # NonShared once (from the first part), every other point with the part it came from
    assert [(r["label"], r["part"]) for r in rows] == [("nonshared", 1), ("k1", 1), ("h1", 2)]
    assert merged["sizes"][0]["kvcmas_against"]["ttft_speedup_later"] == {"headrecompute": ["h1"]}
    assert merged["setup"]["machine"] == "differs per part (see parts)"
    assert merged["wall_s"] == 120.0
    table = (out / "table.md").read_text()
    assert "| k1 |" in table and table.count(" part |") == 1
    assert f"`{b}` (fidelity fp32, timing none; other cpu" in table
    assert "{'part'" not in table  # the parts are listed once, not dumped into the setup line
    assert (out / "pareto_64.png").is_file()


def test_merge_refuses_other_documents_a_point_twice_and_a_serving_run(tmp_path):
    from kvcmas.experiments import pareto

    a = _part(tmp_path, "a", [("kvcmas", "k1", 3.0, 0.01)])
    other = _part(tmp_path, "other", [("cacheblend", "c1", 2.0, 0.01)], split="validation")
    with pytest.raises(UsageError, match="split 'validation' != None"):
        pareto.run(parse("--merge", a, other, "--out", str(tmp_path / "m1")))
    again = _part(tmp_path, "again", [("kvcmas", "k1", 3.5, 0.01)])
    with pytest.raises(UsageError, match="k1 at N=64 is in both"):
        pareto.run(parse("--merge", a, again, "--out", str(tmp_path / "m2")))
    serve = tmp_path / "serve"
    serve.mkdir()
    (serve / "results.json").write_text(json.dumps({"setup": {}, "sizes": [], "cells": []}))
    with pytest.raises(UsageError, match="not a `kvcmas bench pareto` run"):
        pareto.run(parse("--merge", a, str(serve), "--out", str(tmp_path / "m3")))
    assert not (tmp_path / "m2").exists()  # a refused merge writes nothing


def _halves(
    tmp_path, name: str, which: str, points: list[tuple[str, str]], partial: bool = False
) -> str:
    """A pareto part at one size that ran only its ``which`` pass ('fidelity' or 'timing', or
    'both') of NonShared, the noise floor and the given (method, label) points; ``partial``: a
    run stopped early (what it saved after its last finished point)."""
    rows = []
    fid, tim = which in ("fidelity", "both"), which in ("timing", "both")
    for method, label in [("nonshared", "nonshared"), (NOISE_FLOOR, NOISE_FLOOR), *points]:
        rows.append({
            "label": label, "method": method, "params": {"knob": label},
            "first_token_kl": 0.01 if fid else None, "continuation_kl": 0.02 if fid else None,
            "final_agreement": 1.0 if fid else None, "rho_later": 0.9 if fid else None,
            "recompute_later": 0.1 if fid else None, "fidelity": {"run": name} if fid else None,
            "ttft_speedup_later": 3.0 if tim else None, "e2e_speedup": 1.5 if tim else None,
            "compute_ratio": 0.7 if tim else None, "timing": {"run": name} if tim else None,
        })  # fmt: skip
    results = _two_point_results()
    results["sizes"][0]["points"] = rows
    dtype = f"fidelity {'fp32' if fid else 'none'}, timing {'bf16' if tim else 'none'}"
    results["setup"]["dtype"] = dtype
    results["wall_s"] = 60.0
    if partial:
        results["partial"] = True
    folder = tmp_path / name
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results))
    return str(folder)


def test_merge_joins_a_fidelity_only_part_with_a_timing_only_part_of_the_same_points(tmp_path):
    from kvcmas.experiments import pareto

    fid = _halves(tmp_path, "fid", "fidelity", [("kvcmas", "k1"), ("headrecompute", "h1")])
    tim = _halves(tmp_path, "tim", "timing", [("kvcmas", "k1")], partial=True)
    out = tmp_path / "merged"
    assert pareto.run(parse("--merge", fid, tim, "--out", str(out))) == 0
    rows = _merged_rows(out)
    for label in ("nonshared", NOISE_FLOOR, "k1"):  # both halves: one row, fidelity first
        r = rows[label]
        assert r["part"] == "1+2"
        assert r["fidelity"] == {"run": "fid"} and r["first_token_kl"] == 0.01
        assert r["timing"] == {"run": "tim"} and r["ttft_speedup_later"] == 3.0
        assert r["compute_ratio"] == 0.7 and r["params"] == {"knob": label}
    assert rows["h1"]["part"] == 1 and rows["h1"]["ttft_speedup_later"] is None  # not timed
    table = (out / "table.md").read_text()
    assert "a row of part F+T joins" in table
    assert f"`{tim}` (fidelity none, timing bf16; test cpu, 1 min, stopped early" in table
    assert f"`{fid}` (fidelity fp32, timing none; test cpu, 1 min)" in table
    assert "**Partial" not in table  # the merge itself is whole
    # the same halves in the other order join the same way
    back = tmp_path / "back"
    assert pareto.run(parse("--merge", tim, fid, "--out", str(back))) == 0
    k1 = _merged_rows(back)["k1"]
    assert k1["part"] == "2+1" and k1["first_token_kl"] == 0.01 and k1["e2e_speedup"] == 1.5
    # two fidelity halves of one point are still the same point twice
    again = _halves(tmp_path, "again", "fidelity", [("kvcmas", "k1")])
    with pytest.raises(UsageError, match="k1 at N=64 is in both"):
        pareto.run(parse("--merge", fid, again, "--out", str(tmp_path / "m")))


def test_timing_from_retimes_every_point_with_one_parts_timing(tmp_path):
    from kvcmas.experiments import pareto

    # part 1 measured both passes (on another host), part 2 only fidelity; part 3 re-timed
    # every point on this host, in fp32
    both = _halves(tmp_path, "both", "both", [("kvcmas", "k1")])
    fid = _halves(tmp_path, "fid", "fidelity", [("kvcomm", "v1"), ("droidspeak", "d1")])
    tim = _halves(tmp_path, "tim", "timing", [("kvcmas", "k1"), ("kvcomm", "v1")])
    results = json.loads(Path(tim, "results.json").read_text())
    results["setup"].update(
        machine="avx2 cpu", dtype="fidelity none, timing fp32", timing_order="interleaved"
    )
    for row in results["sizes"][0]["points"]:
        row.update(ttft_speedup_later=2.0, timing={"run": "tim"})
    Path(tim, "results.json").write_text(json.dumps(results))
    out = tmp_path / "retimed"
    assert pareto.run(parse("--merge", both, fid, "--timing-from", tim, "--out", str(out))) == 0
    rows = _merged_rows(out)
    assert {lb: r["part"] for lb, r in rows.items()} == {
        "nonshared": "1+3", NOISE_FLOOR: "1+3", "k1": "1+3", "v1": "2+3", "d1": 2
    }
    for label in ("nonshared", "k1", "v1"):  # fidelity from its part, timing from part 3
        assert rows[label]["timing"] == {"run": "tim"} and rows[label]["ttft_speedup_later"] == 2
    assert rows["k1"]["fidelity"] == {"run": "both"}
    assert rows["d1"]["ttft_speedup_later"] is None and rows["d1"]["timing"] is None
    setup = json.loads((out / "results.json").read_text())["setup"]
    assert (setup["machine"], setup["dtype"]) == ("avx2 cpu", "fidelity fp32, timing fp32")
    assert setup["timing_order"] == "interleaved"  # the timing part's, not part 1's (none)
    assert "every timing is part 3's" in (out / "table.md").read_text()
    # without --timing-from, part 1's own timing of k1 and part 3's are the same point twice
    with pytest.raises(UsageError, match="k1 at N=64 is in both"):
        pareto.run(parse("--merge", both, tim, "--out", str(tmp_path / "m1")))
    with pytest.raises(UsageError, match="not a timing-only run"):
        pareto.run(parse("--merge", fid, "--timing-from", both, "--out", str(tmp_path / "m2")))
    with pytest.raises(UsageError, match="--timing-from re-times a --merge"):
        pareto.run(parse("--timing-from", tim, "--out", str(tmp_path / "m3")))


def _merged_rows(out) -> dict:
    merged = json.loads((out / "results.json").read_text())
    return {r["label"]: r for r in merged["sizes"][0]["points"]}


def test_a_timing_only_pass_gives_the_noise_floor_nonshareds_timing():
    from kvcmas.experiments.pareto.runs import merge_points

    points = [Point("nonshared"), Point("kvcmas", {"tau": 1.0})]
    tim = {
        "nonshared": {"ttft_later_ratio": 1.0, "latency_ratio": 1.0, "params": {}},
        "kvcmas(tau=1.0)": {"ttft_later_ratio": 0.5, "latency_ratio": 0.8, "params": {"tau": 1.0}},
    }
    rows = {r["label"]: r for r in merge_points(points, {}, tim, floor=True)}
    assert list(rows) == ["nonshared", "kvcmas(tau=1.0)", NOISE_FLOOR]
    assert rows[NOISE_FLOOR]["timing"] is tim["nonshared"] and rows[NOISE_FLOOR]["fidelity"] is None
    assert rows["kvcmas(tau=1.0)"]["ttft_speedup_later"] == 2.0
    assert rows["kvcmas(tau=1.0)"]["params"] == {"tau": 1.0}
    assert NOISE_FLOOR not in {r["label"] for r in merge_points(points, {}, tim, floor=False)}


def test_split_selects_the_documents_source_split():
    assert parse("--out", "x").split == "test"
    assert parse("--split", "validation", "--out", "x").split == "validation"
    with pytest.raises(SystemExit):
        parse("--split", "train", "--out", "x")


def test_plan_points_nonshared_first_within_the_point_cap():
    points = plan_points(["cacheblend", "kvcmas", "droidspeak"], 30, 3)
    assert points[0] == Point("nonshared")
    per_method = {m: [p for p in points if p.method == m] for m in ("kvcmas", "droidspeak")}
    assert all(len(v) == 3 for v in per_method.values())
    kv = per_method["kvcmas"]
    assert kv[0].options == KNOBS["kvcmas"][0] and kv[-1].options == KNOBS["kvcmas"][-1]
    assert per_method["droidspeak"][0].options == {"block": "6:28"}  # fractions of 30 layers
    assert Point("nonshared", dtype="bf16").label == NOISE_FLOOR
    assert all(len(v) <= MAX_POINTS for v in KNOBS.values())
    graphflow = plan_points(["graphflow"], 30, 2)[1:]
    assert [p.label for p in graphflow] == ["graphflow(residual_topk=16)",
                                           "graphflow(residual_topk=64)"]


def test_given_points_replace_a_methods_grid():
    args = parse("--methods", "kvcmas,cacheblend", "--max-points", "2", "--point",
                 "kvcmas:tau=1.0,repair_head=64", "--point", "headrecompute:head_tokens=8")
    check_args(args)
    points = plan_points(args.methods, 30, args.max_points, args.points)
    assert [p.label for p in points if p.method in ("kvcmas", "headrecompute")] == [
        "kvcmas(tau=1.0,repair_head=64)", "headrecompute(head_tokens=8)"]
    assert len([p for p in points if p.method == "cacheblend"]) == 2  # its grid, capped


def test_max_points_caps_a_grid_but_never_the_points_given_by_name():
    args = parse("--methods", "cacheblend,kvcomm", "--max-points", "1", "--point",
                 "cacheblend:ratio=0.15", "--point", "cacheblend:ratio=0.3")
    check_args(args)
    points = plan_points(args.methods, 30, args.max_points, args.points)
    assert [p.label for p in points] == [
        "nonshared", "cacheblend(ratio=0.15)", "cacheblend(ratio=0.3)", "kvcomm"]


@pytest.mark.parametrize(
    "point, message",
    [("kvcmass:tau=1", "unknown method 'kvcmass'"), ("kvcmas:tau", "expected key=value"),
     ("kvcmas:taux=1", "taux")],
)
def test_a_bad_point_is_refused_by_name(point, message):
    with pytest.raises(UsageError, match=message):
        check_args(parse("--point", point))


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--out", "x", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--measure", "0"), "measure"),
        (("--sizes", "0"), "sizes"),
        (("--agents", "9"), "agents"),
        (("--max-points", "7"), "max-points"),
        (("--no-timing", "--no-fidelity"), "nothing to run"),
    ],
)
def test_check_args_refuses_bad_plans(argv, message):
    with pytest.raises(UsageError, match=message):
        check_args(parse(*argv))


def test_check_args_accepts_the_defaults_and_unknown_methods_fail_in_parsing():
    args = parse()
    check_args(args)
    assert args.dtype == "bf16" and args.warmup == 4 and args.measure == 8
    with pytest.raises(SystemExit):
        parse("--methods", "nosuch")


def test_the_timing_pass_interleaves_points_each_with_the_request_sequence_it_has_alone(
    monkeypatch,
):
    from kvcmas.experiments.context_sweep.plan import trace_workflow
    from kvcmas.experiments.pareto import runs
    from kvcmas.workflow.runner import Runner
    from tests.conftest import tiny_loaded

    loaded, _ = tiny_loaded()
    workflow = trace_workflow(3, 4)
    docs = [f"Report {i}. " + "Sales rose in the north and fell in the south. " * 4
            for i in range(4)]  # fmt: skip
    points = [Point("nonshared"), Point("kvcmas", {"tau": 1.0, "repair_head": 4}),
              Point("headrecompute", {"head_tokens": 4})]  # fmt: skip
    alone = {p.label: runs.run_point(loaded, workflow, p, docs, 2, None, lambda _: None)[0]
             for p in points}  # fmt: skip
    order, seen = [], {}
    run = Runner.run

    def recording(self, request):
        result = run(self, request)
        order.append((result.method, request["id"]))
        seen.setdefault(result.method, []).append(result)
        return result

    monkeypatch.setattr(Runner, "run", recording)
    out = runs.timing_pass(loaded, workflow, points, docs, 2, lambda _: None)
    names = [alone[p.label][0].method for p in points]
    # the stateful method's warm-ups first, then request i of every point before i + 1
    warm = [(names[1], "doc0"), (names[1], "doc1")]
    assert order == warm + [(n, d) for d in ("doc2", "doc3") for n in names]
    for p, name in zip(points, names, strict=True):
        measured = seen[name][-2:]
        assert [[h.output_ids for h in r.hops] for r in measured] == [
            [h.output_ids for h in r.hops] for r in alone[p.label]
        ]
        assert [[h.reuse for h in r.hops] for r in measured] == [
            [h.reuse for h in r.hops] for r in alone[p.label]
        ]
        assert out[p.label]["requests"] == 2
    assert out["nonshared"]["ttft_later_ratio"] == 1.0


def _tiny_with_wide_floor():
    """The tiny model in fp32 and its noise-floor twin: bf16 weights, fp32 matrix products."""
    import torch

    from kvcmas.model.config import ModelConfig
    from kvcmas.model.loader import LoadedModel
    from kvcmas.model.transformer import Transformer
    from tests.conftest import tiny_loaded

    loaded, hf = tiny_loaded()
    config = ModelConfig.from_hf(hf.config.to_dict())
    wide = Transformer.from_state_dict(
        config, hf.state_dict(), torch.bfloat16, gemm_dtype=torch.float32
    )
    return loaded, LoadedModel("tiny", wide, loaded.tokenizer, loaded.folder)


def test_a_noise_floor_with_fp32_gemms_is_recorded_and_stated():
    from kvcmas.experiments.context_sweep.plan import trace_workflow
    from kvcmas.experiments.pareto import runs

    loaded, floor = _tiny_with_wide_floor()
    docs = ["Sales rose in the north and fell in the south. " * 3]
    fid = runs.fidelity_pass(
        loaded, floor, trace_workflow(2, 3), [Point("nonshared")], docs, 0, lambda _: None
    )
    assert fid[NOISE_FLOOR]["gemm_dtype"] == "fp32" and "gemm_dtype" not in fid["nonshared"]
    # bf16's numbers, not fp32's: the cache differs from fp32's. (Not the first-token KL: on
    # this random tiny model it is below its own rounding, -8e-7 on an AMX host.)
    assert fid[NOISE_FLOOR]["kv_error_later_mean"] > 1e-3
    results = _two_point_results()
    rows = runs.merge_points([Point("nonshared")], fid, {}, True)
    plain = {**fid[NOISE_FLOOR]}
    del plain["gemm_dtype"]
    for floor_fidelity, stated in ((fid[NOISE_FLOOR], True), (plain, False)):
        rows[1]["fidelity"] = floor_fidelity
        results["sizes"][0]["points"] = rows
        add_frontiers(results)
        assert ("its matrix products in fp32 over bf16" in markdown(results)) is stated


# --- --resume: a fidelity pass stopped early goes on where it stopped -------------------------

RESUME_POINTS = (
    "--point", "kvcmas:tau=1.0,repair_head=4", "--point", "headrecompute:head_tokens=4"
)  # fmt: skip
KV_POINT, HEAD_POINT = "kvcmas(tau=1.0,repair_head=4)", "headrecompute(head_tokens=4)"


def _fidelity_run(tmp_path, monkeypatch, *argv, points=RESUME_POINTS, stop_after=None):
    """``kvcmas bench pareto --no-timing`` of NonShared and ``points`` (and the noise floor)
    on the tiny model into ``tmp_path/run``: the labels it ran; ``stop_after``: the number of
    points it runs before it is stopped (an error, as a killed run)."""
    from kvcmas.experiments import pareto
    from kvcmas.experiments.pareto import runs

    loaded, floor = _tiny_with_wide_floor()

    def load(spec, dtype="fp32", device="cpu", gemm_dtype=None):  # the floor: fp32 unless wide
        return floor if gemm_dtype == "fp32" else loaded

    ran, run_point = [], runs.run_point

    def recording(loaded, workflow, point, *rest):
        if len(ran) == stop_after:
            raise KeyboardInterrupt
        ran.append(point.label)
        return run_point(loaded, workflow, point, *rest)

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--sizes", "48", "--agents", "2", "--output-tokens", "3", "--warmup", "1", "--measure",
         "2", "--no-timing", "--methods", "nonshared", *points, "--out",
         str(tmp_path / "run"), *argv]
    )  # fmt: skip
    check_args(args)
    with monkeypatch.context() as patch:  # undone on return: the next run patches afresh
        patch.setattr(runs, "load_model", load)
        patch.setattr(runs, "run_point", recording)
        if stop_after is None:
            pareto.run(args)
        else:
            with pytest.raises(KeyboardInterrupt):
                pareto.run(args)
    return ran


def _fidelity_rows(folder: Path) -> dict[int, dict[str, dict]]:
    """Per size, label -> fidelity figures (not the times, which no two runs share)."""
    sizes = json.loads((folder / "results.json").read_text())["sizes"]
    kept = ("kv_error", "first_token_kl", "continuation_kl", "same_hop", "final_", "rho",
            "recompute", "k_error", "v_error", "params", "gemm")  # fmt: skip
    return {s["size"]: {r["label"]: {k: v for k, v in r["fidelity"].items() if k.startswith(kept)}
                        for r in s["points"]} for s in sizes}  # fmt: skip


def test_a_resumed_fidelity_pass_runs_only_what_is_left_and_matches_a_whole_run(
    tmp_path, monkeypatch
):
    labels = ["nonshared", KV_POINT, HEAD_POINT, NOISE_FLOOR]
    both = ("--sizes", "48,64")
    assert _fidelity_run(tmp_path / "whole", monkeypatch, *both) == labels + labels
    whole = _fidelity_rows(tmp_path / "whole" / "run")
    nonshared = whole[48]["nonshared"]["final_answers"]
    assert whole[48][HEAD_POINT]["final_agreement"] == sum(
        a == b for a, b in zip(whole[48][HEAD_POINT]["final_answers"], nonshared, strict=True)
    ) / len(nonshared)

    stopped = tmp_path / "stopped"
    run = stopped / "run"
    assert _fidelity_run(stopped, monkeypatch, "--sizes", "64", stop_after=2) == labels[:2]
    assert list(_fidelity_rows(run)[64]) == labels[:2]
    # resumed over both sizes and stopped again within the first: the second size's finished
    # points stay in every save
    assert _fidelity_run(stopped, monkeypatch, *both, "--resume", stop_after=1) == labels[:1]
    assert {s: list(rows) for s, rows in _fidelity_rows(run).items()} == {
        48: labels[:1], 64: labels[:2]
    }
    # finished points are taken, not run again; the figures are the whole run's, agreement
    # included (against NonShared's answers kept from the earlier run)
    assert _fidelity_run(stopped, monkeypatch, *both, "--resume") == labels[1:] + labels[2:]
    assert _fidelity_rows(run) == whole
    setup = json.loads((run / "results.json").read_text())["setup"]
    assert setup["resumed_points"] == {"48": ["nonshared"], "64": sorted(labels[:2])}


def test_a_resumed_pass_stopped_before_its_taken_points_keeps_them(tmp_path, monkeypatch):
    # the first run finished NonShared, the head point and the floor; the resumed one plans
    # the KVCMAS point between them and is stopped there, before it reaches the taken ones
    _fidelity_run(tmp_path, monkeypatch, points=RESUME_POINTS[2:])
    first = _fidelity_rows(tmp_path / "run")
    assert list(first[48]) == ["nonshared", HEAD_POINT, NOISE_FLOOR]
    assert _fidelity_run(tmp_path, monkeypatch, "--resume", stop_after=0) == []
    assert _fidelity_rows(tmp_path / "run") == first


@pytest.mark.parametrize(
    "argv, edit, message",
    [
        (("--output-tokens", "4"), None, "another workload .*output_tokens"),
        ((), lambda row: row.update(timing={}), "holds timing figures"),
        ((), lambda row: row["fidelity"]["params"].update(tau=0.9), "ran with"),
        ((), lambda row: row["fidelity"].pop("final_answers"), "kept no final answers"),
    ],
)
def test_resume_refuses_what_it_would_not_reproduce_and_keeps_the_file(
    tmp_path, monkeypatch, argv, edit, message
):
    _fidelity_run(tmp_path, monkeypatch, stop_after=2)
    path = tmp_path / "run" / "results.json"
    if edit is not None:
        results = json.loads(path.read_text())
        edit(results["sizes"][0]["points"][1])  # the KVCMAS point
        path.write_text(json.dumps(results))
    saved = path.read_text()
    with pytest.raises(UsageError, match=message):
        _fidelity_run(tmp_path, monkeypatch, "--resume", *argv)
    assert path.read_text() == saved


def test_resume_refuses_to_drop_a_point_or_take_another_floor(tmp_path, monkeypatch):
    _fidelity_run(tmp_path, monkeypatch)
    path = tmp_path / "run" / "results.json"
    saved = path.read_text()
    with pytest.raises(UsageError, match=r"kvcmas\(tau=1.0,repair_head=4\), which this run"):
        _fidelity_run(tmp_path, monkeypatch, "--resume", points=RESUME_POINTS[2:])
    with pytest.raises(UsageError, match="nonshared-bf16, which this run"):
        _fidelity_run(tmp_path, monkeypatch, "--resume", "--no-noise-floor")
    with pytest.raises(UsageError, match="match --floor-gemm"):
        _fidelity_run(tmp_path, monkeypatch, "--resume", "--floor-gemm", "fp32")
    assert path.read_text() == saved
    # a point added is no conflict: it alone runs
    assert _fidelity_run(tmp_path, monkeypatch, "--resume", "--methods", "kvcomm") == ["kvcomm"]
    # nothing to resume yet: the whole pass runs
    assert len(_fidelity_run(tmp_path / "fresh", monkeypatch, "--resume")) == 4


def test_resume_is_for_a_fidelity_pass_only():
    for argv in (("--resume",), ("--resume", "--no-timing", "--merge", "a")):
        with pytest.raises(UsageError, match="--resume goes on with a fidelity pass"):
            check_args(parse(*argv))


def test_the_fidelity_observer_watches_measured_requests_only(monkeypatch):
    from kvcmas.eval.fidelity import FidelityObserver
    from kvcmas.experiments.context_sweep.plan import trace_workflow
    from kvcmas.experiments.pareto import runs
    from tests.conftest import tiny_loaded

    loaded, _ = tiny_loaded()
    workflow = trace_workflow(2, 3)
    docs = [f"Report {i}. " + "Sales rose in the north and fell in the south. " * 3
            for i in range(3)]  # fmt: skip
    point = Point("kvcmas", {"tau": 1.0, "repair_head": 4})  # keeps state: two warm-ups
    plain, _ = runs.run_point(loaded, workflow, point, docs, 2, None, lambda _: None)
    seen, call = [], FidelityObserver.__call__
    monkeypatch.setattr(
        FidelityObserver, "__call__", lambda self, view: seen.append(view) or call(self, view)
    )
    observer = FidelityObserver(loaded)
    watched, _ = runs.run_point(loaded, workflow, point, docs, 2, observer, lambda _: None)
    assert len(seen) == 2  # the measured request's two hops, not the warm-ups' four
    assert all(h.fidelity is not None for r in watched for h in r.hops)
    # watching changes nothing the method does: the same outputs and reuse as unwatched
    assert [[(h.output_ids, h.reuse) for h in r.hops] for r in watched] == [
        [(h.output_ids, h.reuse) for h in r.hops] for r in plain
    ]
