"""Shared fixtures: tiny random-weight Llama / Qwen2 models and the real default model.

Tests marked ``device`` run their models on ``KVCMAS_TEST_DEVICE`` (``cpu`` unless set;
``KVCMAS_TEST_DEVICE=cuda pytest -m device`` checks the runtime on a GPU, scripts/gpu_check.sh).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcmas.model.config import ModelConfig
from kvcmas.model.transformer import Transformer


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A random-weight transformers model of the real architecture, small enough for ms tests."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        eos_token_id=1,
        tie_word_embeddings=arch == "llama",
    )
    common.update(overrides)
    if arch == "llama":
        hf = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(rope_theta=1e6, **common))
    hf.eval()
    return hf.float()


def tiny_loaded():
    """(a LoadedModel of a tiny random Llama with the default model's tokenizer and chat
    template, its transformers twin): a workflow runs on it in milliseconds per hop."""
    from transformers import AutoTokenizer

    from kvcmas.model.loader import LoadedModel, resolve

    _, folder = resolve("default")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = tiny_hf_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    return LoadedModel("tiny", ours_from_hf(hf), tokenizer, folder), hf


TEST_DEVICE = os.environ.get("KVCMAS_TEST_DEVICE", "cpu")


def device_for(request) -> torch.device:
    """``KVCMAS_TEST_DEVICE`` for a test marked ``device``, else the CPU."""
    from kvcmas.model.loader import parse_device

    return parse_device(TEST_DEVICE if request.node.get_closest_marker("device") else "cpu")


def ours_from_hf(hf, dtype=torch.float32, device="cpu") -> Transformer:
    config = ModelConfig.from_hf(hf.config.to_dict())
    return Transformer.from_state_dict(config, hf.state_dict(), dtype, device)


@pytest.fixture(params=["llama", "qwen2"])
def tiny_pair(request):
    """(transformers model, ours) with the same random weights, both on the test's device."""
    device = device_for(request)
    hf = tiny_hf_model(request.param).to(device)
    return hf, ours_from_hf(hf, device=device)


@pytest.fixture(scope="session")
def real_model():
    """The embedded default model in fp32 (converted once per machine, then cached)."""
    from kvcmas.model.loader import load_model

    return load_model("default", "fp32")


@pytest.fixture(scope="session")
def real_model_on_test_device(request):
    """The default model on ``KVCMAS_TEST_DEVICE`` (the CPU one when that is cpu)."""
    from kvcmas.model.loader import load_model, parse_device

    device = parse_device(TEST_DEVICE)
    if device.type == "cpu":
        return request.getfixturevalue("real_model")
    return load_model("default", "fp32", device)
