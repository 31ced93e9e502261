"""Request streams for benchmarks: a JSONL file, or benchmark items rendered as queries."""

from __future__ import annotations

import random
from pathlib import Path

from kvcmas.eval.data import load_dataset
from kvcmas.workflow.runner import read_requests

LETTERS = "ABCDE"


def mmlu_query(row: dict) -> str:
    choices = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(row["choices"]))
    return f"{row['question'].strip()}\n{choices}"


def request_from_row(name: str, row: dict) -> dict:
    """One benchmark item as a request; the gold answer rides along for scoring."""
    if name == "mmlu" or name.startswith("arc"):
        return {"id": row["id"], "query": mmlu_query(row), "gold": row["answer"]}
    if name == "gsm8k":
        return {"id": row["id"], "query": row["question"].strip(), "gold": row["answer"]}
    if name == "humaneval":
        return {"id": row["id"], "query": row["prompt"].strip(), "gold": row["id"]}
    raise ValueError(f"no request format for dataset {name!r}")


def load_requests(
    spec: str, limit: int | None = None, split: str = "test", seed: int = 0
) -> list[dict]:
    """``spec`` is a JSONL path or a dataset name (``mmlu``, ``gsm8k``, ``humaneval``...).

    Dataset items are taken in a seeded shuffled order (MMLU is stored subject by subject, so
    a prefix of the file would be one subject).
    """
    if Path(spec).suffix == ".jsonl" or Path(spec).exists():
        requests = read_requests(spec)
    else:
        rows = load_dataset(spec, split=split)
        random.Random(seed).shuffle(rows)
        requests = [request_from_row(spec, r) for r in rows]
    return requests[:limit] if limit else requests
