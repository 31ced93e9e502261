"""The runtime's device: cpu by default, a clear error where a device cannot be used, and an
explicit ``device="cpu"`` that changes nothing. (The runtime on CUDA itself is checked by the
``device``-marked tests with ``KVCMAS_TEST_DEVICE=cuda``: scripts/gpu_check.sh.)"""

from __future__ import annotations

import pytest
import torch

from kvcmas.cli import main
from kvcmas.errors import DeviceError
from kvcmas.model.generate import greedy_decode
from kvcmas.model.loader import load_model, parse_device
from tests.conftest import device_for, tiny_hf_model

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_names_the_problem_and_the_way_out(name):
    with pytest.raises(DeviceError) as e:
        parse_device(name)
    message = str(e.value)
    assert "cuda" in message and "--device cpu" in message
    assert ("without CUDA" in message) == (torch.version.cuda is None)


@pytest.mark.parametrize("name", ["tpu", "banana", "", "cpu:x", "mps"])
def test_unknown_devices_are_refused_by_name(name):
    with pytest.raises(DeviceError, match="unknown device"):
        parse_device(name)


def test_cpu_is_the_default_and_accepted_in_every_spelling():
    for name in ("cpu", "cpu:0", torch.device("cpu")):
        assert parse_device(name).type == "cpu"


@no_cuda
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi"],
        ["run", "--workflow", "roster", "--method", "kvcmas", "--question", "hi"],
    ],
)
def test_cli_refuses_device_cuda_without_cuda_before_loading(argv, capsys, monkeypatch):
    def must_not_load(*a, **kw):
        raise AssertionError("the model was loaded before the device was checked")

    monkeypatch.setattr("kvcmas.model.loader.load_model", must_not_load)
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcmas: error: --device:") and "--device cpu" in err
    assert "Traceback" not in err


def test_cli_refuses_an_unknown_device(capsys):
    assert main(["generate", "--prompt", "hi", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def write_tiny_model(folder):
    """A random-weight Llama in a Hugging Face folder with a word-level tokenizer (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_hf_model("llama").save_pretrained(folder)
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 128)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)


def test_explicit_cpu_matches_the_default_bit_for_bit(tmp_path):
    write_tiny_model(tmp_path)
    default = load_model(str(tmp_path), "fp32")
    explicit = load_model(str(tmp_path), "fp32", device="cpu")
    for loaded in (default, explicit):
        assert loaded.model.device.type == "cpu" and loaded.model.inv_freq.device.type == "cpu"
    ids = torch.randint(2, 128, (33,))
    outs = []
    for loaded in (default, explicit):
        model = loaded.model
        cache = model.new_cache(capacity=8)  # grows: new storage on the cache's device
        assert cache.device.type == "cpu"
        first = model.prefill(ids[:20], cache)
        rest = model.prefill(ids[20:].tolist(), cache)
        outs.append((first, rest, cache.k[:, :, :33], cache.v[:, :, :33]))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.device
def test_runtime_on_the_test_device_matches_the_cpu(request):
    """Everything the runtime, the low-rank code and a pool-keeping method make stays on the
    model's device, and agrees with the same weights on the CPU (trivially on a CPU run)."""
    from kvcmas.kv.lowrank import as_matrices, factorize
    from kvcmas.methods import make_method
    from tests.conftest import ours_from_hf
    from tests.test_kvcmas import two_agents

    device = device_for(request)
    hf = tiny_hf_model("qwen2")
    cpu, dev = ours_from_hf(hf), ours_from_hf(hf, device=device)
    ids = torch.randint(2, 128, (40,))
    runs = []
    for model in (cpu, dev):
        cache = model.new_cache(capacity=4)
        logits = model.prefill(ids, cache)
        dec = greedy_decode(model, cache, logits, 6, stop=set(), capture=(2,))
        factors = factorize(as_matrices(cache.k[:, :, :40])[1:], rank=4)
        method = make_method("kvcmas", tau=2.0, min_anchors=1, rank=4, base_rank=4)
        builds = [two_agents(method, model, ids[:16].tolist(), i)[1] for i in range(2)]
        anchors = [a for pool in method.pools.values() for a in pool.anchors]
        made = [cache.k, logits, dec.captured[2], factors.a, factors.b]
        made += [f.a for a in anchors for f in (a.base_k, a.base_v, a.delta_k, a.delta_v)]
        made += [b.cache.k for b in builds] + [b.last_logits for b in builds]
        assert {t.device for t in made} == {model.device}
        runs.append((logits, dec.tokens, factors.rows(40), builds[-1].last_logits))
    (a_logits, a_tokens, a_rows, a_hop), (b_logits, b_tokens, b_rows, b_hop) = runs
    assert a_tokens == b_tokens
    torch.testing.assert_close(b_logits.cpu(), a_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b_rows.cpu(), a_rows, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b_hop.cpu(), a_hop, atol=1e-4, rtol=1e-4)
