"""Helpers shared by the experiments: progress, list flags, setup lines, output files, runs.

Every figure of a run comes from :mod:`kvcmas.eval.summary` (``run_summary``); nothing here
computes one. Plots live in :mod:`kvcmas.experiments.plots`, child processes in
:mod:`kvcmas.experiments.child`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.experiments.machine import machine_description
from kvcmas.methods.base import Method
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.runner import RequestResult, Runner
from kvcmas.workflow.spec import Workflow


class Progress:
    """Progress lines on stderr, each stamped with the seconds since the experiment began."""

    def __init__(self, name: str, stream=None):
        self.name = name
        self.start = time.perf_counter()
        self.stream = stream or sys.stderr

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{self.name} {elapsed:6.0f}s] {message}", file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    # A child process (see ``in_child``) gets the name and start, and logs to its own stderr;
    # perf_counter is system-wide on Linux, so its stamps continue the parent's.
    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "start": self.start}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, stream=sys.stderr)


def parse_list(
    text: str, kind: Callable[[str], Any] = str, choices: Sequence[str] | None = None
) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]``; an empty item, a bad value or (with ``choices``) an unknown
    name is an argparse error that names it, so a typo fails before any model loads."""
    items = [t.strip() for t in str(text).split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"empty item in list {text!r}")
    try:
        values = [kind(t) for t in items]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: {e}") from None
    if choices is not None:
        unknown = [v for v in values if v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(str, unknown))}: choose from {', '.join(choices)}"
            )
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices``."""

    def parse(text: str) -> list[str]:
        return parse_list(text, str, choices)

    return parse


def int_list(text: str) -> list[int]:
    return parse_list(text, int)


def float_list(text: str) -> list[float]:
    return parse_list(text, float)


def str_list(text: str) -> list[str]:
    return parse_list(text, str)


def rank_list(text: str) -> list[int | None]:
    """Ranks; ``full`` (or 0) means full dimension (``None``)."""
    return parse_list(text, lambda t: None if t in ("full", "0") else int(t))


def setup(loaded: LoadedModel, dtype: str, **sizes: Any) -> dict[str, Any]:
    """What every results.json and table states: model, dtype, sizes and machine."""
    import torch

    return {
        "model": loaded.name,
        "dtype": dtype,
        "machine": machine_description(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **sizes,
    }


def setup_lines(s: dict[str, Any]) -> list[str]:
    """Markdown lines stating the setup of a results dict (model, dtype, sizes, machine)."""
    fixed = ("model", "dtype", "machine", "torch_threads", "python", "torch")
    listed = ("parts",)  # a merge's parts: its report lists them, one line each
    sizes = ", ".join(f"{k} {fmt_value(v)}" for k, v in s.items() if k not in fixed + listed)
    return [
        f"Model {s['model']} ({s['dtype']}); machine {s['machine']}; torch {s['torch']}.",
        "",
        f"Sizes: {sizes}." if sizes else "",
    ]


def fmt_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(fmt_value(x) for x in v)
    if v is None:
        return "full"
    return str(v)


def write_results(out: Path, results: dict[str, Any], table: str) -> None:
    """The JSON and table, each replaced whole: a run killed while saving (the partial saves
    of a long run) leaves the previous version, not a truncated file."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(results, indent=1, default=str)),
                       ("table.md", table)):  # fmt: skip
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def read_results(folder: str | Path) -> tuple[Path, dict[str, Any]]:
    """An earlier run's ``results.json`` in ``folder``: its path and content."""
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise UsageError(f"no results.json in {folder}")
    return path, json.loads(path.read_text())


def read_parts(
    dirs: list[str], keys: set[str], command: str, absent: frozenset[str] = frozenset()
) -> list[tuple[str, dict[str, Any]]]:
    """``--merge DIR...``: each folder with its results.json, which must hold ``keys`` and
    none of ``absent`` (the shape of a ``command`` run)."""
    if not dirs:
        raise UsageError("--merge needs at least one results folder")
    parts = []
    for d in dirs:
        path, results = read_results(d)
        if not keys <= results.keys() or absent & results.keys():
            raise UsageError(f"{path} is not a `{command}` run")
        parts.append((str(d), results))
    return parts


def check_same_setup(parts: list[tuple[str, dict[str, Any]]], keys: Sequence[str]) -> None:
    """Merged parts must agree with the first on every setup key in ``keys``."""
    (first_dir, first), *rest = parts
    for d, r in rest:
        for key in keys:
            mine, theirs = r["setup"].get(key), first["setup"].get(key)
            if mine != theirs:
                raise UsageError(f"cannot merge {d} into {first_dir}: {key} {mine!r} != {theirs!r}")


def render(out_dir, results: dict[str, Any], markdown: Callable, plot: Callable) -> None:
    """Write a results dict's JSON, table and plots to ``out_dir`` and print the table."""
    out = Path(out_dir)
    write_results(out, results, markdown(results))
    plot(results, out)
    print(markdown(results))


def finish(out_dir, results: dict[str, Any], log, markdown: Callable, plot: Callable) -> int:
    """The common end of an experiment: stamp wall time, write JSON, table and plots, print."""
    results["wall_s"] = log.elapsed
    render(out_dir, results, markdown, plot)
    log(f"wrote {out_dir}/results.json, table.md and plots")
    return 0


# --- runs ------------------------------------------------------------------------------------


def trace_runner(
    loaded: LoadedModel, workflow: Workflow, method: Method, ignore_eos: bool = False
) -> Runner:
    """A Runner; with ``ignore_eos`` every agent generates exactly its ``max_new_tokens``.

    Like vLLM's ``ignore_eos``: the stop set is emptied, so an end-of-turn token the model
    chooses is kept as an ordinary output token and generation goes on (controlled traces).
    """
    runner = Runner(loaded, workflow, method)
    if ignore_eos:
        runner.stop = set()
    return runner


def run_stream(
    runner: Runner, requests: Sequence[dict], log: Callable[[str], None], label: str
) -> list[RequestResult]:
    start = time.perf_counter()
    out = []
    for i, result in enumerate(runner.run_stream(requests)):
        out.append(result)
        log(f"{label}: request {i + 1}/{len(requests)} ({time.perf_counter() - start:.0f}s)")
    return out
