"""``kvcmas bench smoke --out DIR``: a small run of every experiment, then the report.

Runs ``kvcmas bench compare`` on three requests of a short-budget roster, then every
experiment registered in ``EXPERIMENT_MODULES`` whose module defines
``smoke_args(out_dir) -> list[str]`` (its small argv; experiments without one are skipped with
a message), each into ``DIR/<name>``, and finally ``kvcmas bench report DIR``. The steps run one
after the other; a failing step is reported and the rest still run. The whole smoke is sized to
finish in under 10 minutes on two CPU threads.

Each step runs as ``python -m kvcmas.cli ...`` in a child process: exactly the command a user
would type, without importing the command line (the layer above the experiments), and with
each step's memory, torch state and peak RSS its own, so that one step cannot skew or crash
the next. The cost is a second or two of imports per step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvcmas.experiments.common import str_list

HELP = "a small run of compare and of every registered experiment, then the report"
NOT_SMOKED = {"smoke", "report"}  # this command and the final step
COMPARE_METHODS = "nonshared,fullshared,kvcmas,kvcomm"
TIME_BUDGET_S = 600.0


@dataclass
class SmokeStep:
    name: str
    argv: list[str] | None  # the full ``kvcmas`` argv; None: skipped
    note: str = ""
    status: str = "pending"  # pending, passed, failed, skipped
    wall_s: float = 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for every experiment's subfolder")
    p.add_argument(
        "--only", type=str_list, default=None, help="comma-separated step names (compare, ...)"
    )


def write_smoke_workflow(out_dir: Path) -> Path:
    """The default roster with short budgets, as a workflow file that ``compare`` can read."""
    from kvcmas.workflow.builtin import roster

    workflow = roster(name="roster-smoke", task_tokens=8, final_tokens=16)
    data = {
        "name": workflow.name,
        "final": workflow.final,
        "agents": [
            {
                "name": a.name,
                "system": a.system,
                "prompt": a.prompt,
                "max_new_tokens": a.max_new_tokens,
                **({"reply_prefix": a.reply_prefix} if a.reply_prefix else {}),
            }
            for a in workflow.agents
        ],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "roster-smoke.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def compare_argv(out_dir: Path, workflow_path: Path) -> list[str]:
    return [
        "bench", "compare",
        "--workflow", str(workflow_path),
        "--requests", "mmlu",
        "--limit", "3",  # KVCMAS pools hold 2 anchors after two requests: the third reuses
        "--methods", COMPARE_METHODS,
        "--no-noise-floor",  # the accuracy smoke runs the bf16 noise floor
        "--out", str(out_dir),
    ]  # fmt: skip


def experiment_step(name: str, module_name: str, out_dir: Path) -> SmokeStep:
    """One registered experiment's step: its ``smoke_args``, or a skip saying why."""
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # another experiment's broken import must not stop the smoke
        return SmokeStep(name, None, f"skipped: cannot import {module_name} ({e})", "skipped")
    if not hasattr(module, "smoke_args"):
        return SmokeStep(name, None, f"skipped: {module_name} defines no smoke_args", "skipped")
    argv = ["bench", name, *[str(a) for a in module.smoke_args(out_dir / name)]]
    return SmokeStep(name, argv)


def smoke_plan(
    out_dir: Path, modules: dict[str, str] | None = None, workflow_path: Path | None = None
) -> list[SmokeStep]:
    """compare, every registered experiment (in registry order), then the report."""
    if modules is None:
        from kvcmas.experiments import EXPERIMENT_MODULES

        modules = EXPERIMENT_MODULES
    workflow_path = workflow_path or out_dir / "roster-smoke.json"
    steps = [SmokeStep("compare", compare_argv(out_dir / "compare", workflow_path))]
    steps += [
        experiment_step(name, module, out_dir)
        for name, module in modules.items()
        if name not in NOT_SMOKED
    ]
    steps.append(SmokeStep("report", ["bench", "report", str(out_dir)]))
    return steps


def step_command(step: SmokeStep) -> list[str]:
    """The child process's command line: this interpreter running the ``kvcmas`` CLI."""
    return [sys.executable, "-m", "kvcmas.cli", *step.argv]


def run_step(step: SmokeStep) -> None:
    """Run one step through the command line in a child process; record status and time.

    The child's stdout and stderr are this process's, so its progress shows as it runs."""
    start = time.perf_counter()
    rc = subprocess.run(step_command(step)).returncode
    step.wall_s = time.perf_counter() - start
    step.status = "passed" if rc == 0 else "failed"
    if rc != 0:
        step.note = f"exit status {rc}"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    workflow_path = write_smoke_workflow(out)
    steps = smoke_plan(out, workflow_path=workflow_path)
    if args.only:
        steps = [s for s in steps if s.name in args.only]
    start = time.perf_counter()
    for i, step in enumerate(steps, 1):
        if step.argv is None:
            _log(f"[smoke {i}/{len(steps)}] {step.name}: {step.note}")
            continue
        _log(f"[smoke {i}/{len(steps)}] kvcmas {' '.join(step.argv)}")
        run_step(step)
        elapsed = time.perf_counter() - start
        _log(
            f"[smoke {i}/{len(steps)}] {step.name} {step.status} in {step.wall_s:.0f}s "
            f"({elapsed:.0f}s total)"
        )
    total = time.perf_counter() - start
    (out / "smoke.json").write_text(
        json.dumps({"total_s": total, "steps": [asdict(s) for s in steps]}, indent=1)
    )
    print_summary(steps, total)
    return 0 if all(s.status != "failed" for s in steps) else 1


def print_summary(steps: list[SmokeStep], total_s: float) -> None:
    print("| step | status | wall s | note |\n|---|---|---|---|")
    for s in steps:
        print(f"| {s.name} | {s.status} | {s.wall_s:.0f} | {s.note} |")
    over = f" (over the {TIME_BUDGET_S:.0f} s budget)" if total_s > TIME_BUDGET_S else ""
    print(f"\nsmoke finished in {total_s:.0f} s{over}")
