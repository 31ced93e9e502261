"""Check at start-up that :mod:`kvcmas.serve.paged_layout` reads what vLLM's CPU backend writes.

The packings were probed on the ISAs this project's machines have ("vec", "vec16", "amx").
Another ISA (NEON, ...) may pack blocks differently, so the worker probes a scratch cache with
vLLM's own write op, for the ISA chosen exactly as the backend chooses it, and refuses to
start on a mismatch instead of silently corrupting the KV it injects.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvcmas.serve.paged_layout import packing_for_isa, read_span


def check_layout_against_vllm(
    layer_cache: torch.Tensor, model_dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> tuple[str, str]:
    """The ISA vLLM's backend uses for this cache and the packing ``read_span`` reads it with;
    RuntimeError if vLLM's write op and ``read_span`` disagree."""
    if kv_cache_dtype != "auto":
        raise RuntimeError(
            f"KvcmasConnector copies KV bit-exactly and does not handle a quantized KV cache "
            f"(--kv-cache-dtype {kv_cache_dtype})"
        )
    _, heads, block_size, two_d = layer_cache.shape
    head_dim = two_d // 2
    isa = _get_attn_isa(model_dtype, block_size, head_dim, kv_cache_dtype)
    scratch = torch.zeros((3, heads, block_size, two_d), dtype=layer_cache.dtype)
    key_cache, value_cache = scratch.view(3, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    length, start, table = block_size + 3, block_size // 2, [2, 0]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(length, heads, head_dim, generator=g).to(layer_cache.dtype)
    v = torch.randn(length, heads, head_dim, generator=g).to(layer_cache.dtype)
    positions = torch.arange(start, start + length)
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    packing = packing_for_isa(isa)
    k_read, v_read = read_span(scratch, table, start, length, packing=packing)
    if not (torch.equal(k_read, k.transpose(0, 1)) and torch.equal(v_read, v.transpose(0, 1))):
        raise RuntimeError(
            f"vLLM's CPU KV layout for isa={isa!r}, dtype={layer_cache.dtype} differs from the "
            f"{packing!r} packing kvcmas.serve.paged_layout reads; "
            "the connector would corrupt the cache, so it refuses to start"
        )
    return isa, packing
