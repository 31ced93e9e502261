"""Task rosters, the ``score`` dispatch, the accuracy table and report writers, and the smoke
orchestrator's plan. No model runs: the results dicts here are hand-made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcmas.chat import SLOT_PATTERN
from kvcmas.errors import UsageError
from kvcmas.eval.summary import RATIO_KEYS, run_summary
from kvcmas.eval.tasks import TASKS, extract_answer, load_workflow, score, task_workflow
from kvcmas.experiments import EXPERIMENT_MODULES, report, smoke
from kvcmas.experiments.accuracy import merge as acc_merge
from kvcmas.experiments.accuracy import plan as acc_plan
from kvcmas.experiments.accuracy import report as acc_report
from kvcmas.experiments.accuracy import runs as acc_runs
from tests.fake_runs import fake_run, png_size

PROBLEM = {
    "prompt": 'def add(a, b):\n    """Return the sum of a and b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
}

# ----------------------------------------------------------------------------- workflows


@pytest.mark.parametrize("task", ["mmlu", "gsm8k", "humaneval"])
def test_task_roster_shape(task):
    wf = load_workflow(f"{task}-roster")
    assert wf.name == f"{task}-roster"
    assert len(wf.agents) == 4 and wf.final == wf.agents[-1].name
    assert wf.inputs() == ["query"]
    task_names = [a.name for a in wf.agents[:3]]
    for i, agent in enumerate(wf.agents):
        assert agent.slots == ["query", *task_names[:i]]  # the query and every earlier agent
    assert list(wf.order) == [a.name for a in wf.agents]
    spec = TASKS[task]
    assert [a.max_new_tokens for a in wf.agents] == [spec.task_tokens] * 3 + [spec.final_tokens]


@pytest.mark.parametrize("task", ["mmlu", "gsm8k", "humaneval"])
def test_slots_start_lines(task):
    for agent in task_workflow(task).agents:
        for m in SLOT_PATTERN.finditer(agent.prompt):
            assert m.start() == 0 or agent.prompt[m.start() - 1] == "\n", agent.name
            end = m.end()
            assert end == len(agent.prompt) or agent.prompt[end] == "\n", agent.name


@pytest.mark.parametrize(
    "task, needles",
    [
        ("mmlu", ["\nAnswer: X\n", "A, B, C or D"]),
        ("gsm8k", ["\nAnswer: <number>\n", "number only"]),
        ("humaneval", ["```python", "complete function"]),
    ],
)
def test_final_prompt_states_answer_format(task, needles):
    wf = task_workflow(task)
    final = wf.agent(wf.final).prompt
    for needle in needles:
        assert needle in final
    # the format comes after the team's notes, right before the model answers
    assert final.rindex(needles[0]) > final.rindex("{")
    for agent in wf.agents[:3]:
        assert needles[0] not in agent.prompt


def test_mmlu_judge_reply_opens_with_the_answer_marker():
    """The judge's 2-token reply after the ``Answer:`` prefix is exactly what the scorer reads;
    a continuation past the letter is still malformed."""
    judge = task_workflow("mmlu").agent("judge")
    assert judge.reply_prefix == "Answer:" and judge.max_new_tokens == 2
    assert extract_answer("mmlu", {}, judge.reply_prefix + " B.") == "B"
    assert extract_answer("mmlu", {}, judge.reply_prefix + " B. Paris") is None
    assert all(not a.reply_prefix for a in task_workflow("gsm8k").agents)


def test_budget_overrides():
    wf = task_workflow("gsm8k", task_tokens=5, final_tokens=7)
    assert [a.max_new_tokens for a in wf.agents] == [5, 5, 5, 7]
    # overrides cap: a quick run keeps MMLU's 2-token judge
    wf = task_workflow("mmlu", task_tokens=8, final_tokens=24)
    assert [a.max_new_tokens for a in wf.agents] == [8, 8, 8, 2]
    with pytest.raises(ValueError, match="no task workflow"):
        task_workflow("arc")


# ----------------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The capital is Paris.\nAnswer: B", True),
        ("Answer: C", False),
        ("I think it is B.", False),  # no answer line: strict
        ("Answer: B. Paris", False),  # malformed answer line
    ],
)
def test_score_mmlu(text, expected):
    assert score("mmlu", {"gold": "B"}, text) is expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 + 4 = 7\nAnswer: 7", True),
        ("Answer: $1,007.00", False),
        ("Answer: 8", False),
        ("", False),
    ],
)
def test_score_gsm8k(text, expected):
    assert score("gsm8k", {"gold": "7"}, text) is expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("```python\ndef add(a, b):\n    return a + b\n```", True),
        ("```python\ndef add(a, b):\n    return a - b\n```", False),
        ("```python\ndef add(a, b)\n    return a +\n```", False),  # does not compile
    ],
)
def test_score_humaneval(text, expected):
    assert score("humaneval", {"problem": PROBLEM}, text) is expected


def test_score_unknown_task():
    with pytest.raises(ValueError, match="no scorer"):
        score("trivia", {"gold": "x"}, "Answer: x")


def test_extract_answer_for_agreement():
    assert extract_answer("mmlu", {}, "Answer: D") == "D"
    assert extract_answer("mmlu", {}, "D") is None
    assert extract_answer("gsm8k", {}, "so 12.\nAnswer: 12") == "12"
    code = extract_answer("humaneval", {"problem": PROBLEM}, "```python\nreturn 1\n```")
    assert code.startswith(PROBLEM["prompt"])


# ----------------------------------------------------------------------------- writers


def _method_summary(acc: float, agree: float | None, n: int = 4, ttft: float = 0.2) -> dict:
    """A per-benchmark summary as ``runs.run_one`` makes it: eval.summary figures of a run
    plus the task figures."""
    served = 0 if agree is None else 80
    return {
        **run_summary(fake_run(ttft, 3.0, 2.0, served, requests=n)),
        "items": n,
        "correct": round(acc * n),
        "accuracy": acc,
        "agreement": agree,
        "same_text_rate": agree,
        "unparsed_rate": 0.25,
        "peak_rss_bytes": 900 * 2**20,
        "method_state_bytes": 2048,
        "new_tokens_per_item": 50.0,
        "s_per_item": 3.0,
    }


def synthetic_results() -> dict:
    workflows = {
        t: {"name": f"{t}-roster", "max_new_tokens": {"a": 8, "b": 8, "c": 8, "judge": 16}}
        for t in ("mmlu", "gsm8k")
    }
    results = {
        "setup": {
            "experiment": "accuracy",
            "model": "smollm2-135m",
            "dtype": "fp32",
            "reference": "NonShared fp32",
            "noise_floor": "nonshared-bf16",
            "decoding": "greedy",
            "sizes": {"mmlu": 4, "gsm8k": 4},
            "workflows": workflows,
            "fidelity": False,
            "machine": "test cpu, 2 logical cores, 1 torch threads",
        },
        "summary": {
            "nonshared": {"mmlu": _method_summary(0.5, None), "gsm8k": _method_summary(0.25, None)},
            "kvcmas": {"mmlu": _method_summary(0.75, 0.75), "gsm8k": _method_summary(0.25, 1.0)},
            "nonshared-bf16": {"mmlu": _method_summary(0.5, 0.5)},  # gsm8k not run yet
        },
        "items": {},
    }
    for task in ("mmlu", "gsm8k"):
        acc_runs.add_task_ratios(results["summary"], task)
    return results


def test_wilson_interval_of_known_cases():
    from kvcmas.eval.summary import wilson_interval

    # 15/60: centre (0.25 + 1.96^2/120) / (1 + 1.96^2/60) = 0.265, half-width 0.107.
    lo, hi = wilson_interval(15, 60)
    assert lo == pytest.approx(0.1578, abs=1e-4) and hi == pytest.approx(0.3723, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) is None


def test_accuracy_table():
    table = acc_report.markdown_table(synthetic_results())
    assert "smollm2-135m (fp32)" in table and "4 MMLU, 4 GSM8K" in table
    assert "test cpu" in table
    main, efficiency = table.split("## Reuse")
    rows = {line.split(" | ")[0][2:]: line for line in main.splitlines() if line.startswith("| ")}
    assert rows["method"].count("acc") == 2
    # Each share with its 95% Wilson interval: 2/4 -> 0.15-0.85, 3/4 -> 0.30-0.95, 1/4 ->
    # 0.05-0.70, 4/4 -> 0.51-1.00.
    assert "0.500 (2/4) [0.15-0.85] | ref" in rows["nonshared"]
    assert "0.750 (3/4) [0.30-0.95] | 0.75 [0.30-0.95]" in rows["kvcmas"]
    assert "0.250 (1/4) [0.05-0.70] | 1.00 [0.51-1.00]" in rows["kvcmas"]
    assert rows["nonshared-bf16"].endswith("| - | - |")  # a missing run is a dash, not a crash
    # rho beside recompute (all hops / 2+), TTFT all / 2+ and its ratio, latency, compute.
    assert (
        "| kvcmas | MMLU | 0.60 / 0.80 | 0.40 / 0.20 | 0.400 / 0.200 | 1.00 / 1.00 "
        "| 3.000 (1.00) | 8.0 (1.00) |"
    ) in efficiency
    assert "| nonshared | GSM8K | 0.00 / 0.00 | 1.00 / 1.00 |" in efficiency
    assert "| nonshared-bf16 | GSM8K" not in efficiency
    assert "## Fidelity" not in table  # not measured in this run


def test_accuracy_fidelity_table_gives_all_hops_and_later():
    results = synthetic_results()
    results["setup"]["fidelity"] = True
    for per_task in results["summary"].values():
        for m in per_task.values():
            m.update(kv_error_all_mean=0.02, kv_error_later_mean=0.03)
            m.update(first_token_kl_all_mean=0.1, first_token_kl_later_mean=0.2)
            m.update(continuation_kl_all_mean=0.3, continuation_kl_later_mean=0.4)
            m.update(same_hop_output_all=0.75, same_hop_output_later=0.5)
    fidelity = acc_report.markdown_table(results).split("## Fidelity")[1]
    assert "| kvcmas | GSM8K | 0.0200 / 0.0300 | 0.1000 / 0.2000 | 0.3000 / 0.4000 " in fidelity
    assert "| 0.75 / 0.50 |" in fidelity


def test_accuracy_outputs_and_report(tmp_path: Path):
    results = synthetic_results()
    acc_report.write_outputs(results, tmp_path / "accuracy")
    assert png_size(tmp_path / "accuracy" / "accuracy.png") == (1320, 440)  # two 6x4 panels
    saved = json.loads((tmp_path / "accuracy" / "results.json").read_text())
    assert saved["summary"]["kvcmas"]["mmlu"]["rho_later"] == pytest.approx(0.8)
    assert acc_report.bar_value(results, "nonshared", "mmlu", "agreement") == 1.0
    assert acc_report.bar_value(results, "kvcmas", "gsm8k", "accuracy") == 0.25
    assert acc_report.bar_value(results, "nonshared-bf16", "gsm8k", "accuracy") == 0.0
    other = tmp_path / "nested" / "sweep"
    other.mkdir(parents=True)
    (other / "results.json").write_text(
        json.dumps({"setup": {"model": "m2", "dtype": "bf16", "machine": "x", "lengths": [8, 16]}})
    )
    (other / "table.md").write_text("# Sweep\n\n| a |\n|---|\n| 1 |\n")
    (other / "curve.png").write_bytes(b"\x89PNG")

    path = report.write_report(tmp_path)
    text = path.read_text()
    assert path == tmp_path / "REPORT.md"
    assert "| [accuracy](#accuracy) | accuracy | smollm2-135m | fp32 | mmlu 4, gsm8k 4 |" in text
    assert "| [nested/sweep](#nestedsweep) | sweep | m2 | bf16 | lengths 8,16 | x |" in text
    assert "### Sweep" in text and "### Task accuracy" in text  # headings moved under sections
    assert "![accuracy: accuracy](accuracy/accuracy.png)" in text
    assert "![nested/sweep: curve](nested/sweep/curve.png)" in text


def test_demote_headings():
    assert report.demote_headings("# A\n## B\ntext #1\n", 2) == "### A\n#### B\ntext #1\n"
    assert report.demote_headings("##### deep\n", 2) == "###### deep\n"


def test_plan_runs():
    runs = acc_plan.plan_runs(["kvcmas", "nonshared"], "fp32", noise_floor=True)
    assert [(r.label, r.method, r.dtype) for r in runs] == [
        ("nonshared", "nonshared", "fp32"),
        ("kvcmas", "kvcmas", "fp32"),
        ("nonshared-bf16", "nonshared", "bf16"),
    ]
    assert [r.label for r in acc_plan.plan_runs(["kvcmas"], "bf16", noise_floor=True)] == [
        "nonshared",
        "kvcmas",
    ]


def test_plan_from_args_checks_before_any_model_loads():
    from kvcmas.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "accuracy", "--benchmarks", "gsm8k", "--out", "x"])
    plan = acc_plan.plan_from_args(args)
    assert plan.benchmarks == ("gsm8k",) and plan.limits == {"gsm8k": 60}
    assert [r.label for r in plan.runs][0] == "nonshared"
    args = parser.parse_args(["bench", "accuracy", "--limit", "0", "--out", "x"])
    with pytest.raises(UsageError, match="--limit must be at least 1"):
        acc_plan.plan_from_args(args)
    args = parser.parse_args(["bench", "accuracy", "--tau", "0.5", "--methods", "fullshared",
                              "--out", "x"])  # fmt: skip
    with pytest.raises(UsageError, match="tau"):
        acc_plan.plan_from_args(args)  # no planned method takes tau


def test_the_noise_floors_fp32_gemms_are_planned_and_stated():
    from kvcmas.cli import build_parser

    parser = build_parser()
    argv = ["bench", "accuracy", "--out", "x"]
    assert acc_plan.plan_from_args(parser.parse_args(argv)).floor_gemm == "bf16"
    plan = acc_plan.plan_from_args(parser.parse_args([*argv, "--floor-gemm", "fp32"]))
    assert plan.floor_gemm == "fp32"
    results = synthetic_results()
    assert "fp32 over bf16" not in acc_report.markdown_table(results)
    results["summary"]["nonshared-bf16"]["mmlu"]["gemm_dtype"] = "fp32"  # as run_one records
    assert "NonShared in bf16 (matrix products in fp32 over bf16 weights" in (
        acc_report.markdown_table(results)
    )


def test_the_split_is_planned_checked_loaded_and_stated():
    """A calibration run reads MMLU's validation questions, disjoint from the test items; a
    benchmark without that split fails before any model loads."""
    from kvcmas.cli import build_parser

    parser = build_parser()
    argv = ["bench", "accuracy", "--benchmarks", "mmlu", "--limit", "5", "--out", "x"]
    test_plan = acc_plan.plan_from_args(parser.parse_args(argv))
    plan = acc_plan.plan_from_args(parser.parse_args([*argv, "--split", "validation"]))
    assert (test_plan.split, plan.split) == ("test", "validation")
    wrong = ["bench", "accuracy", "--benchmarks", "mmlu,humaneval", "--split", "validation"]
    with pytest.raises(UsageError, match="humaneval has no validation split"):
        acc_plan.plan_from_args(parser.parse_args([*wrong, "--out", "x"]))
    validation, test = acc_runs.plan_items(plan)["mmlu"], acc_runs.plan_items(test_plan)["mmlu"]
    assert len(validation) == 5 and all("/validation/" in r["id"] for r in validation)
    assert all("/test/" in r["id"] for r in test)
    assert not {r["id"] for r in validation} & {r["id"] for r in test}
    results = synthetic_results()
    assert "seeded shuffle of each test split" in acc_report.markdown_table(results)
    results["setup"]["split"] = "validation"
    assert "seeded shuffle of each validation split" in acc_report.markdown_table(results)


def _part(labels_tasks: dict[str, dict[str, list[str]]]) -> dict:
    """A split-run part: per label and task, the extracted answers of items i0, i1, ..."""
    base = synthetic_results()
    tasks = sorted({t for per in labels_tasks.values() for t in per})
    part = {
        "setup": {**base["setup"], "sizes": {t: 2 for t in tasks}},
        "summary": {},
        "items": {},
    }
    part["setup"]["workflows"] = {t: base["setup"]["workflows"][t] for t in tasks}
    for label, per_task in labels_tasks.items():
        for task, answers in per_task.items():
            records = [
                {"id": f"i{i}", "answer": a, "final_answer": f"Answer: {a}"}
                for i, a in enumerate(answers)
            ]
            part["items"].setdefault(label, {})[task] = records
            ttft = 0.4 if label == "nonshared" else 0.1
            part["summary"].setdefault(label, {})[task] = _method_summary(0.5, None, 2, ttft)
    return part


def test_merge_split_runs_recomputes_agreement_against_nonshared():
    a = _part({"nonshared": {"mmlu": ["A", "B"], "gsm8k": ["1", "2"]}})
    b = _part({"kvcmas": {"mmlu": ["A", "C"], "gsm8k": ["1", "2"]}})
    c = _part({"cacheblend": {"mmlu": ["D", "C"]}, "nonshared-bf16": {"mmlu": ["A", "B"]}})
    merged = acc_merge.merge_reports([c, b, a])
    assert list(merged["summary"]) == ["nonshared", "kvcmas", "cacheblend", "nonshared-bf16"]
    assert merged["setup"]["sizes"] == {"mmlu": 2, "gsm8k": 2}
    s = merged["summary"]
    assert s["kvcmas"]["mmlu"]["agreement"] == 0.5 and s["kvcmas"]["gsm8k"]["agreement"] == 1.0
    assert s["cacheblend"]["mmlu"]["agreement"] == 0.0
    assert s["nonshared-bf16"]["mmlu"]["agreement"] == 1.0
    assert s["kvcmas"]["mmlu"]["ttft_later_ratio"] == pytest.approx(0.25)
    assert s["kvcmas"]["mmlu"]["ttft_all_ratio"] == pytest.approx((1 + 0.3) / (1 + 1.2))
    assert "gsm8k" not in s["cacheblend"]


def test_merge_keeps_each_parts_method_options_per_label():
    """Parts run with other options (graded KVCMAS beside default CacheBlend) merge; each label
    keeps only the options its own part gave and its method takes, and the table says so."""
    a = _part({"nonshared": {"mmlu": ["A", "B"]}, "cacheblend": {"mmlu": ["A", "C"]}})
    b = _part({"kvcmas": {"mmlu": ["A", "C"]}})
    a["setup"]["method_params"] = {"ratio": "0.15"}
    b["setup"]["method_params"] = {"repair_max": "0.1", "ratio": "0.3"}  # ratio: not KVCMAS's
    merged = acc_merge.merge_reports([a, b])
    assert merged["setup"]["label_options"] == {
        "cacheblend": {"ratio": "0.15"},
        "kvcmas": {"repair_max": "0.1"},
    }
    assert "method_params" not in merged["setup"]
    assert merged["summary"]["kvcmas"]["mmlu"]["agreement"] == 0.5
    table = acc_report.markdown_table(merged)
    given = "cacheblend ratio=0.15; kvcmas repair_max=0.1."
    assert f"options set (the rest at their defaults): {given}" in table
    again = acc_merge.merge_reports([merged])  # a merged report merges again unchanged
    assert again["setup"]["label_options"] == merged["setup"]["label_options"]


def test_a_labelled_part_merges_as_its_own_row_of_its_method():
    """Two KVCMAS parts with different options merge as two rows when one has --label: the
    labelled row follows its method's, and its options are read as KVCMAS's."""
    from kvcmas.cli import build_parser

    parser = build_parser()
    argv = ["bench", "accuracy", "--methods", "kvcmas", "--without-nonshared", "--out", "x"]
    plan = acc_plan.plan_from_args(parser.parse_args([*argv, "--label", "kvcmas-head40"]))
    assert [(r.label, r.method) for r in plan.runs] == [
        ("kvcmas-head40", "kvcmas"), ("nonshared-bf16", "nonshared")
    ]  # fmt: skip
    for label in ("kvcmas", "nonshared-bf16", "cacheblend"):
        with pytest.raises(UsageError, match="another row's name"):
            acc_plan.plan_from_args(parser.parse_args([*argv, "--label", label]))
    two = ["bench", "accuracy", "--methods", "kvcmas,cacheblend", "--label", "x", "--out", "x"]
    with pytest.raises(UsageError, match="the one method a part runs"):
        acc_plan.plan_from_args(parser.parse_args(two))

    a = _part({"nonshared": {"mmlu": ["A", "B"]}, "nonshared-bf16": {"mmlu": ["A", "C"]}})
    b = _part({"kvcmas": {"mmlu": ["A", "C"]}})
    c = _part({"kvcmas-head40": {"mmlu": ["A", "B"]}, "cacheblend": {"mmlu": ["C", "C"]}})
    b["setup"]["method_params"] = {"repair_max": "0.1"}
    c["setup"]["method_params"] = {"repair_max": "0.1", "repair_head": "40", "ratio": "0.3"}
    c["setup"]["label_methods"] = {"kvcmas-head40": "kvcmas", "cacheblend": "cacheblend"}
    with pytest.raises(UsageError, match="give one part --label"):
        acc_merge.merge_reports([a, b, _part({"kvcmas": {"mmlu": ["A", "B"]}})])
    merged = acc_merge.merge_reports([c, b, a])
    assert list(merged["summary"]) == [
        "nonshared", "kvcmas", "kvcmas-head40", "cacheblend", "nonshared-bf16"
    ]  # fmt: skip
    assert merged["summary"]["kvcmas-head40"]["mmlu"]["agreement"] == 1.0
    assert merged["setup"]["label_options"]["kvcmas-head40"] == {
        "repair_max": "0.1", "repair_head": "40"
    }  # fmt: skip
    again = acc_merge.merge_reports([merged])
    assert list(again["summary"]) == list(merged["summary"])
    assert again["setup"]["label_options"] == merged["setup"]["label_options"]


def test_merge_gives_no_ratio_across_machines():
    """A part run on another machine keeps its accuracy and agreement but not its timing
    ratios to NonShared; merging the merge again keeps that."""
    a = _part({"nonshared": {"mmlu": ["A", "B"]}, "kvcmas": {"mmlu": ["A", "C"]}})
    b = _part({"cacheblend": {"mmlu": ["A", "B"]}})
    a["setup"]["machine"], b["setup"]["machine"] = "cpu (x86_64, AVX512-BF16)", "cpu (x86_64, AVX2)"
    merged = acc_merge.merge_reports([a, b])
    s = merged["summary"]
    assert s["kvcmas"]["mmlu"]["ttft_later_ratio"] == pytest.approx(0.25)
    assert s["cacheblend"]["mmlu"]["agreement"] == 1.0
    assert all(s["cacheblend"]["mmlu"][key] is None for key in RATIO_KEYS)
    assert "Timed on another machine than NonShared" in acc_report.markdown_table(merged)
    again = acc_merge.merge_reports([merged])
    assert again["summary"]["cacheblend"]["mmlu"]["ttft_later_ratio"] is None
    assert again["setup"]["label_machines"]["cacheblend"] == "cpu (x86_64, AVX2)"
    same = acc_merge.merge_reports(
        [a, {**b, "setup": {**b["setup"], "machine": "cpu (x86_64, AVX512-BF16)"}}]
    )
    assert "label_machines" not in same["setup"]
    assert same["summary"]["cacheblend"]["mmlu"]["ttft_later_ratio"] == pytest.approx(0.25)


def test_merge_refuses_parts_that_do_not_fit():
    a = _part({"nonshared": {"mmlu": ["A", "B"]}})
    with pytest.raises(UsageError, match="none of the merged runs holds NonShared"):
        acc_merge.merge_reports([_part({"kvcmas": {"mmlu": ["A", "B"]}})])
    with pytest.raises(UsageError, match="appears in two"):
        acc_merge.merge_reports([a, _part({"nonshared": {"mmlu": ["A", "B"]}})])
    other_dtype = _part({"kvcmas": {"mmlu": ["A", "B"]}})
    other_dtype["setup"]["dtype"] = "bf16"
    with pytest.raises(UsageError, match="different dtype"):
        acc_merge.merge_reports([a, other_dtype])
    more_items = _part({"kvcmas": {"mmlu": ["A", "B"]}})
    more_items["setup"]["sizes"]["mmlu"] = 3
    with pytest.raises(UsageError, match="2 and 3 mmlu items"):
        acc_merge.merge_reports([a, more_items])
    calibration = _part({"kvcmas": {"mmlu": ["A", "B"]}})
    calibration["setup"]["split"] = "validation"  # a part without "split" ran on test
    with pytest.raises(UsageError, match="different splits"):
        acc_merge.merge_reports([a, calibration])
    other_ids = _part({"kvcmas": {"mmlu": ["A", "B"]}})
    other_ids["items"]["kvcmas"]["mmlu"][1]["id"] = "x"
    with pytest.raises(UsageError, match="other items than NonShared"):
        acc_merge.merge_reports([a, other_ids])


def test_plan_runs_without_nonshared():
    runs = acc_plan.plan_runs(["kvcomm"], "fp32", noise_floor=True, with_nonshared=False)
    assert [r.label for r in runs] == ["kvcomm", "nonshared-bf16"]


# ----------------------------------------------------------------------------- smoke


def test_smoke_plan(tmp_path: Path):
    modules = {
        "accuracy": "kvcmas.experiments.accuracy",
        "plain": "kvcmas.eval.tasks",  # no smoke_args
        "missing": "kvcmas.experiments.no_such_module",
        "report": "kvcmas.experiments.report",
        "smoke": "kvcmas.experiments.smoke",
    }
    steps = smoke.smoke_plan(tmp_path, modules, workflow_path=tmp_path / "wf.json")
    assert [s.name for s in steps] == ["compare", "accuracy", "plain", "missing", "report"]
    compare, acc, plain, missing, final = steps
    assert compare.argv[:2] == ["bench", "compare"]
    assert compare.argv[compare.argv.index("--workflow") + 1] == str(tmp_path / "wf.json")
    assert compare.argv[compare.argv.index("--methods") + 1] == "nonshared,fullshared,kvcmas,kvcomm"
    assert compare.argv[-2:] == ["--out", str(tmp_path / "compare")]
    assert compare.argv[compare.argv.index("--limit") + 1] == "3"
    assert acc.argv[:2] == ["bench", "accuracy"]
    assert acc.argv[-2:] == ["--out", str(tmp_path / "accuracy")]
    assert plain.argv is None and "no smoke_args" in plain.note and plain.status == "skipped"
    assert missing.argv is None and "cannot import" in missing.note
    assert final.argv == ["bench", "report", str(tmp_path)]


def test_smoke_argv_parses(tmp_path: Path):
    """Every smoke step's argv is accepted by the real command line."""
    from kvcmas.cli import build_parser

    wf = smoke.write_smoke_workflow(tmp_path)
    assert load_workflow(str(wf)).name == "roster-smoke"
    parser = build_parser()
    for step in smoke.smoke_plan(tmp_path, workflow_path=wf):
        if step.argv is not None:
            args = parser.parse_args(step.argv)
            assert callable(args.func)
    assert {"accuracy", "report", "smoke"} <= set(EXPERIMENT_MODULES)


def test_agreement_rule():
    base = {"answer": "B", "final_answer": "Answer: B"}
    assert acc_runs.same_answer({"answer": "B", "final_answer": "So B.\nAnswer: B"}, base)
    assert not acc_runs.same_answer({"answer": "C", "final_answer": "Answer: C"}, base)
    unreadable = {"answer": None, "final_answer": "A. Paris"}
    assert not acc_runs.same_answer(unreadable, base)
    assert acc_runs.same_answer(dict(unreadable), unreadable)  # the very same text
    assert not acc_runs.same_answer({"answer": None, "final_answer": "B. Paris"}, unreadable)


def test_smoke_steps_run_the_cli_in_a_child_process(tmp_path: Path):
    """A step is the command a user would type, in its own process: its exit status is the
    step's verdict (here: report on an empty folder fails, on a results folder passes)."""
    import sys

    empty = tmp_path / "empty"
    empty.mkdir()
    failing = smoke.SmokeStep("report", ["bench", "report", str(empty)])
    assert smoke.step_command(failing) == [
        sys.executable, "-m", "kvcmas.cli", "bench", "report", str(empty)
    ]  # fmt: skip
    smoke.run_step(failing)
    assert (failing.status, failing.note) == ("failed", "exit status 2")
    (empty / "results.json").write_text(json.dumps({"setup": {"model": "m"}}))
    passing = smoke.SmokeStep("report", ["bench", "report", str(empty)])
    smoke.run_step(passing)
    assert passing.status == "passed" and (empty / "REPORT.md").is_file()
