"""Low-rank factors and the anchor pool: exactness, determinism, bounds, eviction order."""

from __future__ import annotations

import pytest
import torch

from kvcmas.kv.lowrank import MatrixBuffer, as_matrices, energy_rank, factorize
from kvcmas.methods.anchors import AnchorPool, PoolConfig


def low_rank_plus_noise(layers=3, n=40, d=48, rank=5, noise=1e-3, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(layers, n, rank, generator=g) @ torch.randn(layers, rank, d, generator=g)
    return m + noise * torch.randn(layers, n, d, generator=g)


def test_full_rank_factors_are_exact():
    m = torch.randn(3, 20, 16)
    for rank in (None, 16, 64):
        torch.testing.assert_close(factorize(m, rank).rows(20), m, atol=1e-4, rtol=1e-4)


def test_randomized_truncation_is_near_optimal_and_seeded():
    m = low_rank_plus_noise(n=200, d=96, rank=6)
    f = factorize(m, 8, seed=3)  # 8 + 8 < 96: the randomized path
    s = torch.linalg.svdvals(m)
    optimal = (s[:, 8:] ** 2).sum().sqrt()
    err = (f.rows(200) - m).norm()
    assert err <= 1.05 * optimal
    again = factorize(m, 8, seed=3)
    assert torch.equal(again.a, f.a) and torch.equal(again.b, f.b)


def test_energy_rank_finds_planted_rank():
    assert energy_rank(low_rank_plus_noise(rank=4, noise=1e-4), 0.99).max() <= 4


def make_pool(capacity=3, eviction="least-used", **kw):
    return AnchorPool(
        PoolConfig(
            **{"temperature": 0.05, **kw},
            capacity=capacity,
            delta_rank=4,
            base_rank=4,
            eviction=eviction,
        )
    )


def add_random(pool, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n, 8, generator=g)
    pool.add(x, x, x + 0.1, x + 0.1)


def test_pool_never_exceeds_capacity_and_evicts_least_used_oldest_first():
    pool = make_pool(capacity=3)
    for i in range(3):
        add_random(pool, seed=i)
    pool.anchors[0].uses = 2  # created 0
    pool.anchors[1].uses = 0  # created 1: least used
    pool.anchors[2].uses = 0  # created 2: least used, younger
    add_random(pool, seed=3)
    assert len(pool.anchors) == 3
    assert [a.created for a in pool.anchors] == [0, 2, 3]
    for a in pool.anchors:
        a.uses = 1
    add_random(pool, seed=4)  # all tied: the oldest goes
    assert [a.created for a in pool.anchors] == [2, 3, 4]


def test_kvcomm_eviction_picks_least_used_among_five_oldest():
    pool = make_pool(capacity=7, eviction="kvcomm")
    for i in range(7):
        add_random(pool, seed=i)
    for i, a in enumerate(pool.anchors):
        a.uses = [5, 4, 3, 3, 9, 0, 0][i]  # the unused two are not among the 5 oldest
    add_random(pool, seed=8)
    assert len(pool.anchors) == 7
    assert 2 not in [a.created for a in pool.anchors]  # uses 3, oldest of the ties


def test_match_prefers_the_anchor_whose_base_is_the_source():
    pool = make_pool(capacity=5, temperature=0.01)
    for i in range(4):
        add_random(pool, n=12, seed=i)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, 8, generator=g)  # the base of anchor 2
    m = pool.match(x, x)
    assert int(m.span_weights.argmax()) == 2
    assert m.entropy < 0.1
    assert 0.0 <= m.entropy <= 1.0
    torch.testing.assert_close(m.token_weights.sum(0), torch.ones(12))


def test_uncovered_tokens_get_no_correction():
    pool = make_pool(capacity=2)
    add_random(pool, n=5, seed=0)
    add_random(pool, n=7, seed=1)
    x = torch.randn(2, 10, 8)
    m = pool.match(x, x)
    ck, cv = pool.correction(m, 10)
    assert ck.shape == (2, 10, 8)
    assert ck[:, 7:].abs().max() == 0 and ck[:, :7].abs().max() > 0
    torch.testing.assert_close(m.token_weights[:, 5:7].sum(0), torch.ones(2))


def test_full_cover_only_ignores_short_anchors():
    pool = make_pool(capacity=3, full_cover_only=True)
    add_random(pool, n=5, seed=0)
    add_random(pool, n=12, seed=1)
    assert pool.eligible(10) == [1]


@pytest.mark.parametrize("rank", [4, None])
def test_pool_bytes_match_the_formula(rank):
    pool = AnchorPool(PoolConfig(0.05, capacity=4, delta_rank=rank, base_rank=rank))
    layers, d = 2, 8
    lengths = [10, 13, 20]
    for i, n in enumerate(lengths):
        add_random(pool, n=n, seed=i)
    per = [4 * layers * (rank * (n + d) if rank else n * d) * 4 for n in lengths]
    assert pool.nbytes() == sum(per)


def test_factors_keep_full_width_when_rank_would_not_save_memory():
    m = torch.randn(2, 6, 8)  # rank 4: 4 * (6 + 8) = 56 > 48 numbers per layer
    f = factorize(m, 4)
    assert f.b is None and torch.equal(f.a, m)


@pytest.mark.parametrize("rank", [4, None])
def test_corrected_is_the_source_plus_the_correction_and_keeps_the_source(rank):
    pool = AnchorPool(PoolConfig(temperature=0.05, delta_rank=rank, base_rank=rank))
    add_random(pool, n=7, seed=0)
    add_random(pool, n=12, seed=1)
    x = torch.randn(2, 10, 8)
    kept = x.clone()
    m = pool.match(x, x)
    ck, cv = pool.correction(m, 10)
    yk = torch.stack([layer.clone() for layer in pool.corrected_layers(m, x, "k")])
    yv = torch.stack([layer.clone() for layer in pool.corrected_layers(m, x, "v")])
    torch.testing.assert_close(yk, x + ck, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(yv, x + cv, atol=1e-6, rtol=1e-6)
    assert torch.equal(x, kept) and yk.data_ptr() != x.data_ptr()


def test_match_distances_do_not_depend_on_how_many_layers_expand_at_once(monkeypatch):
    """A long anchor's base is expanded a few layers at a time; the distances are the mean
    ``|x - base|`` over layers and channels however the layers are grouped."""
    import kvcmas.methods.anchors as anchors

    pool = make_pool(capacity=2)
    add_random(pool, n=10, seed=0)
    add_random(pool, n=6, seed=1)
    x = torch.randn(2, 10, 8)
    whole = pool.match(x, x)
    monkeypatch.setattr(anchors, "_BATCH_FLOATS", 1)  # one layer at a time
    layers = pool.match(x, x)
    torch.testing.assert_close(layers.span_distance, whole.span_distance, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layers.token_weights, whole.token_weights, atol=1e-6, rtol=1e-6)
    a = pool.anchors[1]
    gap = (x[:, :6] - a.base_k.rows(6)).abs().mean(dim=(0, 2)) / x[:, :6].abs().mean((0, 2))
    torch.testing.assert_close(whole.span_distance[1], gap.mean(), atol=1e-6, rtol=1e-6)


def test_matrix_buffer_gives_as_matrices_values_in_one_reused_buffer():
    buffer = MatrixBuffer()
    long, short = torch.randn(3, 2, 9, 4).bfloat16(), torch.randn(3, 2, 5, 4).bfloat16()
    first = buffer.matrices(long)
    assert torch.equal(first, as_matrices(long)) and first.dtype == torch.float32
    again = buffer.matrices(short)  # fits: written over the same storage
    assert torch.equal(again, as_matrices(short)) and again.data_ptr() == first.data_ptr()
    assert buffer.nbytes() == 3 * 9 * 8 * 4
