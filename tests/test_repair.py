"""Selective repair (kvcmas.methods.repair) and its users: KVCMAS's graded repair and the
head-recompute baseline, on tiny random-weight Llama and Qwen2 models.

Exact at the ends (no repair = the method without it, everything repaired = NonShared), and
in between the repaired rows are what the model computes for them over the same mixed cache.
"""

from __future__ import annotations

import pytest
import torch

from kvcmas.errors import ConfigError
from kvcmas.kv.segment import place_segment
from kvcmas.methods import make_method
from kvcmas.methods.base import ReuseCounts
from kvcmas.methods.kvcmas import KVCMASConfig
from kvcmas.methods.nonshared import NonShared
from kvcmas.methods.relaycaching import received_attention
from kvcmas.methods.repair import fraction_count, repair_span
from tests.test_baselines import (
    PREFIX,
    SHARED,
    TAIL,
    assert_same_build,
    build,
    make_hop,
    shared_record,
    source_kv,
)
from tests.test_kvcmas import two_agents

RTOL = 1e-5


@pytest.fixture
def model(tiny_pair):
    return tiny_pair[1]


def placed(model):
    """A cache holding PREFIX and, after it, SHARED's source from another context (reused)."""
    cache = model.new_cache()
    model.prefill(list(PREFIX), cache)
    return cache, place_segment(cache, source_kv(model), model.inv_freq)


def dense_cache(model, tokens):
    cache = model.new_cache()
    model.prefill(list(tokens), cache)
    return cache


def close(a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-5)


def rows_of(cache, rows):
    return cache.k[:, :, rows], cache.v[:, :, rows]


# --- the repair machinery ------------------------------------------------------------------


@pytest.mark.parametrize("select", ["deviation", "attention"])
def test_repaired_rows_equal_a_dense_forward_over_the_mixed_cache(model, select):
    """The mixed cache: prefix dense, span layers 0..c dense (the check pass), above it the
    reused K/V of unchosen tokens. Running the chosen rows one at a time through layers c+1..
    on that cache (a different code path: single-row queries with the position mask) must give
    the rows repair_span wrote."""
    c, n, n_layers = 1, len(SHARED), model.config.n_layers
    cache, start = placed(model)
    reused = cache.clone()
    rep = repair_span(
        model, cache, SHARED, start, head=3, extra=5, select=select, check_layer=c, question=TAIL
    )
    assert rep.count == 8 and torch.equal(rep.selected[:3], torch.arange(3))
    assert rep.pairs == n * (c + 1) + 8 * (n_layers - c - 1)
    assert cache.length == start + n  # the question probe left nothing behind
    dense = dense_cache(model, PREFIX + SHARED)
    toks = torch.tensor(PREFIX + SHARED)
    hidden = model.forward(toks, torch.arange(len(toks)), dense.clone(), capture=(c + 1,))
    hidden = hidden.captured[c + 1]
    mixed = reused.clone()
    mixed.k[: c + 1] = dense.k[: c + 1, :, : mixed.length]
    mixed.v[: c + 1] = dense.v[: c + 1, :, : mixed.length]
    for i in rep.selected.tolist():
        pos = torch.tensor([start + i])
        model.forward(
            None, pos, mixed, layers=range(c + 1, n_layers), hidden=hidden[pos], logits_rows=None
        )
    close(mixed.k[:, :, : mixed.length], cache.k[:, :, : cache.length])
    close(mixed.v[:, :, : mixed.length], cache.v[:, :, : cache.length])
    # Unchosen rows keep the reused K/V above the check layer.
    others = [i for i in range(n) if i not in rep.selected.tolist()]
    idx = torch.tensor(others) + start
    assert torch.equal(cache.k[c + 1 :, :, idx], reused.k[c + 1 :, :, idx])


def test_attention_selection_follows_the_questions_dense_attention(model):
    """After the check pass the span's low layers are dense, so the question placed after the
    span attends exactly as in a dense forward of prefix + span + question."""
    c = 2
    cache, start = placed(model)
    rep = repair_span(
        model, cache, SHARED, start, extra=4, select="attention", check_layer=c, question=TAIL
    )
    assert rep.probe_tokens == len(TAIL) * c
    toks = torch.tensor(PREFIX + SHARED + TAIL)
    ref = model.new_cache()
    h = model.forward(toks, torch.arange(len(toks)), ref, capture=(c,)).captured[c]
    rows = torch.arange(start + len(SHARED), len(toks))
    q, _, _ = model.project_kv(c, h[rows], rows)
    att = received_attention(q, ref.k[c, :, : start + len(SHARED)], rows, start)
    assert torch.equal(rep.selected, torch.topk(att, 4).indices.sort().values)


def test_head_only_repair_gives_dense_head_rows_without_a_check_pass(model):
    n_layers = model.config.n_layers
    cache, start = placed(model)
    reused = cache.clone()
    rep = repair_span(model, cache, SHARED, start, head=6)
    assert rep.pairs == 6 * n_layers and torch.equal(rep.selected, torch.arange(6))
    dense = dense_cache(model, PREFIX + SHARED)
    head, rest = torch.arange(start, start + 6), torch.arange(start + 6, start + len(SHARED))
    for got, want in zip(rows_of(cache, head), rows_of(dense, head), strict=True):
        close(got, want)
    for got, want in zip(rows_of(cache, rest), rows_of(reused, rest), strict=True):
        assert torch.equal(got, want)


def test_head_selection_lengthens_the_head_and_pays_no_check_pass(model):
    """select="head": the extra tokens are the ones right after the head, recomputed through
    every layer from their embeddings, exactly as a head of head + extra tokens."""
    cache, start = placed(model)
    rep = repair_span(model, cache, SHARED, start, head=2, extra=4, select="head")
    want, _ = placed(model)
    repair_span(model, want, SHARED, start, head=6)
    assert rep.pairs == 6 * model.config.n_layers and torch.equal(rep.selected, torch.arange(6))
    assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)


@pytest.mark.device
def test_repairing_every_token_is_dense(model):
    dense = dense_cache(model, PREFIX + SHARED)
    every = ({"extra": len(SHARED)}, {"head": 4, "extra": 100}, {"head": 100})
    for kw in every + ({"head": 1, "extra": 100, "select": "head"},):
        cache, _ = placed(model)
        repair_span(model, cache, SHARED, len(PREFIX), **kw)
        close(cache.k[:, :, : cache.length], dense.k[:, :, : dense.length])
        close(cache.v[:, :, : cache.length], dense.v[:, :, : dense.length])


def test_repair_refuses_bad_arguments(model):
    cache, start = placed(model)
    with pytest.raises(ValueError, match="check_layer"):
        repair_span(model, cache, SHARED, start, extra=1, check_layer=model.config.n_layers)
    with pytest.raises(ValueError, match="select"):
        repair_span(model, cache, SHARED, start, extra=1, select="random")
    with pytest.raises(ValueError, match="last thing placed"):
        repair_span(model, cache, SHARED, start - 1, extra=1)


# --- head recompute ------------------------------------------------------------------------


@pytest.mark.device
def test_head_recompute_ends_are_nonshared_and_fullshared(model):
    hop = make_hop(model, source_kv(model))
    dense = build(NonShared(), model, hop)
    full = build(make_method("fullshared"), model, hop)
    everything = build(make_method("headrecompute", head_tokens=len(SHARED)), model, hop)
    assert_same_build(everything, dense)
    assert shared_record(everything[2]).decision == "dense"
    nothing = build(make_method("headrecompute", head_tokens=0), model, hop)
    assert_same_build(nothing, full, atol=0)
    assert shared_record(nothing[2]).decision == "reuse"


def test_head_recompute_accounting(model):
    n, n_layers = len(SHARED), model.config.n_layers
    hop = make_hop(model, source_kv(model))
    method = make_method("headrecompute", head_tokens=5)
    assert method.recomputes_whole(5) and not method.recomputes_whole(6)
    assert method.recomputed_tokens(6) == 5 and method.recomputed_tokens(3) == 3
    _, _, records = build(method, model, hop)
    rec = shared_record(records)
    assert (rec.decision, rec.computed_pairs, rec.served_tokens) == ("partial", 5 * n_layers, n - 5)
    counts = ReuseCounts.of(records, n_layers)
    assert counts.rho == (n - 5) / n and counts.recompute_fraction == 5 / n


# --- KVCMAS graded repair ------------------------------------------------------------------

QUERY_LEN = 12


def queries(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(30, 128, (QUERY_LEN,), generator=g).tolist() for _ in range(count)]


def run_stream(method, model, qs):
    return [two_agents(method, model, q, i)[1] for i, q in enumerate(qs)]


def query_record(build_):
    return next(r for r in build_.records if r.slot == "query")


@pytest.mark.device
def test_budget_zero_is_kvcmas_without_repair(model):
    """repair_from above any entropy: the budget is 0 everywhere, so the hops are bitwise
    today's KVCMAS, reuses included."""
    qs = queries(4)
    plain = run_stream(make_method("kvcmas", tau=2.0, min_anchors=2), model, qs)
    graded = make_method("kvcmas", tau=2.0, min_anchors=2, repair_max=0.5, repair_from=1.5)
    repaired = run_stream(graded, model, qs)
    assert [query_record(b).decision for b in repaired] == ["dense", "dense", "reuse", "reuse"]
    for x, y in zip(plain, repaired, strict=True):
        assert torch.equal(x.cache.k[:, :, : x.cache.length], y.cache.k[:, :, : y.cache.length])
        assert torch.equal(x.cache.v[:, :, : x.cache.length], y.cache.v[:, :, : y.cache.length])
        assert torch.equal(x.last_logits, y.last_logits)


@pytest.mark.device
@pytest.mark.parametrize(
    "options",
    [
        {"repair_head": 100},  # a head longer than the span
        # a head one short and any budget above 0: head selection's extra token completes it
        {"repair_head": QUERY_LEN - 1, "repair_select": "head"},
    ],
)
def test_repairing_the_whole_span_is_nonshared(model, options):
    qs = queries(4)
    graded = make_method("kvcmas", tau=2.0, min_anchors=2, repair_max=0.1, **options)
    pairs = zip(run_stream(graded, model, qs), run_stream(NonShared(), model, qs), strict=True)
    for got, want in pairs:
        n = want.cache.length
        close(got.cache.k[:, :, :n], want.cache.k[:, :, :n])
        close(got.cache.v[:, :, :n], want.cache.v[:, :, :n])
        close(got.last_logits, want.last_logits)
    rec = query_record(got)
    assert rec.decision == "dense" and rec.served_tokens == 0
    # A head covering the span prefills it without matching (what the serving connector leaves
    # to the engine); a head one short is completed by a budget above 0.
    covered = options["repair_head"] >= QUERY_LEN
    assert graded.recomputes_whole(QUERY_LEN) == covered
    assert rec.details.get("repair_budget", 0) > 0 or covered
    assert graded.recomputed_tokens(100) == options["repair_head"]
    assert not make_method("kvcmas", repair_head=100).recomputes_whole(QUERY_LEN)  # repair off
    assert make_method("kvcmas", repair_head=100).recomputed_tokens(QUERY_LEN) == 0


@pytest.mark.parametrize("select", ["deviation", "attention"])
def test_graded_repair_records_budget_selection_and_exact_counts(model, select):
    n_layers, head, c = model.config.n_layers, 2, 1
    method = make_method(
        "kvcmas", tau=2.0, min_anchors=2, repair_max=0.8, repair_head=head, repair_select=select
    )
    builds = run_stream(method, model, queries(4))
    rec = query_record(builds[-1])
    budget = method.config.repair_budget(rec.entropy)
    assert budget == pytest.approx(0.8 * rec.entropy / 2.0) and 0 < budget < 0.8
    k = head + fraction_count(budget, QUERY_LEN)
    assert rec.decision == "partial" and rec.details["selected"] == k
    assert rec.details["repair_budget"] == pytest.approx(budget, abs=1e-6)
    assert rec.computed_pairs == QUERY_LEN * (c + 1) + k * (n_layers - c - 1)
    assert rec.served_tokens == QUERY_LEN - k
    counts = ReuseCounts.of(builds[-1].records, n_layers)
    assert counts.rho == (QUERY_LEN - k) / QUERY_LEN


def test_graded_head_repair_spends_its_budget_on_the_head(model):
    n_layers, head = model.config.n_layers, 2
    method = make_method(
        "kvcmas", tau=2.0, min_anchors=2, repair_max=0.8, repair_head=head, repair_select="head"
    )
    builds = run_stream(method, model, queries(4))
    rec = query_record(builds[-1])
    k = head + fraction_count(method.config.repair_budget(rec.entropy), QUERY_LEN)
    assert rec.decision == "partial" and rec.details["selected"] == k < QUERY_LEN
    assert rec.computed_pairs == k * n_layers and rec.served_tokens == QUERY_LEN - k


CHECKED = {"tau": 2.0, "min_anchors": 2, "repair_max": 0.1, "repair_head": 4,
           "repair_select": "head"}  # fmt: skip


def checked_stream(model, corrupt: bool, **options):
    """Three sessions of one query: the first two prefill densely and record anchors of this
    very source, so the third's correction is nearly exact, or, with ``corrupt``, points
    three times as far the wrong way."""
    method = make_method("kvcmas", check_on_head=True, **CHECKED, **options)
    q = queries(1)[0]
    run_stream(method, model, [q, q])
    method.flush()
    if corrupt:
        for anchor in method.pools["query", "b"].anchors:
            anchor.delta_k.a.mul_(-3)
            anchor.delta_v.a.mul_(-3)
    return method, q, two_agents(method, model, q, 2)[1]


def same_cache(got, want):
    n = want.cache.length
    close(got.cache.k[:, :, :n], want.cache.k[:, :, :n])
    close(got.cache.v[:, :, :n], want.cache.v[:, :, :n])
    close(got.last_logits, want.last_logits)


def test_checked_correction_that_helps_is_kept_as_graded_head_repair(model):
    _, q, got = checked_stream(model, corrupt=False)
    rec = query_record(got)
    assert rec.decision == "partial" and rec.details["correction_kept"] is True
    assert rec.details["head_error_corrected"] < rec.details["head_error_source"]
    h = rec.details["selected"]
    assert h == 4 + fraction_count(0.1 * rec.entropy / 2.0, QUERY_LEN) < QUERY_LEN
    assert (rec.computed_pairs, rec.served_tokens) == (h * model.config.n_layers, QUERY_LEN - h)
    # The same reuse without the check: correct all, then recompute the head over it.
    unchecked = make_method("kvcmas", **CHECKED)
    want = run_stream(unchecked, model, [q, q, q])[-1]
    assert query_record(want).details["selected"] == h
    same_cache(got, want)


def test_checked_correction_that_hurts_is_dropped_as_head_recompute(model):
    _, q, got = checked_stream(model, corrupt=True)
    rec = query_record(got)
    assert rec.decision == "partial" and rec.details["correction_kept"] is False
    assert rec.details["head_error_corrected"] > rec.details["head_error_source"]
    head = make_method("headrecompute", head_tokens=rec.details["selected"])
    want = two_agents(head, model, q, 2)[1]
    same_cache(got, want)


def test_head_first_match_that_keeps_the_correction_equals_the_whole_span_check(model):
    """The check passes on the head's own match, so the span is matched whole for its tail:
    the cache is the full-match check's (the budget's single extra token makes both heads
    4 + 1 long whatever the two entropies)."""
    _, q, got = checked_stream(model, corrupt=False, match_head_first=True)
    _, _, want = checked_stream(model, corrupt=False)
    rec, full = query_record(got), query_record(want)
    assert rec.details["correction_kept"] is True and rec.details["selected"] == 5
    assert rec.details["matched_tokens"] == 4 + QUERY_LEN
    assert full.details["matched_tokens"] == QUERY_LEN and full.details["selected"] == 5
    same_cache(got, want)


def test_head_first_match_that_drops_the_correction_never_matches_the_tail(model):
    _, q, got = checked_stream(model, corrupt=True, match_head_first=True)
    rec = query_record(got)
    assert rec.details["correction_kept"] is False and rec.details["matched_tokens"] == 4
    head = make_method("headrecompute", head_tokens=rec.details["selected"])
    same_cache(got, two_agents(head, model, q, 2)[1])


def test_budget_grows_with_entropy_up_to_repair_max():
    c = KVCMASConfig(tau=0.9, repair_max=0.5, repair_from=0.3)
    assert c.repair_budget(0.0) == c.repair_budget(0.3) == 0.0
    assert c.repair_budget(0.6) == pytest.approx(0.25)
    assert c.repair_budget(0.9) == pytest.approx(0.5) == c.repair_budget(1.0)
    assert KVCMASConfig().repair_budget(0.99) == 0.0  # off by default


@pytest.mark.parametrize(
    "method, options, field",
    [
        ("kvcmas", {"repair_max": 1.5}, "repair_max"),
        ("kvcmas", {"repair_head": -1}, "repair_head"),
        ("kvcmas", {"repair_select": "random"}, "repair_select"),
        ("kvcmas", {"repair_max": 0.2, "repair_from": 0.995}, "repair_from"),
        ("kvcmas", {"repair_check_layer": -1}, "repair_check_layer"),
        ("kvcmas", {"check_on_head": True, "repair_max": 0.1}, "check_on_head"),  # deviation
        ("kvcmas", {"check_on_head": True, "repair_select": "head"}, "check_on_head"),  # no repair
        ("kvcmas", {**CHECKED, "check_on_head": True, "repair_head": 1}, "check_on_head"),
        ("kvcmas", {**CHECKED, "match_head_first": True}, "match_head_first"),  # no check
        ("headrecompute", {"head_tokens": -2}, "head_tokens"),
        ("headrecompute", {"head_tokens": "x"}, "head_tokens"),
    ],
)
def test_bad_repair_options_name_the_field(method, options, field):
    with pytest.raises(ConfigError, match=field):
        make_method(method, options)
