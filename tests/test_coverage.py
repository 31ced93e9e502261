"""Arithmetic of the reconstruction-coverage analysis, and its error measurement on a tiny
model."""

from __future__ import annotations

import pytest
import torch

from kvcmas.eval.coverage import (
    HopError,
    best_block,
    claim_holds,
    coverage,
    coverage_markdown,
    coverage_rows,
    hop_error,
    layer_mask,
    pair_mask,
    token_mask,
    write_coverage,
)
from kvcmas.kv.segment import SegmentKV, place_segment


def test_selecting_everything_covers_all_and_nothing_covers_none():
    err = torch.rand(12, 5)
    assert coverage(err, torch.ones(12, 5, dtype=torch.bool)) == pytest.approx(1.0)
    assert coverage(err, torch.zeros(12, 5, dtype=torch.bool)) == 0.0
    assert coverage(err, token_mask(torch.rand(12), 1.0, 5)) == pytest.approx(1.0)
    assert coverage(err, token_mask(torch.rand(12), 0.0, 5)) == 0.0
    assert coverage(err, pair_mask(err, 1.0)) == pytest.approx(1.0)
    assert coverage(err, layer_mask(12, 5, 0, 5)) == pytest.approx(1.0)


def test_coverage_is_the_share_of_error_inside_the_mask():
    err = torch.tensor([[1.0, 0.0], [3.0, 4.0], [0.0, 2.0]])
    mask = token_mask(torch.tensor([0.0, 5.0, 1.0]), 1 / 3, 2)  # token 1 only
    assert mask.tolist() == [[False, False], [True, True], [False, False]]
    assert coverage(err, mask) == pytest.approx(7 / 10)
    assert coverage(err, layer_mask(3, 2, 1, 1)) == pytest.approx(6 / 10)
    assert coverage(err, pair_mask(err, 2 / 6)) == pytest.approx(7 / 10)  # pairs 4 and 3
    assert coverage(torch.zeros(3, 2), torch.ones(3, 2, dtype=torch.bool)) == 1.0


def test_best_block_and_budget_sizes():
    assert best_block(torch.tensor([1.0, 0, 5, 4, 0, 3]), 2) == 2
    assert best_block(torch.tensor([1.0, 0, 5, 4, 0, 3]), 6) == 0
    assert int(token_mask(torch.rand(20), 0.1, 3).sum()) == 2 * 3
    assert int(token_mask(torch.rand(3), 0.1, 3).sum()) == 3  # at least one token


def test_rows_report_every_rule_and_the_claim():
    g = torch.Generator().manual_seed(0)
    hops = []
    for i in range(3):
        err = torch.rand(30, 8, generator=g)
        err[:3] *= 50  # the error sits on the first tokens
        hops.append(HopError(0, f"a{i}", err, err[:, 1].clone(), torch.rand(30, generator=g)))
    rows = coverage_rows(hops, (0.1, 1.0))
    by = {(r["rule"], r["budget"]): r for r in rows}
    for rule in ("cacheblend", "attention", "random", "layer_block", "oracle_pairs"):
        assert by[(rule, 1.0)]["coverage_mean"] == pytest.approx(1.0)
    assert by[("oracle_tokens", 0.1)]["coverage_mean"] > 0.7  # the three heavy tokens
    assert by[("cacheblend", 0.1)]["coverage_mean"] > 0.7  # its score tracks the error here
    assert by[("random", 0.1)]["coverage_mean"] < 0.5
    assert (
        by[("oracle_pairs", 0.1)]["coverage_mean"]
        >= by[("oracle_tokens", 0.1)]["coverage_mean"] - 1e-9
    )
    assert not claim_holds(rows)  # budget 1.0 covers everything
    assert claim_holds([r for r in rows if r["rule"] in ("random", "oracle_pairs")][:1])


def test_write_coverage(tmp_path):
    hops = [HopError(0, "a", torch.rand(10, 4), torch.rand(10), torch.rand(10))]
    result = {
        "model": "tiny",
        "dtype": "float32",
        "workflow": "w",
        "requests": 1,
        "hops": [{}],
        "rows": coverage_rows(hops, (0.25,)),
        "claim_at_least_half_outside": True,
    }
    js, md = write_coverage(result, tmp_path / "out")
    assert js.exists() and "| layer_block" in md.read_text()
    assert "holds" in coverage_markdown(result)


def test_hop_error_measures_reuse_error_per_token_and_layer(tiny_pair):
    """Reusing a segment computed after another prefix: zero error at layer 0 (canonical frame
    is exact there), positive above; the CacheBlend score is the layer-1 value error."""
    model = tiny_pair[1]
    g = torch.Generator().manual_seed(0)
    prefix, other = (
        torch.randint(2, 128, (8,), generator=g),
        torch.randint(2, 128, (11,), generator=g),
    )
    shared, tail = (
        torch.randint(2, 128, (16,), generator=g),
        torch.randint(2, 128, (12,), generator=g),
    )
    src_cache = model.new_cache()
    model.prefill(torch.cat([other, shared]), src_cache)
    src = SegmentKV.from_cache(src_cache, 11, 27, model.inv_freq)
    reused = model.new_cache()
    model.prefill(prefix, reused)
    place_segment(reused, src, model.inv_freq)
    model.prefill(tail, reused)
    dense = model.new_cache()
    tokens = torch.cat([prefix, shared, tail])
    model.prefill(tokens, dense)
    err, score, att = hop_error(model, reused, dense, tokens.tolist(), [(8, 16)], last=10)
    assert err.shape == (16, model.config.n_layers)
    assert float(err[:, 0].max()) < 1e-8 and float(err[:, 1:].min()) > 0
    torch.testing.assert_close(
        score, err[:, 1] - ((reused.k[1, :, 8:24] - dense.k[1, :, 8:24]).pow(2).sum((0, 2)))
    )
    # Every shared row precedes the last 10 queries (causal softmax: each gets some weight),
    # and the prefix and tail take the rest of it.
    assert att.shape == (16,) and float(att.min()) > 0 and float(att.sum()) < 1
