"""Task rosters, the ``score`` dispatch, the accuracy table and report writers, and the smoke
orchestrator's plan. No model runs: the results dicts here are hand-made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcmas.bench.experiments import EXPERIMENT_MODULES, accuracy, report, smoke
from kvcmas.bench.tasks import TASKS, extract_answer, score, task_workflow
from kvcmas.chat import SLOT_PATTERN
from kvcmas.cli import UsageError
from kvcmas.workflow.spec import load_workflow

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


def _method_summary(acc: float, agree: float | None, n: int = 4) -> dict:
    return {
        "items": n,
        "correct": round(acc * n),
        "accuracy": acc,
        "agreement": agree,
        "same_text_rate": agree,
        "unparsed_rate": 0.25,
        "reuse_ratio_tokens": 0.0 if agree is None else 0.8,
        "ttft_nonfirst_mean_s": 0.2,
        "ttft_ratio_vs_nonshared": 1.0,
        "peak_state_bytes": 3 * 2**20,
        "peak_rss_bytes": 900 * 2**20,
        "pool_bytes": 2048,
        "new_tokens_per_item": 50.0,
        "s_per_item": 3.0,
    }


def synthetic_results() -> dict:
    workflows = {
        t: {"name": f"{t}-roster", "max_new_tokens": {"a": 8, "b": 8, "c": 8, "judge": 16}}
        for t in ("mmlu", "gsm8k")
    }
    return {
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


def test_accuracy_table():
    table = accuracy.markdown_table(synthetic_results())
    assert "smollm2-135m (fp32)" in table and "4 MMLU, 4 GSM8K" in table
    assert "test cpu" in table
    main, efficiency = table.split("## Reuse")
    rows = {line.split(" | ")[0][2:]: line for line in main.splitlines() if line.startswith("| ")}
    assert rows["method"].count("acc") == 2
    assert "0.500 (2/4) | ref" in rows["nonshared"]
    assert "0.750 (3/4) | 0.75" in rows["kvcmas"] and "0.250 (1/4) | 1.00" in rows["kvcmas"]
    assert rows["nonshared-bf16"].endswith("| - | - |")  # a missing run is a dash, not a crash
    assert "| kvcmas | MMLU | 0.80 |" in efficiency
    assert "| nonshared-bf16 | GSM8K" not in efficiency


def test_accuracy_outputs_and_report(tmp_path: Path):
    results = synthetic_results()
    accuracy.write_outputs(results, tmp_path / "accuracy")
    assert (tmp_path / "accuracy" / "accuracy.png").stat().st_size > 1000
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
    runs = accuracy.plan_runs(["kvcmas", "nonshared"], "fp32", noise_floor=True)
    assert runs == [
        ("nonshared", "nonshared", "fp32"),
        ("kvcmas", "kvcmas", "fp32"),
        ("nonshared-bf16", "nonshared", "bf16"),
    ]
    assert len(accuracy.plan_runs(["kvcmas"], "bf16", noise_floor=True)) == 2


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
            part["summary"].setdefault(label, {})[task] = {
                **_method_summary(0.5, None, n=2),
                "ttft_nonfirst_mean_s": 0.4 if label == "nonshared" else 0.1,
            }
    return part


def test_merge_split_runs_recomputes_agreement_against_nonshared():
    a = _part({"nonshared": {"mmlu": ["A", "B"], "gsm8k": ["1", "2"]}})
    b = _part({"kvcmas": {"mmlu": ["A", "C"], "gsm8k": ["1", "2"]}})
    c = _part({"cacheblend": {"mmlu": ["D", "C"]}, "nonshared-bf16": {"mmlu": ["A", "B"]}})
    merged = accuracy.merge_reports([c, b, a])
    assert list(merged["summary"]) == ["nonshared", "kvcmas", "cacheblend", "nonshared-bf16"]
    assert merged["setup"]["sizes"] == {"mmlu": 2, "gsm8k": 2}
    s = merged["summary"]
    assert s["kvcmas"]["mmlu"]["agreement"] == 0.5 and s["kvcmas"]["gsm8k"]["agreement"] == 1.0
    assert s["cacheblend"]["mmlu"]["agreement"] == 0.0
    assert s["nonshared-bf16"]["mmlu"]["agreement"] == 1.0
    assert s["kvcmas"]["mmlu"]["ttft_ratio_vs_nonshared"] == 0.25
    assert "gsm8k" not in s["cacheblend"]


def test_merge_refuses_parts_that_do_not_fit():
    a = _part({"nonshared": {"mmlu": ["A", "B"]}})
    with pytest.raises(UsageError, match="none of the merged runs holds NonShared"):
        accuracy.merge_reports([_part({"kvcmas": {"mmlu": ["A", "B"]}})])
    with pytest.raises(UsageError, match="appears in two"):
        accuracy.merge_reports([a, _part({"nonshared": {"mmlu": ["A", "B"]}})])
    other_dtype = _part({"kvcmas": {"mmlu": ["A", "B"]}})
    other_dtype["setup"]["dtype"] = "bf16"
    with pytest.raises(UsageError, match="different dtype"):
        accuracy.merge_reports([a, other_dtype])
    more_items = _part({"kvcmas": {"mmlu": ["A", "B"]}})
    more_items["setup"]["sizes"]["mmlu"] = 3
    with pytest.raises(UsageError, match="2 and 3 mmlu items"):
        accuracy.merge_reports([a, more_items])
    other_ids = _part({"kvcmas": {"mmlu": ["A", "B"]}})
    other_ids["items"]["kvcmas"]["mmlu"][1]["id"] = "x"
    with pytest.raises(UsageError, match="other items than NonShared"):
        accuracy.merge_reports([a, other_ids])


def test_plan_runs_without_nonshared():
    runs = accuracy.plan_runs(["kvcomm"], "fp32", noise_floor=True, with_nonshared=False)
    assert runs == [("kvcomm", "kvcomm", "fp32"), ("nonshared-bf16", "nonshared", "bf16")]


# ----------------------------------------------------------------------------- smoke


def test_smoke_plan(tmp_path: Path):
    modules = {
        "accuracy": "kvcmas.bench.experiments.accuracy",
        "plain": "kvcmas.bench.tasks",  # no smoke_args
        "missing": "kvcmas.bench.experiments.no_such_module",
        "report": "kvcmas.bench.experiments.report",
        "smoke": "kvcmas.bench.experiments.smoke",
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
    assert accuracy.same_answer({"answer": "B", "final_answer": "So B.\nAnswer: B"}, base)
    assert not accuracy.same_answer({"answer": "C", "final_answer": "Answer: C"}, base)
    unreadable = {"answer": None, "final_answer": "A. Paris"}
    assert not accuracy.same_answer(unreadable, base)
    assert accuracy.same_answer(dict(unreadable), unreadable)  # the very same text
    assert not accuracy.same_answer({"answer": None, "final_answer": "B. Paris"}, unreadable)
