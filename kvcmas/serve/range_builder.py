"""Build a claimed range of a request's prompt with a kvcmas method, on the worker.

The scheduler decides at admission which range of the prompt the connector supplies
(:class:`RangePlan`): from vLLM's computed prefix to the end of the last shared span it found.
The worker then builds that range here, with kvcmas's own runtime on the same weights:

1. the context before the range is read back from vLLM's paged cache (exact: vLLM computed it);
2. an exact run (the prompt continues a saved request of the session token for token) is
   copied at the same positions;
3. the rest is the method's hop: private text between spans is prefilled densely, each span
   is built by the method (:meth:`kvcmas.methods.base.Method.build_segments`) from the KV that
   earlier requests of the session left in the span store (its *origin*: the first request
   that held it; its *latest*: the most recent one, whose KV may itself be corrected, which is
   the paper's chaining);
4. the range's K/V is written into the request's blocks through :mod:`.paged_layout`.

No vllm import here: the unit tests drive it with a plain tensor laid out as vLLM's CPU cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvcmas.chat import Segment
from kvcmas.kv.segment import SegmentKV
from kvcmas.methods.base import Hop, HopBuild, Method, SegmentRecord, SharedSegment
from kvcmas.model.cache import KVCache
from kvcmas.model.rope import rotate_keys
from kvcmas.model.transformer import Transformer
from kvcmas.serve.paged_layout import read_span, write_span
from kvcmas.serve.plans import RangePlan, SourceRef

# The worker's span store as the builder sees it: per saved request, K and V of every layer
# (in model order) at positions [offset, offset + length), as the paged cache held them.
# They may be views into the store: nothing here or in a method writes into them.
ReadSource = Callable[[str, int, int], tuple[torch.Tensor, torch.Tensor]]


def hop_segments(plan: RangePlan) -> list[Segment]:
    """The hop as the method sees it: the context before the method's part (one "system
    prefix" segment), then private text and spans alternating up to the claim's end."""
    ids = plan.token_ids
    segments = [Segment(tuple(ids[: plan.exact_end]))]
    at = plan.exact_end
    for span in plan.spans:
        if span.start > at:
            segments.append(Segment(tuple(ids[at : span.start])))
        segments.append(Segment(tuple(ids[span.start : span.start + span.length]), span.slot))
        at = span.start + span.length
    if at < plan.end:
        segments.append(Segment(tuple(ids[at : plan.end])))
    return segments


def canonical(read: ReadSource, ref: SourceRef, length: int, inv_freq) -> SegmentKV:
    """A saved run of tokens in the canonical frame (keys de-rotated to start at 0)."""
    k, v = read(ref.key, ref.offset, length)
    return SegmentKV(rotate_keys(k, -ref.offset, inv_freq), v)


def shared_segments(plan: RangePlan, read: ReadSource, inv_freq) -> dict[str, SharedSegment]:
    shared = {}
    for span in plan.spans:
        tokens = tuple(plan.token_ids[span.start : span.start + span.length])
        s = SharedSegment(span.slot, span.kind, tokens)
        s.origin = canonical(read, span.origin, span.length, inv_freq)
        s.origin_agent = span.origin.agent
        if span.latest == span.origin:
            s.latest, s.latest_agent = s.origin, s.origin_agent
        else:
            s.latest = canonical(read, span.latest, span.length, inv_freq)
            s.latest_agent = span.latest.agent
        shared[span.slot] = s
    return shared


def read_context(
    layers: Sequence[torch.Tensor], block_ids, end: int, dtype, packing: str
) -> KVCache:
    """vLLM's KV of positions [0, end) as a kvcmas cache (room left for the range)."""
    first = layers[0]
    heads, head_dim = first.shape[1], first.shape[3] // 2
    cache = KVCache(len(layers), heads, head_dim, dtype, capacity=end, device=first.device)
    if end:
        spans = [read_span(layer, block_ids, 0, end, packing=packing) for layer in layers]
        cache.append(torch.stack([k for k, _ in spans]).to(dtype),
                     torch.stack([v for _, v in spans]).to(dtype))
    return cache


def build_range(
    plan: RangePlan,
    method: Method,
    model: Transformer,
    layers: Sequence[torch.Tensor],
    read: ReadSource,
    packing: str,
) -> list[SegmentRecord]:
    """Fill ``[plan.start, plan.end)`` of the request's blocks in every layer of ``layers``
    (vLLM's paged caches, in model order, packed as ``packing``); returns the method's records
    of the range."""
    cache = read_context(layers, plan.block_ids, plan.start, model.dtype, packing)
    cache.reserve(plan.end)
    if plan.exact_end > plan.start:
        k, v = read(plan.exact_key, plan.start, plan.exact_end - plan.start)
        cache.append(k.to(cache.dtype), v.to(cache.dtype))
    records: list[SegmentRecord] = []
    if plan.end > plan.exact_end:
        hop = Hop(plan.agent, plan.session, 0, hop_segments(plan),
                  shared_segments(plan, read, model.inv_freq))
        records, _ = method.build_segments(hop, model, cache)
        method.after_hop(hop, HopBuild(cache, None, records))
    if cache.length != plan.end:
        raise RuntimeError(f"request {plan.request_id}: built {cache.length} of {plan.end} tokens")
    for i, layer in enumerate(layers):
        write_span(layer, plan.block_ids, plan.start,
                   cache.k[i, :, plan.start : plan.end].to(layer.dtype),
                   cache.v[i, :, plan.start : plan.end].to(layer.dtype), packing=packing)
    return records
