"""The paged-KV layout module against vLLM's own CPU cache-write op, bitwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from kvcmas.serve.paged_layout import PagedLayoutError, read_span, write_span  # noqa: E402

HEADS, HEAD_DIM = 3, 64  # the default model's KV shape


def empty_cache(num_blocks: int, block_size: int, dtype: torch.dtype, head_dim=HEAD_DIM):
    # NaN fill: a slot the op did not write can never compare equal by accident.
    return torch.full((num_blocks, HEADS, block_size, 2 * head_dim), float("nan"), dtype=dtype)


def vllm_write(cache: torch.Tensor, block_ids, start: int, k: torch.Tensor, v: torch.Tensor):
    """Write k, v ([heads, length, head_dim]) with the op the CPU backend itself uses."""
    num_blocks, heads, block_size, two_d = cache.shape
    # The backend's own split of the layer tensor (cpu_attn.py, do_kv_cache_update).
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    positions = torch.arange(start, start + k.shape[1])
    blocks = torch.as_tensor(block_ids)[positions // block_size]
    slots = blocks * block_size + positions % block_size
    isa = _get_attn_isa(cache.dtype, block_size, two_d // 2)
    ops.cpu_attn_reshape_and_cache(
        k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(),
        key_cache, value_cache, slots, isa,
    )


def random_kv(length: int, dtype: torch.dtype, seed: int, head_dim=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(HEADS, length, head_dim, generator=g).to(dtype)
    v = torch.randn(HEADS, length, head_dim, generator=g).to(dtype)
    return k, v


# (block_size, block table, start, length): aligned, mid-block start and end, crossing blocks,
# non-contiguous and descending block ids, a single token, a span inside one block.
SPANS = [
    (128, [4, 1], 0, 256),
    (128, [5, 0, 3], 37, 200),
    (128, [2, 7, 6], 127, 2),
    (128, [6], 50, 1),
    (32, [9, 2, 11, 4, 0], 5, 140),
    (32, [3, 8], 10, 12),
]
DTYPES = [torch.float32, torch.bfloat16]


def test_layout_matches_vllm_isa_here():
    # The probe covers the ISAs this CPU selects; AMX (bf16 on Sapphire Rapids) is not
    # available here and may pack blocks differently, so the connector re-checks at start.
    assert _get_attn_isa(torch.float32, 128, HEAD_DIM) in ("vec", "vec16")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,table,start,length", SPANS)
def test_read_span_returns_what_vllm_wrote(dtype, block_size, table, start, length):
    cache = empty_cache(12, block_size, dtype)
    k, v = random_kv(length, dtype, seed=start + length)
    vllm_write(cache, table, start, k, v)
    k_back, v_back = read_span(cache, table, start, length)
    assert k_back.shape == (HEADS, length, HEAD_DIM) and k_back.dtype == dtype
    assert torch.equal(k_back, k) and torch.equal(v_back, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,table,start,length", SPANS)
def test_write_span_equals_vllm_write(dtype, block_size, table, start, length):
    ours, reference = empty_cache(12, block_size, dtype), empty_cache(12, block_size, dtype)
    # Pre-existing neighbours: a write must leave slots outside the span untouched.
    k0, v0 = random_kv(block_size * len(table), dtype, seed=99)
    for c in (ours, reference):
        vllm_write(c, table, 0, k0, v0)
    k, v = random_kv(length, dtype, seed=length)
    write_span(ours, table, start, k, v)
    vllm_write(reference, table, start, k, v)
    # NaN-aware bitwise equality over the whole cache (untouched blocks stay NaN in both).
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours.view(bits), reference.view(bits))


@pytest.mark.parametrize("head_dim", [128])
def test_other_head_dim(head_dim):
    cache = empty_cache(6, 128, torch.float32, head_dim)
    k, v = random_kv(150, torch.float32, seed=3, head_dim=head_dim)
    vllm_write(cache, [3, 1], 90, k[:, :100], v[:, :100])
    k_back, v_back = read_span(cache, [3, 1], 90, 100)
    assert torch.equal(k_back, k[:, :100]) and torch.equal(v_back, v[:, :100])


def test_obvious_untransposed_indexing_does_not_match():
    """Reading K as cache[b, h, offset, :head_dim] (the shape's apparent meaning) is wrong."""
    block_size, table, start, length = 128, [2, 0], 60, 100
    cache = empty_cache(4, block_size, torch.float32)
    k, v = random_kv(length, torch.float32, seed=1)
    vllm_write(cache, table, start, k, v)
    positions = torch.arange(start, start + length)
    blocks = torch.tensor(table)[positions // block_size]
    naive_k = cache[blocks, :, positions % block_size, :HEAD_DIM].transpose(0, 1)
    naive_v = cache[blocks, :, positions % block_size, HEAD_DIM:].transpose(0, 1)
    assert not torch.equal(naive_k, k)
    assert not torch.equal(naive_v, v)


def test_errors_name_the_problem():
    cache = empty_cache(4, 32, torch.float32)
    k, v = random_kv(10, torch.float32, seed=0)
    with pytest.raises(PagedLayoutError, match="needs 2 blocks .* block table has 1"):
        read_span(cache, [0], 30, 5)
    with pytest.raises(PagedLayoutError, match="needs 2 blocks"):
        write_span(cache, [1], 25, k, v)
    with pytest.raises(PagedLayoutError, match="dtype"):
        write_span(cache, [0], 0, k.bfloat16(), v.bfloat16())
    with pytest.raises(PagedLayoutError, match=r"k must be \[kv_heads=3"):
        write_span(cache, [0], 0, k[:2], v[:2])
    with pytest.raises(PagedLayoutError, match="shapes differ"):
        write_span(cache, [0], 0, k, v[:, :5])
    with pytest.raises(PagedLayoutError, match=r"block ids .* \[0, 4\)"):
        read_span(cache, [7], 0, 3)
    with pytest.raises(PagedLayoutError, match="2\\*head_dim"):
        read_span(cache[0], [0], 0, 3)
    with pytest.raises(PagedLayoutError, match=">= 0"):
        read_span(cache, [0], -1, 3)
