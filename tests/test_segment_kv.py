"""The canonical frame: rotations compose, and moving a segment's KV is exact."""

from __future__ import annotations

import pytest
import torch

from kvcmas.kv.segment import SegmentKV, place_segment
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
