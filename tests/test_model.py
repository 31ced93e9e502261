"""Our forward equals transformers' forward; layer-range and row-subset execution are exact."""

from __future__ import annotations

import pytest
import torch

from kvcmas.model.config import ModelConfig, UnsupportedModelError
from kvcmas.model.generate import greedy_decode
from tests.conftest import device_for, ours_from_hf, tiny_hf_model


def full_logits(model, ids):
    cache = model.new_cache()
    out = model.forward(ids, torch.arange(len(ids)), cache, logits_rows=slice(None))
    return out.logits, cache


@pytest.mark.device
def test_logits_equal_transformers_on_tiny_configs(tiny_pair):
    hf, ours = tiny_pair
    ids = torch.randint(0, 128, (37,)).to(ours.device)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    logits, _ = full_logits(ours, ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.device
def test_llama3_rope_scaling_matches_transformers(request):
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
        rope_theta=500000.0,
    )
    device = device_for(request)
    hf = tiny_hf_model("llama", rope_parameters=scaling).to(device)
    ours = ours_from_hf(hf, device=device)
    assert ours.config.rope_scaling is not None
    ids = torch.randint(0, 128, (200,)).to(device)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(ours, ids)[0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.real_model
@pytest.mark.device
def test_logits_equal_transformers_on_default_model(real_model_on_test_device):
    from transformers import AutoModelForCausalLM

    real_model = real_model_on_test_device
    device = real_model.model.device
    hf = AutoModelForCausalLM.from_pretrained(real_model.folder, dtype=torch.float32).to(device)
    text = "Multi-agent systems share context between agents. " * 8
    ids = torch.tensor(real_model.tokenizer(text)["input_ids"], device=device)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    logits, _ = full_logits(real_model.model, ids)
    assert (logits - ref).abs().max().item() < 1e-3  # logits span about +-30


@pytest.mark.device
def test_incremental_prefill_equals_one_shot(tiny_pair):
    _, ours = tiny_pair
    ids = torch.randint(0, 128, (40,)).to(ours.device)
    ref, ref_cache = full_logits(ours, ids)
    cache = ours.new_cache(capacity=4)  # forces growth
    for a, b in [(0, 13), (13, 14), (14, 40)]:
        last = ours.prefill(ids[a:b], cache)
    torch.testing.assert_close(last, ref[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k[:, :, :40], ref_cache.k[:, :, :40], atol=1e-6, rtol=1e-5)


@pytest.mark.device
def test_row_subset_over_layer_range_equals_rows_of_full_forward(tiny_pair):
    """Recompute layers [1, L) for scattered rows on top of the exact cache: same rows."""
    _, ours = tiny_pair
    ids = torch.randint(0, 128, (30,)).to(ours.device)
    n_layers = ours.config.n_layers
    cache = ours.new_cache()
    full = ours.forward(ids, torch.arange(30), cache, logits_rows=slice(None), capture=(1,))
    rows = torch.tensor([2, 7, 8, 19, 29], device=ours.device)
    work = cache.clone()
    work.k[1:, :, rows] = 0  # forget those rows above layer 0: they must be rebuilt exactly
    work.v[1:, :, rows] = 0
    out = ours.forward(
        None,
        rows,
        work,
        layers=range(1, n_layers),
        hidden=full.captured[1][rows],
        logits_rows=slice(None),
    )
    torch.testing.assert_close(out.logits, full.logits[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(work.k[:, :, :30], cache.k[:, :, :30], atol=1e-6, rtol=1e-5)


def test_bf16_forward_runs_close_to_fp32(tiny_pair):
    hf, ours = tiny_pair
    ours16 = ours_from_hf(hf, torch.bfloat16)
    ids = torch.randint(0, 128, (20,))
    a, _ = full_logits(ours, ids)
    b, _ = full_logits(ours16, ids)
    assert b.dtype == torch.float32 and (a - b).abs().max() < 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied head; q/k/v bias
def test_bf16_with_fp32_gemms_keeps_bf16s_numbers(arch):
    from kvcmas.model.transformer import Transformer

    hf = tiny_hf_model(arch)
    config, state = ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict()
    fp32, bf16 = ours_from_hf(hf), ours_from_hf(hf, torch.bfloat16)
    wide = Transformer.from_state_dict(config, state, torch.bfloat16, gemm_dtype=torch.float32)
    assert (wide.dtype, wide.gemm_dtype, bf16.gemm_dtype) == (
        torch.bfloat16, torch.float32, torch.bfloat16
    )
    layer = wide.layers[0]
    for w in (layer.wqkv, layer.wo, layer.w_gate, layer.w_up, layer.w_down, wide.lm_head):
        assert w.dtype == torch.float32 and torch.equal(w, w.bfloat16().float())  # bf16 values
    ids = torch.randint(0, 128, (40,))
    ref, _ = full_logits(fp32, ids)
    native, native_cache = full_logits(bf16, ids)
    got, cache = full_logits(wide, ids)
    assert cache.k.dtype == torch.bfloat16
    # Only the summation order differs from native bf16 GEMMs: far closer to them than
    # bf16 is to fp32, and as far from fp32 as bf16 is.
    bf16_error = (native - ref).abs().mean()
    assert (got - native).abs().mean() < 0.1 * bf16_error
    assert (got - ref).abs().mean() > 0.5 * bf16_error
    assert (cache.k.float() - native_cache.k.float()).abs().mean() < 0.1 * (
        native_cache.k.float() - full_logits(fp32, ids)[1].k
    ).abs().mean()


def test_a_gemm_dtype_narrower_than_the_model_is_refused():
    from kvcmas.model.loader import load_model

    with pytest.raises(ValueError, match="narrower"):
        load_model("default", "fp32", gemm_dtype="bf16")


@pytest.mark.device
def test_greedy_decode_matches_transformers_generate(tiny_pair):
    hf, ours = tiny_pair
    ids = torch.randint(2, 128, (10,)).to(ours.device)
    with torch.inference_mode():
        ref = hf.generate(ids[None], max_new_tokens=8, do_sample=False, eos_token_id=None)
    cache = ours.new_cache()
    dec = greedy_decode(ours, cache, ours.prefill(ids, cache), 8, stop=set())
    assert dec.tokens == ref[0, 10:].tolist()
    assert cache.length == 18  # every output token was fed: its K/V is in the cache


def test_greedy_decode_stops_at_stop_token(tiny_pair):
    _, ours = tiny_pair
    cache = ours.new_cache()
    logits = ours.prefill(torch.randint(2, 128, (6,)), cache)
    first = int(logits.argmax())
    dec = greedy_decode(ours, cache, logits, 8, stop={first})
    assert dec.tokens == [] and dec.hit_stop


def test_position_beyond_context_is_refused(tiny_pair):
    _, ours = tiny_pair
    with pytest.raises(ValueError, match="context"):
        ours.forward(torch.tensor([3]), torch.tensor([600]), ours.new_cache())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gemma3"}, "gemma3"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"partial_rotary_factor": 0.5}, "partial"),
    ],
)
def test_unsupported_architectures_are_refused_by_name(change, message):
    hf = tiny_hf_model("llama").config.to_dict()
    hf.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, cache_length, kind",
    [
        (range(0, 40), 40, "causal"),  # a prefill from position 0
        (range(10, 40), 40, "padded"),  # a prefill after a short cached context
        (range(34, 40), 40, "mask"),  # a short prefill after a long context
        (range(39, 40), 40, "none"),  # one decoded row
        (range(8, 20), 40, "padded"),  # a span's head in front of the rest of the span
        (range(30, 33), 40, "mask"),  # a short head after a long context, more span behind it
        ([3, 9, 10, 25], 40, "mask"),  # scattered rows (selective recomputation)
    ],
)
def test_attention_plans_equal_the_explicit_causal_mask(tiny_pair, dtype, rows, cache_length,
                                                        kind):
    """Every shortcut of :func:`attention_plan` (keys past the last row not read, zero rows
    padded in front for SDPA's causal flag) attends exactly as the causal mask over the whole
    cache does; positions past the rows hold junk that no row may see."""
    import torch.nn.functional as F

    from kvcmas.model.transformer import attention_plan

    hf, _ = tiny_pair
    model = ours_from_hf(hf, dtype)
    c = model.config
    cache = model.new_cache(cache_length)
    cache.extend_to(cache_length)
    cache.k.normal_()
    cache.v.normal_()
    positions = torch.tensor(list(rows))
    q = torch.randn(c.n_heads, len(positions), c.head_dim).to(dtype)
    plan = attention_plan(positions, cache.length)
    shape = {"causal": plan.causal and not plan.pad, "padded": plan.pad > 0,
             "mask": plan.mask is not None, "none": plan.mask is None and not plan.causal}
    assert shape[kind] and plan.n_keys == int(positions.max()) + 1
    mask = torch.arange(cache_length)[None, :] <= positions[:, None]
    ref = F.scaled_dot_product_attention(
        q[None], cache.k[0][None], cache.v[0][None], attn_mask=mask, enable_gqa=True
    )[0].transpose(0, 1).reshape(len(positions), -1)
    got = model._attend(q, cache, 0, plan)
    torch.testing.assert_close(got, ref, atol=1e-6 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_attention_plan_refuses_rows_past_the_cache():
    from kvcmas.model.transformer import attention_plan

    with pytest.raises(ValueError, match="past the cache"):
        attention_plan(torch.arange(5, 12), 10)
