"""The connector's worker-side builder (kvcmas.serve.range_builder), without vLLM.

A plain tensor laid out as vLLM's CPU paged cache stands in for the engine's blocks; tiny
random-weight Llama and Qwen2 models stand in for the weights. The range the builder writes
must equal what the same method builds on kvcmas's own cache for the same tokens, and be
exactly dense where the method recomputes everything.
"""

from __future__ import annotations

import pytest
import torch

from kvcmas.chat import Segment
from kvcmas.methods import METHODS, make_method
from kvcmas.methods.base import Hop, HopBuild, SharedSegment
from kvcmas.serve.paged_layout import read_span, write_span
from kvcmas.serve.plans import RangePlan, SourceRef, SpanPiece
from kvcmas.serve.range_builder import build_range, read_context
from kvcmas.serve.span_store import SpanStore
from tests.test_baselines import OTHER_PREFIX, PREFIX, SHARED, TAIL, ids, source_kv

BLOCK = 16
PACKING = "vec"  # vLLM's packing for fp32 caches; the whole-span test also runs the AMX one
MID = ids(11, 5)  # private text between the computed prefix and the shared span


@pytest.fixture
def model(tiny_pair):
    return tiny_pair[1]


def dense(model, tokens):
    cache = model.new_cache()
    model.prefill(list(tokens), cache)
    return cache


def paged_layers(model, num_blocks=12):
    c = model.config
    return [torch.zeros(num_blocks, c.n_kv_heads, BLOCK, 2 * c.head_dim) for _ in range(c.n_layers)]


def write_context(layers, block_ids, cache, end, packing=PACKING):
    """What vLLM computed: the prompt's KV up to ``end`` in the request's blocks."""
    for i, layer in enumerate(layers):
        write_span(layer, block_ids, 0, cache.k[i, :, :end], cache.v[i, :, :end], packing=packing)


def saved_store(saved: dict) -> SpanStore:
    """The worker's span store holding each cache of ``saved`` as a finished request."""
    store = SpanStore()
    for key, cache in saved.items():
        store.put(key, torch.stack((cache.k[:, :, : cache.length],
                                    cache.v[:, :, : cache.length]), dim=1))
    return store


def reader(saved: dict):
    """The connector's reader: views into a span store, as in the server."""
    return saved_store(saved).read


def range_of(layers, block_ids, start, end, packing=PACKING):
    spans = [read_span(layer, block_ids, start, end - start, packing=packing) for layer in layers]
    return torch.stack([k for k, _ in spans]), torch.stack([v for _, v in spans])


def span_plan(prompt, start, end, span_start, exact=None) -> RangePlan:
    origin = SourceRef("src", len(OTHER_PREFIX), "a")
    span = SpanPiece(span_start, len(SHARED), "a", "input", origin, origin)
    key, exact_end = exact or (None, 0)
    return RangePlan("r1", "s", "b", None, list(range(12)), start, end, list(prompt[:end]),
                     exact_key=key, exact_end=exact_end, spans=[span])


def test_context_is_read_back_bitwise(model):
    layers, blocks = paged_layers(model), [5, 2, 7, 0]
    cache = dense(model, PREFIX + MID + SHARED)
    write_context(layers, blocks, cache, 40)
    back = read_context(layers, blocks, 40, model.dtype, PACKING)
    assert torch.equal(back.k[:, :, :40], cache.k[:, :, :40])
    assert torch.equal(back.v[:, :, :40], cache.v[:, :, :40])


def one_span_range(model):
    """A prompt with one span of SHARED after MID, its context already in vLLM's blocks, and
    the span's source saved from another prefix: (plan, paged layers, store reader)."""
    prompt = PREFIX + MID + SHARED + TAIL
    start, span_start = len(PREFIX), len(PREFIX + MID)
    layers = paged_layers(model)
    write_context(layers, list(range(12)), dense(model, prompt), start)
    saved = {"src": dense(model, OTHER_PREFIX + SHARED)}
    return span_plan(prompt, start, span_start + len(SHARED), span_start), layers, reader(saved)


def runner_hop(model) -> Hop:
    """The same hop as the runner sees it: SHARED as slot "a", recorded from its source."""
    shared = SharedSegment("a", "input", SHARED)
    shared.record("a", source_kv(model))
    return Hop("b", "s", 0, [Segment(PREFIX), Segment(MID), Segment(SHARED, "a")], {"a": shared})


def assert_range_is(layers, plan, expected):
    k, v = range_of(layers, plan.block_ids, plan.start, plan.end)
    torch.testing.assert_close(k, expected.k[:, :, plan.start : plan.end], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, expected.v[:, :, plan.start : plan.end], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["fullshared", "cacheblend", "kvcmas"])
def test_range_equals_the_method_on_kvcmas_own_cache(model, method):
    """The connector's hop is the runner's hop: same segments, same source, same KV."""
    plan, layers, read = one_span_range(model)
    records = build_range(plan, make_method(method), model, layers, read, PACKING)
    assert [r.slot for r in records] == [None, "a"]

    expected = dense(model, PREFIX)
    make_method(method).build_segments(runner_hop(model), model, expected)
    assert_range_is(layers, plan, expected)
    if method == "fullshared":  # reused rows: the source's, re-rotated, never recomputed
        assert records[1].decision == "reuse" and records[1].served_tokens == len(SHARED)


def test_graphflow_range_equals_its_own_hop_once_its_path_has_a_residual(model):
    """GraphFlow's first hop of a path prefills densely and records the residual; the next
    builds the context-free base plus that residual. Both in the connector equal the runner's."""
    plan, layers, read = one_span_range(model)
    served, own = (make_method("graphflow", residual_topk=4) for _ in range(2))
    hop = runner_hop(model)
    decisions = []
    for _ in range(2):
        records = build_range(plan, served, model, layers, read, PACKING)
        expected = dense(model, PREFIX)
        own_records, _ = own.build_segments(hop, model, expected)
        own.after_hop(hop, HopBuild(expected, None, own_records))
        assert_range_is(layers, plan, expected)
        decisions.append((records[1].decision, records[1].details))
    assert decisions[0] == ("dense", {"records_residual": True})
    assert decisions[1] == ("reuse", {"base": "cached", "residual_tokens": 4})


@pytest.mark.parametrize("packing", ["vec", "amx"])
def test_recomputing_the_whole_span_is_dense(model, packing):
    """Head recompute over the whole span: every row of the range equals a dense prefill
    (read and written in either of vLLM's block packings)."""
    prompt = PREFIX + MID + SHARED + TAIL
    start, span_start = len(PREFIX), len(PREFIX + MID)
    end = span_start + len(SHARED)
    layers, blocks = paged_layers(model), [3, 9, 1, 4, 6]
    reference = dense(model, prompt)
    write_context(layers, blocks, reference, start, packing)
    saved = {"src": dense(model, OTHER_PREFIX + SHARED)}
    plan = span_plan(prompt, start, end, span_start)
    plan.block_ids = blocks
    build_range(plan, make_method("headrecompute", {"head_tokens": 10_000}), model, layers,
                reader(saved), packing)
    k, v = range_of(layers, blocks, start, end, packing)
    torch.testing.assert_close(k, reference.k[:, :, start:end], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, reference.v[:, :, start:end], rtol=1e-5, atol=1e-5)
    # A reused span (no recompute) differs: the test can see a wrong range.
    build_range(plan, make_method("fullshared"), model, layers, reader(saved), packing)
    k, _ = range_of(layers, blocks, span_start, end, packing)
    assert not torch.allclose(k, reference.k[:, :, span_start:end], rtol=1e-3, atol=1e-3)


def test_an_exact_run_is_copied_at_its_own_positions(model):
    """A prompt continuing a saved request token for token gets that request's KV as is."""
    prompt = PREFIX + MID + SHARED + TAIL
    earlier = dense(model, PREFIX + MID + ids(5, 9))  # same prefix and MID, then different
    start, exact_end = len(PREFIX), len(PREFIX + MID)
    end = exact_end + len(SHARED)
    layers, blocks = paged_layers(model), list(range(12))
    write_context(layers, blocks, earlier, start)
    saved = {"src": dense(model, OTHER_PREFIX + SHARED), "earlier": earlier}
    build_range(span_plan(prompt, start, end, exact_end, exact=("earlier", exact_end)),
                make_method("fullshared"), model, layers, reader(saved), PACKING)
    k, v = range_of(layers, blocks, start, exact_end)
    assert torch.equal(k, earlier.k[:, :, start:exact_end])
    assert torch.equal(v, earlier.v[:, :, start:exact_end])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_no_method_writes_into_the_span_store(model, method):
    """The store hands out views of saved requests: building ranges (twice, so that methods
    learning across requests reuse what they learnt) must leave them bitwise as saved."""
    plan, layers, _ = one_span_range(model)
    store = saved_store({"src": dense(model, OTHER_PREFIX + SHARED)})
    before = store.get("src").clone()
    served = make_method(method)
    for _ in range(2):
        build_range(plan, served, model, layers, store.read, PACKING)
        served.flush()
    assert torch.equal(store.get("src"), before)


def test_a_plan_with_overlapping_or_overlong_spans_is_refused():
    origin = SourceRef("src", 0, "a")
    a, b = SpanPiece(10, 8, "a", "input", origin, origin), SpanPiece(15, 8, "b", "agent",
                                                                       origin, origin)
    with pytest.raises(ValueError, match="overlap"):
        RangePlan("r", "s", "c", None, [0, 1], 5, 30, list(range(30)), spans=[a, b])
    with pytest.raises(ValueError, match="past the claimed range"):
        RangePlan("r", "s", "c", None, [0, 1], 5, 12, list(range(30)), spans=[a])
