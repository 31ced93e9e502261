"""The selective-recomputation and delta baselines: CacheBlend, DroidSpeak, RelayCaching,
GraphFlow.

Each method runs on hand-built hops of tiny random-weight models: a system prefix, a shared
segment whose source cache was computed after a *different* prefix, and private text after
it. Full recomputation must give NonShared's cache and logits, zero recomputation
FullShared's, and recomputed rows must equal what the model computes for them in the same
context.
"""

from __future__ import annotations

import pytest
import torch

from kvcmas.chat import Segment
from kvcmas.kv.segment import SegmentKV
from kvcmas.methods import METHODS, make_method
from kvcmas.methods.base import Hop, ReuseCounts, SharedSegment, standalone_prefill
from kvcmas.methods.cacheblend import selected_count
from kvcmas.methods.droidspeak import default_block
from kvcmas.methods.fullshared import FullShared
from kvcmas.methods.nonshared import NonShared
from kvcmas.methods.relaycaching import default_layers, received_attention
from kvcmas.model.generate import greedy_decode

ATOL = 1e-5


def ids(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(2, 128, (n,), generator=g).tolist())


PREFIX, OTHER_PREFIX = ids(9, 1), ids(13, 2)
SHARED, TAIL = ids(24, 3), ids(7, 4)


def source_kv(model, prefix=OTHER_PREFIX, tokens=SHARED) -> SegmentKV:
    """The shared segment's cache as another agent (``prefix``) computed it densely."""
    cache = model.new_cache()
    model.prefill(list(prefix + tokens), cache)
    return SegmentKV.from_cache(cache, len(prefix), len(prefix) + len(tokens), model.inv_freq)


def make_hop(model, source: SegmentKV | None, tokens=SHARED, session="s0", agent="b") -> Hop:
    shared = SharedSegment("query", "query", tokens)
    if source is not None:
        shared.record("a", source)
    segments = [Segment(PREFIX), Segment(tokens, slot="query"), Segment(TAIL)]
    return Hop(agent, session, 1, segments, {"query": shared})


def build(method, model, hop):
    cache = model.new_cache()
    model.prefill(list(PREFIX), cache)
    out = method.build(hop, model, cache)
    return out.cache, out.last_logits, out.records


def shared_record(records):
    return next(r for r in records if r.slot is not None)


def assert_same_build(a, b, atol=ATOL):
    (ca, la, _), (cb, lb, _) = a, b
    n = ca.length
    assert n == cb.length
    torch.testing.assert_close(ca.k[:, :, :n], cb.k[:, :, :n], atol=atol, rtol=1e-4)
    torch.testing.assert_close(ca.v[:, :, :n], cb.v[:, :, :n], atol=atol, rtol=1e-4)
    torch.testing.assert_close(la, lb, atol=atol, rtol=1e-4)


def recompute_fraction(records, n_layers: int) -> float:
    return ReuseCounts.of(records, n_layers).recompute_fraction


def span(cache, start, n):
    return cache.k[:, :, start : start + n], cache.v[:, :, start : start + n]


@pytest.fixture
def model(tiny_pair):
    return tiny_pair[1]


@pytest.fixture
def dense_and_full(model):
    hop = make_hop(model, source_kv(model))
    return hop, build(NonShared(), model, hop), build(FullShared(), model, hop)


def full_recompute_methods(n_layers: int):
    return [
        make_method("cacheblend", ratio=1.0),
        make_method("cacheblend", ratio=1.0, check_layer=0, select_by="key"),
        make_method("droidspeak", block=f"0:{n_layers}"),
        make_method("relaycaching", layers=f"0:0:{n_layers - 1}", tau_dev=0.0),
    ]


def zero_recompute_methods():
    inf = float("inf")
    return [
        make_method("cacheblend", ratio=0.0),
        make_method("droidspeak", block="0:0"),
        make_method("droidspeak", block="2:2"),
        make_method("relaycaching", layers="0:0:3", tau_dev=inf, tau_inf=inf),
    ]


# --- the ends of every knob ----------------------------------------------------------------


@pytest.mark.device
def test_full_recompute_reproduces_nonshared(model, dense_and_full):
    hop, dense, _ = dense_and_full
    for method in full_recompute_methods(model.config.n_layers):
        out = build(method, model, hop)
        assert_same_build(out, dense)
        assert recompute_fraction(out[2], model.config.n_layers) == 1.0, method.params()
        assert shared_record(out[2]).decision == "dense"


@pytest.mark.device
def test_zero_recompute_reproduces_fullshared(model, dense_and_full):
    hop, _, full = dense_and_full
    for method in zero_recompute_methods():
        out = build(method, model, hop)
        assert_same_build(out, full, atol=1e-6)
        assert recompute_fraction(out[2], model.config.n_layers) == 0.0, method.params()
        assert shared_record(out[2]).decision == "reuse"


@pytest.mark.device
def test_first_consumer_prefills_densely(model):
    hop = make_hop(model, None)
    dense = build(NonShared(), model, hop)
    for method in [
        make_method("cacheblend"),
        make_method("droidspeak"),
        make_method("droidspeak", block="2:4"),
        make_method("relaycaching"),
        make_method("graphflow"),
    ]:
        out = build(method, model, hop)
        assert_same_build(out, dense)
        assert shared_record(out[2]).decision == "dense"


@pytest.mark.device
def test_exact_source_makes_any_selection_exact(model):
    """With a source computed after the same prefix, reused rows are dense rows: whatever the
    methods select, the hop equals NonShared's."""
    hop = make_hop(model, source_kv(model, prefix=PREFIX))
    dense = build(NonShared(), model, hop)
    for method in [
        make_method("cacheblend", ratio=0.3),
        make_method("droidspeak", block="1:3"),
        make_method("relaycaching", layers="1:2:3"),
    ]:
        assert_same_build(build(method, model, hop), dense)


# --- CacheBlend ----------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, check_layer", [(0.15, 1), (0.5, 0), (0.25, 2)])
def test_cacheblend_selected_rows_are_recomputed_in_the_reused_context(
    model, dense_and_full, ratio, check_layer
):
    hop, dense, full = dense_and_full
    n_layers, n, start = model.config.n_layers, len(SHARED), len(PREFIX)
    cache, _, records = build(
        make_method("cacheblend", ratio=ratio, check_layer=check_layer), model, hop
    )
    k = selected_count(ratio, n)
    rec = shared_record(records)
    assert rec.details["selected"] == k and rec.decision == "partial"
    assert rec.computed_pairs == n * (check_layer + 1) + k * (n_layers - check_layer - 1)
    c1 = check_layer + 1
    # Layers up to the check layer ran for every token: exactly dense.
    for got, want in zip(span(cache, start, n), span(dense[0], start, n), strict=True):
        torch.testing.assert_close(got[:c1], want[:c1], atol=ATOL, rtol=1e-4)
    # Above it, exactly k rows differ from the reused (FullShared) cache.
    changed = (span(cache, start, n)[1][c1:] - span(full[0], start, n)[1][c1:]).abs()
    rows = torch.nonzero(changed.amax((0, 1, 3)) > 0).flatten()
    assert len(rows) == k
    # Those rows equal the model's own computation of them, entering layer c+1 with the dense
    # hidden state (from an independent dense forward) in the final context.
    ref_cache = model.new_cache()
    toks = torch.tensor(PREFIX + SHARED)
    hidden = model.forward(toks, torch.arange(len(toks)), ref_cache, capture=(c1,)).captured[c1]
    again = cache.clone()
    model.forward(
        None,
        rows + start,
        again,
        layers=range(c1, n_layers),
        hidden=hidden[start + rows],
        logits_rows=None,
    )
    torch.testing.assert_close(again.k, cache.k[:, :, : cache.length], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(again.v, cache.v[:, :, : cache.length], atol=ATOL, rtol=1e-4)


def test_cacheblend_selects_the_most_deviating_values(model):
    """Perturb the source's values of chosen tokens at the check layer: exactly those tokens
    are recomputed above it (visible where the source also carries noise at layer 3)."""
    src = source_kv(model, prefix=PREFIX)  # exact source: no other deviation at layer 1
    picked = torch.tensor([3, 11, 17])
    src.v[1, :, picked] += 5.0
    src.v[3] += 0.01 * torch.randn_like(src.v[3])
    hop = make_hop(model, src)
    start, n = len(PREFIX), len(SHARED)
    cache, _, records = build(make_method("cacheblend", ratio=3 / n, check_layer=1), model, hop)
    assert shared_record(records).details["selected"] == 3
    dense = build(NonShared(), model, hop)[0]
    exact = (span(cache, start, n)[1][3] - span(dense, start, n)[1][3]).abs().amax((0, 2))
    assert torch.equal(torch.nonzero(exact < 1e-5).flatten(), picked)


def test_cacheblend_refuses_bad_parameters(model, dense_and_full):
    with pytest.raises(ValueError, match="ratio"):
        make_method("cacheblend", ratio=1.5)
    with pytest.raises(ValueError, match="select_by"):
        make_method("cacheblend", select_by="query")
    with pytest.raises(ValueError, match="check_layer"):
        build(
            make_method("cacheblend", check_layer=model.config.n_layers), model, dense_and_full[0]
        )


# --- DroidSpeak ----------------------------------------------------------------------------


def test_droidspeak_block_runs_from_the_saved_hidden_state(model):
    """The first consumer saves its hidden state at s; the next hop reuses its cache outside
    [s, e) and recomputes the block from that state in its own context."""
    n, start = len(SHARED), len(PREFIX)
    method = make_method("droidspeak", block="1:3")
    first = make_hop(model, None, agent="a")
    other = model.new_cache()
    model.prefill(list(OTHER_PREFIX), other)
    rec = method.build_shared(first, first.segments[1], first.shared["query"], model, other)
    assert rec.decision == "dense" and method.memory_bytes() > 0
    saved = SegmentKV.from_cache(other, len(OTHER_PREFIX), other.length, model.inv_freq)
    hop = make_hop(model, saved)
    cache, _, records = build(method, model, hop)
    rec = shared_record(records)
    assert rec.details == {"source": "a", "block": [1, 3], "from_layer": 1}
    assert rec.computed_pairs == n * 2
    full = build(FullShared(), model, hop)[0]
    for got, reused in zip(span(cache, start, n), span(full, start, n), strict=True):
        torch.testing.assert_close(got[:1], reused[:1], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[3:], reused[3:], atol=1e-6, rtol=0)
    # Reference: layers 1..2 for the segment from the other agent's hidden state at layer 1.
    ref = model.new_cache()
    toks = torch.tensor(OTHER_PREFIX + SHARED)
    h1 = model.forward(toks, torch.arange(len(toks)), ref, capture=(1,)).captured[1]
    again = build(FullShared(), model, hop)[0]
    rows = torch.arange(start, start + n)
    model.forward(None, rows, again, layers=range(1, 3), hidden=h1[len(OTHER_PREFIX) :])
    torch.testing.assert_close(span(cache, start, n)[0][1:3], span(again, start, n)[0][1:3])
    torch.testing.assert_close(span(cache, start, n)[1][1:3], span(again, start, n)[1][1:3])


def test_droidspeak_without_saved_state_starts_at_layer_zero(model, dense_and_full):
    hop = dense_and_full[0]
    cache, _, records = build(make_method("droidspeak", block="2:3"), model, hop)
    rec = shared_record(records)
    assert rec.details["from_layer"] == 0 and rec.computed_pairs == 3 * len(SHARED)


def test_droidspeak_default_and_bad_blocks(model, dense_and_full):
    assert default_block(30) == (6, 28) and default_block(4) == (1, 4)
    method = make_method("droidspeak")
    build(method, model, dense_and_full[0])
    assert method.params()["block"] == list(default_block(model.config.n_layers))
    with pytest.raises(ValueError, match="block"):
        make_method("droidspeak", block="5:2")
    with pytest.raises(ValueError, match="block"):
        make_method("droidspeak", block="a:b")
    with pytest.raises(ValueError, match="exceeds"):
        build(make_method("droidspeak", block="0:9"), model, dense_and_full[0])


def test_layer_specs_read_from_profile_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"block": [2, 5], "layers": [1, 2, 3]}')
    assert make_method("droidspeak", block=str(path)).params()["block"] == [2, 5]
    assert make_method("relaycaching", layers=str(path)).params()["layers"] == [1, 2, 3]


def test_decode_capture_keeps_every_output_tokens_hidden_state(model):
    prompt = list(PREFIX + SHARED)
    cache = model.new_cache()
    logits = model.prefill(prompt, cache)
    out = greedy_decode(model, cache, logits, 6, stop=set(), capture=(2,))
    assert out.captured[2].shape[0] == len(out.tokens) == 6
    ref = model.new_cache()
    toks = torch.tensor(prompt + out.tokens)
    h = model.forward(toks, torch.arange(len(toks)), ref, capture=(2,)).captured[2]
    torch.testing.assert_close(out.captured[2], h[len(prompt) :], atol=ATOL, rtol=1e-4)
    again = model.new_cache()
    plain = greedy_decode(model, again, model.prefill(prompt, again), 6, stop=set())
    assert plain.tokens == out.tokens and plain.captured == {}


# --- RelayCaching --------------------------------------------------------------------------


def test_relaycaching_bands(model, dense_and_full):
    hop, dense, full = dense_and_full
    n, start = len(SHARED), len(PREFIX)
    cache, _, records = build(
        make_method("relaycaching", layers="1:2:2", tau_dev=1.0, tau_inf=1.45), model, hop
    )
    rec = shared_record(records)
    k = rec.details["selected"]
    assert 0 < k < n and rec.computed_pairs == n * 2 + k * 1  # band run from layer 0
    assert rec.details["from_layer"] == 0  # no saved state at layer 1 for this source
    got, reused, exact = span(cache, start, n), span(full[0], start, n), span(dense[0], start, n)
    for g, r, x in zip(got, reused, exact, strict=True):
        torch.testing.assert_close(g[:2], x[:2], atol=ATOL, rtol=1e-4)  # band: all tokens
        torch.testing.assert_close(g[3:], r[3:], atol=1e-6, rtol=0)  # above L_end: reused
    changed = (got[1][2] - reused[1][2]).abs().amax((0, 2)) > 0
    assert int(changed.sum()) == k


def test_received_attention_is_a_distribution():
    q = torch.randn(4, 3, 8)
    keys = torch.randn(2, 10, 8)
    att = received_attention(q, keys, torch.tensor([7, 8, 9]), 0)
    assert att.shape == (10,) and abs(float(att.sum()) - 1) < 1e-5
    assert float(received_attention(q, keys, torch.tensor([3, 4, 5]), 6).sum()) == 0.0


def test_relaycaching_default_layers():
    assert default_layers(30) == (14, 17, 25) and default_layers(4) == (2, 2, 3)
    with pytest.raises(ValueError):
        make_method("relaycaching", layers="3:2:5")
    with pytest.raises(ValueError):
        make_method("relaycaching", tau_dev=-1)


# --- GraphFlow -----------------------------------------------------------------------------


def test_graphflow_base_equals_standalone_prefill(model, dense_and_full):
    hop = dense_and_full[0]
    n, start, n_layers = len(SHARED), len(PREFIX), model.config.n_layers
    cache, _, records = build(make_method("graphflow", residual_topk=0), model, hop)
    rec = shared_record(records)
    assert rec.computed_pairs == n * n_layers and rec.details["residual_tokens"] == 0
    alone = model.new_cache()
    model.prefill(list(SHARED), alone)
    placed = SegmentKV.from_cache(alone, 0, n, model.inv_freq).placed_keys(start, model.inv_freq)
    torch.testing.assert_close(span(cache, start, n)[0], placed, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(span(cache, start, n)[1], alone.v[:, :, :n])


def test_graphflow_records_a_residual_then_applies_it(model):
    n, start = len(SHARED), len(PREFIX)
    method = make_method("graphflow", residual_topk=5)
    hop = make_hop(model, source_kv(model))
    first = build(method, model, hop)
    assert shared_record(first[2]).decision == "dense"
    assert ("query", "b") not in method.residuals  # recorded after the first token
    method.after_hop(hop, type("B", (), {"cache": first[0]})())
    residual = method.residuals[("query", "b")]
    assert len(residual.indices) == 5 and method.memory_bytes() > 0
    cache, _, records = build(method, model, hop)  # same path and tokens
    rec = shared_record(records)
    assert rec.details == {"base": "cached", "residual_tokens": 5}  # base made in after_hop
    assert rec.computed_pairs == 0 and rec.decision == "reuse"
    base = standalone_prefill(model, SHARED)
    dense = SegmentKV.from_cache(first[0], start, start + n, model.inv_freq)
    got = SegmentKV.from_cache(cache, start, start + n, model.inv_freq)
    rest = torch.ones(n, dtype=torch.bool)
    rest[residual.indices] = False
    torch.testing.assert_close(got.v[:, :, residual.indices], dense.v[:, :, residual.indices])
    torch.testing.assert_close(got.v[:, :, rest], base.v[:, :, rest])
    # Fewer tokens than the recorded indices: only indices below the length apply.
    short = SHARED[:10]
    got_short = build(method, model, make_hop(model, source_kv(model, tokens=short), short))
    expected = int((residual.indices < 10).sum())
    assert shared_record(got_short[2]).details["residual_tokens"] == expected


def test_graphflow_computes_a_base_once_per_request(model, dense_and_full):
    hop, n_layers = dense_and_full[0], model.config.n_layers
    method = make_method("graphflow", residual_topk=0)
    first, again = build(method, model, hop), build(method, model, hop)
    assert shared_record(first[2]).computed_pairs == len(SHARED) * n_layers
    assert shared_record(again[2]).details["base"] == "cached"
    assert_same_build(first, again, atol=0)
    later = make_hop(model, source_kv(model), session="s1")
    assert shared_record(build(method, model, later)[2]).details["base"] == "computed"


def test_graphflow_bases_survive_interleaved_sessions_within_the_bound(model):
    """Served, a method object sees hops of many sessions in turn. Each session's base is
    computed once while the bound has room; with bound 0 (`kvcmas run`, sessions one after
    another) a session switch drops it, so the serving bound is what made GraphFlow reuse."""
    for max_bytes, kept in ((0, "computed"), (1 << 20, "cached")):
        method = make_method("graphflow", residual_topk=0)
        method.session_state.max_bytes = max_bytes
        for session in ("s0", "s1", "s0"):
            got = build(method, model, make_hop(model, source_kv(model), session=session))
        assert shared_record(got[2]).details["base"] == kept


def test_kept_standalone_prefill_extends_the_longest_kept_prefix(model):
    """A prefill is causal: built on a kept prefix it equals the prefill of the whole span,
    with only the new tokens computed; the prefix it covers is no longer kept separately,
    and a shorter span is served from inside it."""
    from kvcmas.methods.base import kept_standalone_prefill
    from kvcmas.methods.session_state import SessionState

    state = SessionState()
    head, _ = kept_standalone_prefill(state, "s", "base", model, SHARED[:10])
    whole, computed = kept_standalone_prefill(state, "s", "base", model, SHARED)
    assert computed == len(SHARED) - 10 and len(state.items("s")) == 1
    expected = standalone_prefill(model, SHARED)
    torch.testing.assert_close(whole.k, expected.k, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(whole.v, expected.v, atol=ATOL, rtol=1e-5)
    again, computed = kept_standalone_prefill(state, "s", "base", model, SHARED[:10])
    assert computed == 0 and torch.equal(again.k, whole.k[:, :, :10])
    assert kept_standalone_prefill(state, "s", "reference", model, SHARED)[1] == len(SHARED)


def test_graphflow_base_extending_a_kept_one_computes_only_the_new_tokens(model):
    """The connector's later hop matches the document with the notes after it: one span
    extending the earlier hop's. Its base is the earlier base plus the new tokens' prefill,
    the same KV as a base computed whole, and only the new tokens count as computed."""
    n_layers, head = model.config.n_layers, 15
    method = make_method("graphflow", residual_topk=0)
    build(method, model, make_hop(model, source_kv(model, tokens=SHARED[:head]), SHARED[:head]))
    got = build(method, model, make_hop(model, source_kv(model)))
    rec = shared_record(got[2])
    assert rec.details["base"] == "extended" and rec.served_tokens == head
    assert rec.computed_pairs == (len(SHARED) - head) * n_layers and rec.decision == "partial"
    fresh = make_method("graphflow", residual_topk=0)
    whole = build(fresh, model, make_hop(model, source_kv(model)))
    assert_same_build(got, whole)


def test_graphflow_topk_covering_the_segment_is_dense(model, dense_and_full):
    hop, dense, _ = dense_and_full
    method = make_method("graphflow", residual_topk=len(SHARED))
    first = build(method, model, hop)
    method.after_hop(hop, type("B", (), {"cache": first[0]})())
    assert_same_build(build(method, model, hop), dense, atol=1e-4)


# --- registry ------------------------------------------------------------------------------


def test_methods_are_registered_with_their_cli_parameters():
    for name in ["cacheblend", "droidspeak", "relaycaching", "graphflow"]:
        assert name in METHODS
    assert make_method("cacheblend", ratio=0.3, check_layer=2, select_by="key").params() == {
        "ratio": 0.3,
        "check_layer": 2,
        "select_by": "key",
    }
    assert make_method("droidspeak", block="0:4").params()["block"] == [0, 4]
    relay = make_method("relaycaching", layers="1:2:3", tau_dev=1.2, tau_inf=1.1).params()
    assert relay["layers"] == [1, 2, 3] and relay["tau_dev"] == 1.2
    assert make_method("graphflow", residual_topk=4).params() == {"residual_topk": 4}
    with pytest.raises(ValueError, match="method 'graphflow' has no option 'ratio'"):
        make_method("graphflow", ratio=0.5)


# --- on the real model, through the runner -------------------------------------------------


@pytest.mark.real_model
def test_methods_through_the_runner_on_the_default_model(real_model):
    """Saved hidden states reach later hops (query: first consumer; agent output: decode),
    recompute fractions are what the parameters say, GraphFlow records then applies."""
    from kvcmas.workflow.runner import Runner
    from kvcmas.workflow.spec import AgentSpec, Workflow

    wf = Workflow(
        name="two",
        agents=(
            AgentSpec("scout", "You are a scout.", "Question:\n{query}\n\nAnswer briefly.", 8),
            AgentSpec(
                "judge",
                "You are a strict judge.",
                "Question:\n{query}\n\nThe scout said:\n{scout}\n\nVerdict?",
                8,
            ),
        ),
        final="judge",
    )
    request = {"query": "Which planet is known as the red planet?"}
    n_layers = real_model.config.n_layers

    def judge_hop(method):
        runner = Runner(real_model, wf, method)
        return runner.run(request).hops[1]

    droid = make_method("droidspeak", block="3:9")
    hop = judge_hop(droid)
    assert [s["details"]["from_layer"] for s in hop.segments if s.get("slot")] == [3, 3]
    assert hop.recompute_fraction == pytest.approx(6 / n_layers)
    assert hop.rho == 1.0  # a fixed layer block does not unselect any token
    assert hop.method_state_bytes == droid.memory_bytes() > 0

    relay = judge_hop(make_method("relaycaching"))
    a, d, e = default_layers(n_layers)
    assert all(s["details"]["from_layer"] == a for s in relay.segments if s.get("slot"))
    assert (d - a) / n_layers < relay.recompute_fraction < (e - a + 1) / n_layers
    selected = sum(s["details"]["selected"] for s in relay.segments if s.get("slot"))
    assert relay.rho == pytest.approx(1 - selected / relay.reuse.shared_tokens)

    blend = judge_hop(make_method("cacheblend", ratio=0.15))
    segs = [s for s in blend.segments if s.get("slot")]
    for s in segs:
        n, k = s["length"], s["details"]["selected"]
        assert k == selected_count(0.15, n) and s["computed_pairs"] == n * 2 + k * (n_layers - 2)
    pairs = sum(s["computed_pairs"] for s in segs) / (sum(s["length"] for s in segs) * n_layers)
    assert blend.recompute_fraction == pytest.approx(pairs) and 0 < pairs < 0.5
    chosen = sum(s["details"]["selected"] for s in segs)
    assert blend.rho == pytest.approx(1 - chosen / sum(s["length"] for s in segs))

    assert judge_hop(FullShared()).recompute_fraction == 0.0
    assert judge_hop(NonShared()).recompute_fraction == 1.0

    graph = make_method("graphflow", residual_topk=4)
    runner = Runner(real_model, wf, graph)
    first = runner.run(request).hops[1]
    second = runner.run(request).hops[1]
    assert [s["decision"] for s in first.segments if s.get("slot")] == ["dense", "dense"]
    assert [s["details"]["residual_tokens"] for s in second.segments if s.get("slot")] == [4, 4]
    assert second.recompute_fraction == 1.0  # the context-free base is a full prefill
    assert second.rho == 0.0  # ... so none of its tokens came from a source
    assert set(graph.residuals) == {("query", "judge"), ("scout", "judge")}


# --- profiles ------------------------------------------------------------------------------


def test_profile_candidates_and_bands():
    from kvcmas.eval.profiles import block_candidates, concentrated_band, relay_bands

    blocks = block_candidates(30)
    widths = [e - s for s, e in blocks]
    assert widths == sorted(widths) and widths[0] == 3 and blocks[-1] == (0, 30)
    assert all(0 <= s < e <= 30 for s, e in blocks) and (27, 30) in blocks
    assert concentrated_band([0, 0, 5, 5, 0, 0], 0.5) == (2, 2)
    assert concentrated_band([0, 1, 5, 5, 1, 0], 0.8) == (2, 3)
    assert concentrated_band([1, 1, 1, 1], 1.0) == (0, 3)
    assert relay_bands([0, 1, 5, 5, 1, 0], 0.8) == (2, 3, 3)
    assert relay_bands([1.0] * 30, 0.5) == (0, 4, 14)


def test_replay_recorder_keeps_sources_and_hidden_states(model):
    """A recorded dense hop, replayed with FullShared, reuses the frozen source; the recorder
    kept the source hop's hidden state for DroidSpeak-style methods."""
    from kvcmas.eval.profiles import first_token_kl
    from kvcmas.eval.replay import Recorder

    rec = Recorder(capture=(1,))
    first = make_hop(model, None, agent="a")
    cache = model.new_cache()
    model.prefill(list(PREFIX), cache)
    out = rec.build(first, model, cache)
    kv = SegmentKV.from_cache(out.cache, len(PREFIX), len(PREFIX) + len(SHARED), model.inv_freq)
    first.shared["query"].record("a", kv)
    second = Hop("b", first.session, 1, first.segments, first.shared)
    cache = model.new_cache()
    model.prefill(list(PREFIX), cache)
    rec.build(second, model, cache)
    rh = rec.hops[1]
    assert rh.has_sources and not rec.hops[0].has_sources
    assert rh.source_hidden["query"][1].shape == (len(SHARED), model.config.hidden_size)
    assert first_token_kl([rh], model, FullShared) < 1e-6  # same prefix: reuse is exact
    assert first_token_kl([rh], model, lambda: make_method("droidspeak", block="1:3")) < 1e-6
