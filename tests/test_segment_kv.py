"""The canonical frame: rotations compose, and moving a segment's KV is exact."""

from __future__ import annotations

import pytest
import torch

from kvcmas.kv.segment import SegmentKV, place_layers, place_segment
from kvcmas.model.cache import KVCache
from kvcmas.model.rope import rotate_keys


def test_rotation_composes(tiny_pair):
    _, ours = tiny_pair
    k = torch.randn(4, 2, 5, ours.config.head_dim, dtype=torch.float64)
    for a, b in [(3, 11), (-700, 250), (4000, -4000), (1234, 5678)]:
        two = rotate_keys(rotate_keys(k, a, ours.inv_freq), b, ours.inv_freq)
        torch.testing.assert_close(two, rotate_keys(k, a + b, ours.inv_freq), atol=1e-9, rtol=0)


def test_rotation_preserves_norms_and_inverts(tiny_pair):
    _, ours = tiny_pair
    k = torch.randn(3, 2, 7, ours.config.head_dim)
    r = rotate_keys(k, 321, ours.inv_freq)
    torch.testing.assert_close(r.norm(dim=-1), k.norm(dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate_keys(r, -321, ours.inv_freq), k, atol=1e-5, rtol=1e-5)


def prefill(model, ids):
    cache = model.new_cache()
    logits = model.prefill(ids, cache)
    return cache, logits


@pytest.mark.device
def test_canonical_round_trip_reproduces_dense_cache_and_logits(tiny_pair):
    _, ours = tiny_pair
    p, s, tail = (
        torch.randint(0, 128, (9,)).to(ours.device),
        torch.randint(0, 128, (14,)).to(ours.device),
        torch.randint(0, 128, (5,)).to(ours.device),
    )
    dense, _ = prefill(ours, torch.cat([p, s]))
    seg = SegmentKV.from_cache(dense, 9, 23, ours.inv_freq)
    rebuilt, _ = prefill(ours, p)
    assert place_segment(rebuilt, seg, ours.inv_freq) == 9
    torch.testing.assert_close(rebuilt.k[:, :, :23], dense.k[:, :, :23], atol=1e-5, rtol=1e-5)
    a = ours.prefill(tail, dense)
    b = ours.prefill(tail, rebuilt)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_layer0_canonical_kv_is_independent_of_preceding_text(tiny_pair):
    _, ours = tiny_pair
    s = torch.randint(0, 128, (12,))
    one, _ = prefill(ours, torch.cat([torch.randint(0, 128, (5,)), s]))
    two, _ = prefill(ours, torch.cat([torch.randint(0, 128, (17,)), s]))
    a = SegmentKV.from_cache(one, 5, 17, ours.inv_freq)
    b = SegmentKV.from_cache(two, 17, 29, ours.inv_freq)
    torch.testing.assert_close(a.k[0], b.k[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.v[0], b.v[0], atol=1e-6, rtol=1e-6)
    assert (a.k[1:] - b.k[1:]).abs().max() > 1e-3  # deeper layers do see the prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placing_layer_by_layer_equals_placing_the_stacked_segment(tiny_pair, dtype):
    """KVCMAS writes its corrected layers straight into the cache: bitwise what placing the
    same layers, stacked and rounded to the cache's dtype, gives (float32 layers in)."""
    _, ours = tiny_pair
    layers, heads, n, head_dim = 3, 2, 9, ours.config.head_dim
    k, v = (torch.randn(layers, heads, n, head_dim) for _ in range(2))
    caches = []
    for _ in range(2):
        cache = KVCache(layers, heads, head_dim, dtype, capacity=4)
        cache.append(*(torch.randn(layers, heads, 7, head_dim).to(dtype) for _ in range(2)))
        caches.append(cache)
    caches[1].k[:, :, :7], caches[1].v[:, :, :7] = caches[0].k[:, :, :7], caches[0].v[:, :, :7]
    start = place_segment(caches[0], SegmentKV(k.to(dtype), v.to(dtype)), ours.inv_freq)
    assert place_layers(caches[1], iter(k), iter(v), n, ours.inv_freq) == start == 7
    assert caches[1].length == caches[0].length == 16
    assert torch.equal(caches[1].k[:, :, :16], caches[0].k[:, :, :16])
    assert torch.equal(caches[1].v[:, :, :16], caches[0].v[:, :, :16])
    with pytest.raises(ValueError, match="placed 2 layers into a cache of 3"):
        place_layers(caches[1], iter(k[:2]), iter(v[:2]), n, ours.inv_freq)
