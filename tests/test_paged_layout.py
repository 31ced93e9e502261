"""The paged-KV layout module against vLLM's own CPU cache-write op, bitwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from kvcmas.serve.paged_layout import (  # noqa: E402
    PagedLayoutError,
    packing_for_isa,
    read_span,
    write_span,
)

HEADS, HEAD_DIM = 3, 64  # the default model's KV shape


def empty_cache(num_blocks: int, block_size: int, dtype: torch.dtype, head_dim=HEAD_DIM):
    # NaN fill: a slot the op did not write can never compare equal by accident.
    return torch.full((num_blocks, HEADS, block_size, 2 * head_dim), float("nan"), dtype=dtype)


def isa_here(cache: torch.Tensor) -> str:
    """The ISA the CPU backend picks for this cache on this machine."""
    _, _, block_size, two_d = cache.shape
    return _get_attn_isa(cache.dtype, block_size, two_d // 2)


def packing_here(cache: torch.Tensor) -> str:
    return packing_for_isa(isa_here(cache))


def vllm_write(cache: torch.Tensor, block_ids, start: int, k, v, isa: str | None = None):
    """Write k, v ([heads, length, head_dim]) with the op the CPU backend itself uses, for
    ``isa`` (default: the one the backend picks here)."""
    num_blocks, heads, block_size, two_d = cache.shape
    # The backend's own split of the layer tensor (cpu_attn.py, do_kv_cache_update).
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    positions = torch.arange(start, start + k.shape[1])
    blocks = torch.as_tensor(block_ids)[positions // block_size]
    slots = blocks * block_size + positions % block_size
    isa = isa or isa_here(cache)
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


HAS_AMX = torch.cpu._is_amx_tile_supported()


def test_fp32_uses_the_vec_packing_on_x86():
    # fp32 never takes the AMX kernel; bf16 does where the CPU has AMX tiles (the tests below
    # use whichever packing the backend picks here, and the AMX ones where it can).
    assert _get_attn_isa(torch.float32, 128, HEAD_DIM) in ("vec", "vec16")
    assert packing_for_isa("vec") == packing_for_isa("vec16") == "vec"
    assert packing_for_isa("amx") == "amx"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,table,start,length", SPANS)
def test_read_span_returns_what_vllm_wrote(dtype, block_size, table, start, length):
    cache = empty_cache(12, block_size, dtype)
    k, v = random_kv(length, dtype, seed=start + length)
    vllm_write(cache, table, start, k, v)
    k_back, v_back = read_span(cache, table, start, length, packing=packing_here(cache))
    assert k_back.shape == (HEADS, length, HEAD_DIM) and k_back.dtype == dtype
    assert torch.equal(k_back, k) and torch.equal(v_back, v)
    # Read into a caller's tensor (the connector saves all layers into one): the same values.
    into = torch.full((2, HEADS, length, HEAD_DIM), float("nan"), dtype=dtype)
    assert read_span(cache, table, start, length, packing=packing_here(cache),
                     out=(into[0], into[1]))[0].data_ptr() == into.data_ptr()
    assert torch.equal(into[0], k) and torch.equal(into[1], v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,table,start,length", SPANS)
def test_write_span_equals_vllm_write(dtype, block_size, table, start, length):
    ours, reference = empty_cache(12, block_size, dtype), empty_cache(12, block_size, dtype)
    # Pre-existing neighbours: a write must leave slots outside the span untouched.
    k0, v0 = random_kv(block_size * len(table), dtype, seed=99)
    for c in (ours, reference):
        vllm_write(c, table, 0, k0, v0)
    k, v = random_kv(length, dtype, seed=length)
    write_span(ours, table, start, k, v, packing=packing_here(ours))
    vllm_write(reference, table, start, k, v)
    # NaN-aware bitwise equality over the whole cache (untouched blocks stay NaN in both).
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours.view(bits), reference.view(bits))


@pytest.mark.parametrize("head_dim", [128])
def test_other_head_dim(head_dim):
    cache = empty_cache(6, 128, torch.float32, head_dim)
    k, v = random_kv(150, torch.float32, seed=3, head_dim=head_dim)
    vllm_write(cache, [3, 1], 90, k[:, :100], v[:, :100])
    k_back, v_back = read_span(cache, [3, 1], 90, 100, packing="vec")
    assert torch.equal(k_back, k[:, :100]) and torch.equal(v_back, v[:, :100])


@pytest.mark.skipif(not HAS_AMX, reason="vLLM's AMX write op needs a CPU with AMX tiles")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(
    "block_size,table,start,length", [(32, [3, 1, 4], 5, 70), (128, [2], 17, 100)]
)
def test_amx_packing_equals_vllms_amx_write(head_dim, block_size, table, start, length):
    ours = empty_cache(6, block_size, torch.bfloat16, head_dim)
    reference = empty_cache(6, block_size, torch.bfloat16, head_dim)
    k, v = random_kv(length, torch.bfloat16, seed=length, head_dim=head_dim)
    vllm_write(reference, table, start, k, v, isa="amx")
    write_span(ours, table, start, k, v, packing="amx")
    assert torch.equal(ours.view(torch.int16), reference.view(torch.int16))
    k_back, v_back = read_span(reference, table, start, length, packing="amx")
    assert torch.equal(k_back, k) and torch.equal(v_back, v)
    with pytest.raises(AssertionError):  # the vec packing misreads it
        k_vec, v_vec = read_span(reference, table, start, length, packing="vec")
        assert torch.equal(k_vec, k) and torch.equal(v_vec, v)


def test_amx_packing_places_each_value_where_the_tile_kernel_reads_it():
    """Everywhere (no vLLM op): token t, channel d of head h in block b sits, within the
    block's head, at K [t//16, d//2, t%16, d%2] and V [d//16, t//2, d%16, t%2]."""
    block_size, head_dim = 32, 64
    cache = torch.zeros(2, HEADS, block_size, 2 * head_dim)
    t = torch.arange(block_size).view(1, block_size, 1).expand(HEADS, block_size, head_dim)
    d = torch.arange(head_dim).view(1, 1, head_dim).expand(HEADS, block_size, head_dim)
    h = torch.arange(HEADS).view(HEADS, 1, 1).expand(HEADS, block_size, head_dim)
    code = (h * 10_000 + t * 100 + d).float()  # exact in fp32
    write_span(cache, [1], 0, code, -code, packing="amx")
    flat = cache[1].reshape(HEADS, 2, block_size * head_dim)
    k_at = ((t // 16) * (head_dim // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
    v_at = ((d // 16) * (block_size // 2) + t // 2) * 32 + (d % 16) * 2 + t % 2
    assert torch.equal(flat[:, 0].gather(1, k_at.reshape(HEADS, -1)), code.reshape(HEADS, -1))
    assert torch.equal(flat[:, 1].gather(1, v_at.reshape(HEADS, -1)), -code.reshape(HEADS, -1))
    assert not cache[0].any()  # other blocks untouched


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
    vec = {"packing": "vec"}
    with pytest.raises(PagedLayoutError, match="needs 2 blocks .* block table has 1"):
        read_span(cache, [0], 30, 5, **vec)
    with pytest.raises(PagedLayoutError, match="needs 2 blocks"):
        write_span(cache, [1], 25, k, v, **vec)
    with pytest.raises(PagedLayoutError, match="dtype"):
        write_span(cache, [0], 0, k.bfloat16(), v.bfloat16(), **vec)
    with pytest.raises(PagedLayoutError, match=r"k must be \[kv_heads=3"):
        write_span(cache, [0], 0, k[:2], v[:2], **vec)
    with pytest.raises(PagedLayoutError, match="shapes differ"):
        write_span(cache, [0], 0, k, v[:, :5], **vec)
    with pytest.raises(PagedLayoutError, match=r"block ids .* \[0, 4\)"):
        read_span(cache, [7], 0, 3, **vec)
    with pytest.raises(PagedLayoutError, match="2\\*head_dim"):
        read_span(cache[0], [0], 0, 3, **vec)
    with pytest.raises(PagedLayoutError, match=">= 0"):
        read_span(cache, [0], -1, 3, **vec)
    with pytest.raises(PagedLayoutError, match="unknown packing 'tiles'"):
        read_span(cache, [0], 0, 3, packing="tiles")
    into = torch.empty(2, 3, 4, HEAD_DIM)
    with pytest.raises(PagedLayoutError, match=r"out k must be \(3, 3, 64\) torch.float32"):
        read_span(cache, [0], 0, 3, out=(into[0], into[1]), **vec)
    with pytest.raises(PagedLayoutError, match="divisible by 16, got 24 and 64"):
        read_span(empty_cache(2, 24, torch.float32), [0], 0, 3, packing="amx")
