"""Task workflows of the paper's evaluation: three task agents and a decision agent per benchmark.

Each workflow is a :func:`~kvcmas.workflow.builtin.roster`: every task agent reads the question
and the outputs of the task agents before it, and the decision agent reads all three. Slots
start a line (METHOD.md section 2, rule 1). The decision agent is told the exact answer format
that the strict scorers of :mod:`kvcmas.eval.scoring` accept.

MMLU's judge has its reply opened with ``Answer:`` and a 2-token budget. SmolLM2-135M-Instruct
ignored the answer format when only told it (four phrasings, with and without an example or a
system-prompt rule: never an ``Answer: X`` line, so strict accuracy 0 for every method); left
to continue after the prefix it writes ``Answer: A. Centaurus``, which the strict scorer
rejects. With the prefix and budget it writes ``Answer: A`` or ``Answer: A.``; anything else
it writes there is still scored as malformed.

Token budgets (new tokens per hop), chosen so that 60 MMLU + 60 GSM8K + 30 HumanEval items
decode at most ~36k tokens per method. Measured with SmolLM2-135M in fp32 on one torch thread
per method (two methods at a time on the 2-core machine), NonShared took 7.6 / 17.5 / 22.7 s
per MMLU / GSM8K / HumanEval item: about 39 minutes per method.

========== ============ =============== =========================
benchmark  task agents  decision agent  most new tokens / request
========== ============ =============== =========================
mmlu       3 x 40       2 (+ prefix)    122
gsm8k      3 x 64       96              288
humaneval  3 x 64       192             384
========== ============ =============== =========================
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from kvcmas.eval.data import load_dataset
from kvcmas.eval.scoring import (
    extract_code,
    extract_final_number,
    extract_mmlu_letter,
    run_humaneval,
    score_gsm8k,
    score_mmlu,
)
from kvcmas.workflow import builtin
from kvcmas.workflow.builtin import roster
from kvcmas.workflow.spec import Workflow

Role = tuple[str, str, str]  # (agent name, system prompt, instruction after the context)


@dataclass(frozen=True)
class TaskSpec:
    """One benchmark's roster: three task roles, the decision role and their budgets."""

    name: str
    roles: tuple[Role, Role, Role]
    decider: Role
    answer_format: str  # the decision agent's output contract, as the scorer reads it
    task_tokens: int
    final_tokens: int
    final_reply_prefix: str = ""  # opens the decision agent's reply (see MMLU)
    splits: tuple[str, ...] = ("test",)  # the dataset's splits (kvcmas.eval.data_prepare)

    def workflow(self, task_tokens: int | None = None, final_tokens: int | None = None) -> Workflow:
        """The roster; overrides (for quick runs) cap the task's own budgets, so that a short
        run keeps MMLU's 2-token judge."""
        return roster(
            name=f"{self.name}-roster",
            roles=self.roles,
            decider=self.decider,
            task_tokens=min(task_tokens or self.task_tokens, self.task_tokens),
            final_tokens=min(final_tokens or self.final_tokens, self.final_tokens),
            final_reply_prefix=self.final_reply_prefix,
        )


MMLU_FORMAT = (
    "End your reply with a last line of the form\nAnswer: X\n"
    "where X is exactly one capital letter: A, B, C or D. Write nothing after that line."
)
GSM8K_FORMAT = (
    "End your reply with a last line of the form\nAnswer: <number>\n"
    "giving the number only, with no units and no words. Write nothing after that line."
)
HUMANEVAL_FORMAT = (
    "Reply with exactly one ```python code block that holds the complete function: its "
    "imports, its def line with the same name and arguments, and its body. "
    "Write nothing after the block."
)

MMLU = TaskSpec(
    name="mmlu",
    roles=(
        (
            "recaller",
            "You are a subject expert. You recall the facts, definitions and rules that a "
            "multiple-choice question depends on.",
            "State the facts that decide this question in two short sentences. "
            "Do not choose an option yet.",
        ),
        (
            "eliminator",
            "You are an exam strategist. You rule out wrong options one at a time.",
            "Using the facts above, name the options that are wrong and say why, "
            "one short line each.",
        ),
        (
            "reviewer",
            "You are a skeptical reviewer. You look for slips in other people's reasoning.",
            "Point out any mistake in the notes above and name the option you think is right.",
        ),
    ),
    decider=(
        "judge",
        "You are the final judge of a team that answers multiple-choice questions. "
        "You weigh the team's notes and pick one option.",
        "Choose the single best option. Reply with its letter only, as in\nAnswer: X\n"
        "where X is exactly one capital letter: A, B, C or D.",
    ),
    answer_format=MMLU_FORMAT,
    task_tokens=40,
    final_tokens=2,
    final_reply_prefix="Answer:",
    splits=("test", "validation"),
)

GSM8K = TaskSpec(
    name="gsm8k",
    roles=(
        (
            "extractor",
            "You read math word problems closely and pull out every quantity they give.",
            "List each quantity with what it counts, then state what must be found.",
        ),
        (
            "calculator",
            "You solve math word problems with short, exact calculations.",
            "Solve the problem step by step, one calculation per line, using the quantities above.",
        ),
        (
            "verifier",
            "You check the arithmetic and the logic of worked solutions.",
            "Redo each calculation above, correct any error, and state the result.",
        ),
    ),
    decider=(
        "judge",
        "You give the final answer to a math word problem after reviewing your team's work.",
        "Decide the final result. Use at most two short lines of reasoning. " + GSM8K_FORMAT,
    ),
    answer_format=GSM8K_FORMAT,
    task_tokens=64,
    final_tokens=96,
)

HUMANEVAL = TaskSpec(
    name="humaneval",
    roles=(
        (
            "specifier",
            "You are a software engineer who reads a Python function's signature and "
            "docstring and pins down exactly what it must do.",
            "Restate the required behaviour, the inputs, the output and the edge cases "
            "as a few short bullet points.",
        ),
        (
            "designer",
            "You are a Python programmer who designs simple, correct algorithms.",
            "Describe an algorithm for the function in a few numbered steps.",
        ),
        (
            "tracer",
            "You are a code reviewer who traces examples through an algorithm by hand.",
            "Trace one docstring example through the steps above and point out any bug.",
        ),
    ),
    decider=(
        "coder",
        "You write the final, working Python implementation from your team's notes.",
        "Implement the function. " + HUMANEVAL_FORMAT,
    ),
    answer_format=HUMANEVAL_FORMAT,
    task_tokens=64,
    final_tokens=192,
)

TASKS: dict[str, TaskSpec] = {t.name: t for t in (MMLU, GSM8K, HUMANEVAL)}


def task_spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"no task workflow for {task!r}: choose from {', '.join(TASKS)}")
    return TASKS[task]


def task_workflow(
    task: str, task_tokens: int | None = None, final_tokens: int | None = None
) -> Workflow:
    """The roster of ``task`` (``mmlu``, ``gsm8k`` or ``humaneval``)."""
    return task_spec(task).workflow(task_tokens, final_tokens)


def load_workflow(name_or_path: str) -> Workflow:
    """A workflow by name (the built-ins and the task rosters ``<task>-roster``) or file."""
    rosters = {f"{t}-roster": t for t in TASKS}
    if name_or_path in rosters:
        return task_workflow(rosters[name_or_path])
    return builtin.load_workflow(name_or_path, also_known=tuple(rosters))


@cache
def _humaneval_problems() -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in load_dataset("humaneval")}


def humaneval_problem(request: dict[str, Any]) -> dict[str, Any]:
    """The HumanEval problem of a request: carried as ``problem``, or looked up by ``gold``."""
    if "problem" in request:
        return request["problem"]
    problems = _humaneval_problems()
    key = request.get("gold", request.get("id"))
    if key not in problems:
        raise ValueError(f"unknown HumanEval task id {key!r}")
    return problems[key]


def score(task: str, request: dict[str, Any], final_answer: str) -> bool:
    """Strict correctness of a final answer: MMLU letter, GSM8K number, HumanEval unit tests."""
    if task == "mmlu":
        return score_mmlu(final_answer, request["gold"])
    if task == "gsm8k":
        return score_gsm8k(final_answer, request["gold"])
    if task == "humaneval":
        return run_humaneval(humaneval_problem(request), final_answer)["passed"]
    raise ValueError(f"no scorer for task {task!r}: choose from {', '.join(TASKS)}")


def extract_answer(task: str, request: dict[str, Any], final_answer: str) -> str | None:
    """What the scorer reads from a final answer (letter, number or program); None if none.

    Two methods agree on an item when they extract the same answer.
    """
    if task == "mmlu":
        return extract_mmlu_letter(final_answer)
    if task == "gsm8k":
        return extract_final_number(final_answer)
    if task == "humaneval":
        problem = humaneval_problem(request)
        return extract_code(final_answer, problem["prompt"], problem["entry_point"])
    raise ValueError(f"no answer extractor for task {task!r}: choose from {', '.join(TASKS)}")
