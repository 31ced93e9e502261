"""Hand-made cases for the strict scorers and the HumanEval sandbox (offline, no data files)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvcmas.eval import scoring
from kvcmas.eval.sandbox import run_python
from kvcmas.eval.scoring import (
    extract_code,
    extract_final_number,
    extract_mmlu_letter,
    normalize_number,
    run_humaneval,
    score_gsm8k,
    score_mmlu,
)

# ----------------------------------------------------------------------------- MMLU


@pytest.mark.parametrize(
    "text, letter",
    [
        ("Answer: B", "B"),
        ("Some reasoning.\nAnswer: C\n", "C"),
        ("answer: D", "D"),
        ("ANSWER: A", "A"),
        ("Answer: (B)", "B"),
        ("Answer: [B]", "B"),
        ("Answer: B.", "B"),
        ("Answer:B", "B"),
        ("**Answer: B**", "B"),
        ("**Answer:** B", "B"),
        ("**Answer**: (D)", "D"),
        ("Answer: **C**", "C"),
        ("### Final Answer: A", "A"),
        ("  Answer: B  \r\n", "B"),
    ],
)
def test_mmlu_accepted_forms(text: str, letter: str) -> None:
    assert extract_mmlu_letter(text) == letter


@pytest.mark.parametrize(
    "text",
    [
        "",
        "B",
        "The answer is B.",
        "I think (B) is right because B explains it best.",
        "After careful thought, B",
        "Because the final Answer: B",  # marker not at the start of a line
        "Answer: B. Paris",  # extra text on the answer line
        "Answer: I think B",
        "Answer: (B) Paris",
        "Answer: E",  # outside A-D
        "Answer: b",  # lowercase letter
        "Answer:",
        "Answers: B",
        "Answer choices: A, B, C, D",
    ],
)
def test_mmlu_malformed_is_none(text: str) -> None:
    assert extract_mmlu_letter(text) is None


def test_mmlu_letter_only_in_prose_is_none() -> None:
    text = "Option B seems best. Between A and D, I'd go with B for the reasons above."
    assert extract_mmlu_letter(text) is None
    assert not score_mmlu(text, "B")


def test_mmlu_last_answer_line_wins() -> None:
    assert extract_mmlu_letter("Answer: A\nWait, let me reconsider.\nAnswer: C") == "C"
    # The last answer line decides even when malformed: no fallback to an earlier one.
    assert extract_mmlu_letter("Answer: A\nAnswer: not sure") is None


def test_mmlu_extra_letters_for_arc() -> None:
    assert extract_mmlu_letter("Answer: E", letters="ABCDE") == "E"


def test_score_mmlu() -> None:
    assert score_mmlu("Reasoning...\nAnswer: (C)", "C")
    assert score_mmlu("Answer: C", "c")
    assert not score_mmlu("Answer: A", "C")
    assert not score_mmlu("C", "C")


# ----------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("18", "18"),
        ("18.00", "18"),
        ("18.0", "18"),
        ("18.", "18"),
        ("$1,234.50", "1234.5"),
        ("1,450,000", "1450000"),
        ("-3", "-3"),
        ("0.25", "0.25"),
        ("abc", None),
    ],
)
def test_normalize_number(raw: str, norm: str | None) -> None:
    assert normalize_number(raw) == norm


@pytest.mark.parametrize(
    "text, number",
    [
        ("Answer: 42", "42"),
        ("She makes 9 * 2 = 18 dollars.\nAnswer: $18", "18"),
        ("Answer: $1,234.50", "1234.5"),
        ("**Answer:** 18.00", "18"),
        ("Answer: 18.", "18"),
        ("Answer: -7", "-7"),
        ("Answer:\n\n 42 apples\n", "42"),  # number on the next non-empty line
        ("Answer: 5\nHmm, no.\nAnswer: 7 in total, not 5", "7"),  # last answer line wins
        ("Answer: 5\nso the final answer: 7", "5"),  # a marker must start its line
        ("Answer: 12\nAnswer: 3", "3"),
        ("First 3 + 4 = 7, then 7 * 2 = 14. So the answer is 14.", "14"),  # no marker: last
        ("The total is 1,000 dollars", "1000"),
        ("It costs -$5 now", "-5"),
        ("from 10 - 5", "5"),  # a spaced minus is an operator, not a sign
        ("no numbers here", None),
        ("Answer: unknown", None),  # a marker without a number: no fallback
        ("", None),
    ],
)
def test_extract_final_number(text: str, number: str | None) -> None:
    assert extract_final_number(text) == number


def test_score_gsm8k() -> None:
    assert score_gsm8k("Answer: 18.00", "18")
    assert score_gsm8k("Answer: $1,234", "1234")
    assert score_gsm8k("Answer: 1234", "1,234")
    assert score_gsm8k("Answer: 0.5", 0.5)
    assert not score_gsm8k("Answer: 19", "18")
    assert not score_gsm8k("Answer: unknown", "18")
    assert not score_gsm8k("Answer: 18.00001", "18")  # beyond the 1e-6 tolerance
    assert score_gsm8k("Answer: 18.0000001", "18")


# ----------------------------------------------------------------------------- HumanEval

PROBLEM = {
    "id": "Toy/0",
    "prompt": (
        "from typing import List\n\n\n"
        "def _helper(x: int) -> int:\n"
        "    return x\n\n\n"
        "def add_all(xs: List[int]) -> int:\n"
        '    """Sum of the list.\n'
        "    >>> add_all([1, 2])\n"
        "    3\n"
        '    """\n'
    ),
    "entry_point": "add_all",
    "test": (
        "\n\ndef check(candidate):\n"
        "    assert candidate([1, 2]) == 3\n"
        "    assert candidate([]) == 0\n"
        "    assert candidate([-1, 5, 7]) == 11\n"
    ),
    "canonical_solution": "    return sum(xs)\n",
}


def test_extract_code_body_gets_prompt() -> None:
    code = extract_code("    return sum(xs)\n", PROBLEM["prompt"], "add_all")
    assert code.startswith(PROBLEM["prompt"])
    assert code.endswith("    return sum(xs)\n")


def test_extract_code_fenced_full_function_gets_preamble_only() -> None:
    text = (
        "Here is my solution:\n```python\ndef add_all(xs: List[int]) -> int:\n"
        "    return sum(map(_helper, xs))\n```\nAnd a test:\n```python\nprint(1)\n```"
    )
    code = extract_code(text, PROBLEM["prompt"], "add_all")
    assert "from typing import List" in code and "def _helper" in code
    assert code.count("def add_all") == 1
    assert "print(1)" not in code and "Here is" not in code


def test_extract_code_plain_fence_and_unclosed_fence() -> None:
    full = "def add_all(xs):\n    return sum(xs)\n"
    assert "return sum(xs)" in extract_code("```\n" + full + "```", PROBLEM["prompt"], "add_all")
    assert "return sum(xs)" in extract_code("```python\n" + full, PROBLEM["prompt"], "add_all")


def test_humaneval_correct_passes() -> None:
    result = run_humaneval(PROBLEM, PROBLEM["canonical_solution"])
    assert result["passed"] and result["status"] == "passed", result
    fenced = "```python\ndef add_all(xs: List[int]) -> int:\n    return sum(xs)\n```"
    assert run_humaneval(PROBLEM, fenced)["passed"]


def test_humaneval_wrong_fails() -> None:
    result = run_humaneval(PROBLEM, "    return len(xs)\n")
    assert not result["passed"] and result["status"] == "failed"
    assert "AssertionError" in result["detail"]


def test_humaneval_infinite_loop_times_out() -> None:
    start = time.monotonic()
    result = run_humaneval(PROBLEM, "    while True:\n        pass\n", timeout_s=2.0)
    elapsed = time.monotonic() - start
    assert result == {"passed": False, "status": "timeout", "detail": result["detail"]}
    assert elapsed < 2.0 + 4.0


def test_humaneval_sleep_times_out() -> None:
    start = time.monotonic()
    result = run_humaneval(PROBLEM, "    import time\n    time.sleep(60)\n", timeout_s=1.0)
    assert result["status"] == "timeout"
    assert time.monotonic() - start < 1.0 + 4.0


@pytest.mark.parametrize(
    "attack",
    [
        "    import os\n    os.remove({path!r})\n    return sum(xs)\n",
        "    import os\n    os.unlink({path!r})\n    return sum(xs)\n",
        "    import pathlib\n    pathlib.Path({path!r}).unlink()\n    return sum(xs)\n",
        "    import shutil\n    shutil.rmtree({dir!r})\n    return sum(xs)\n",
        "    open({path!r}, 'w').write('gone')\n    return sum(xs)\n",
        "    import os\n    os.system('rm -f ' + {path!r})\n    return sum(xs)\n",
        "    import subprocess\n    subprocess.run(['rm', '-f', {path!r}])\n    return sum(xs)\n",
        "    import os\n    os.rename({path!r}, {path!r} + '.moved')\n    return sum(xs)\n",
    ],
)
def test_humaneval_file_system_is_guarded(tmp_path: Path, attack: str) -> None:
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    completion = attack.format(path=str(victim), dir=str(tmp_path))
    result = run_humaneval(PROBLEM, completion, timeout_s=5.0)
    assert not result["passed"] and result["status"] == "failed", result
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_humaneval_new_file_is_not_created(tmp_path: Path) -> None:
    target = tmp_path / "new.txt"
    completion = f"    with open({str(target)!r}, 'x') as fh:\n        fh.write('x')\n"
    result = run_humaneval(PROBLEM, completion + "    return sum(xs)\n")
    assert result["status"] == "failed"
    assert not target.exists()


@pytest.mark.parametrize(
    "attack",
    [
        "    import socket\n    socket.socket()\n    return sum(xs)\n",
        "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return sum(xs)\n",
        "    import urllib.request\n    urllib.request.urlopen('http://127.0.0.1:9/')\n"
        "    return sum(xs)\n",
    ],
)
def test_humaneval_socket_is_guarded(attack: str) -> None:
    result = run_humaneval(PROBLEM, attack, timeout_s=5.0)
    assert not result["passed"] and result["status"] == "failed", result


def test_humaneval_syntax_error() -> None:
    result = run_humaneval(PROBLEM, "```python\ndef add_all(xs:\n    return sum(xs)\n```")
    assert not result["passed"] and result["status"] in {"error", "failed"}


def test_humaneval_early_exit_is_not_a_pass() -> None:
    for completion in (
        "    import sys\n    sys.exit(0)\n",
        "    import os\n    os._exit(0)\n",
        "    raise SystemExit(0)\n",
    ):
        result = run_humaneval(PROBLEM, completion)
        assert not result["passed"] and result["status"] == "failed", (completion, result)


def test_humaneval_memory_and_output_limits() -> None:
    assert run_humaneval(PROBLEM, "    x = [0] * (10 ** 10)\n")["status"] == "failed"
    assert run_humaneval(PROBLEM, "    print('x' * 10 ** 8)\n")["status"] == "failed"


# ----------------------------------------------------------------------------- the sandbox


def test_sandbox_is_its_own_module() -> None:
    # The scorers only compose the program; running it is the sandbox's one job.
    assert not hasattr(scoring, "subprocess") and not hasattr(scoring, "_CHILD")


def test_sandbox_runs_a_program_to_its_end() -> None:
    assert run_python("x = 1 + 1\nassert x == 2\n")["status"] == "passed"
    failed = run_python("assert 1 == 2, 'nope'\n")
    assert failed["status"] == "failed" and "nope" in failed["detail"]
    assert run_python("def f(:\n")["status"] == "error"  # does not compile
    assert run_python("import ctypes\n")["status"] == "failed"  # a refused import
