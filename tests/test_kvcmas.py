"""KVCMAS and KVCOMM on tiny random models: exactness where it is owed, gating, determinism."""

from __future__ import annotations

import copy

import pytest
import torch

from kvcmas.methods import make_method
from kvcmas.methods.base import Hop, SharedSegment, standalone_prefill
from kvcmas.methods.nonshared import NonShared
from tests.conftest import ours_from_hf
from tests.hops import run_hop, shared_query

PREFIX_A, PREFIX_B = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14]
TAIL = [20, 21, 22]


def two_agents(method, model, query, request=0):
    session = f"s{request}"
    """Agent A reads the query first (dense), then agent B consumes it from A's cache."""
    shared = shared_query(query)
    a = run_hop(method, model, "a", PREFIX_A, ["query", TAIL], shared, session, 0)
    b = run_hop(method, model, "b", PREFIX_B, ["query", TAIL], shared, session, 1)
    return a, b


def record(build, slot="query"):
    return next(r for r in build.records if r.slot == slot)


@pytest.mark.device
def test_tau_zero_is_exactly_nonshared(tiny_pair):
    _, model = tiny_pair
    kv = make_method("kvcmas", tau=0.0, min_anchors=1)
    ns = NonShared()
    for i in range(4):
        q = torch.randint(30, 128, (12,)).tolist()
        for x, y in zip(two_agents(kv, model, q, i), two_agents(ns, model, q, i), strict=True):
            assert torch.equal(x.cache.k[:, :, : x.cache.length], y.cache.k[:, :, : y.cache.length])
            assert torch.equal(x.last_logits, y.last_logits)
        assert record(x).decision == "dense"


@pytest.mark.device
def test_first_agent_is_always_exact(tiny_pair):
    _, model = tiny_pair
    kv = make_method("kvcmas", tau=2.0, min_anchors=1)
    ns = NonShared()
    for i in range(3):
        q = torch.randint(30, 128, (10,)).tolist()
        a, _ = two_agents(kv, model, q, i)
        ref, _ = two_agents(ns, model, q, i)
        assert record(a).decision == "dense"
        assert torch.equal(a.cache.k[:, :, : a.cache.length], ref.cache.k[:, :, : ref.cache.length])


@pytest.mark.device
def test_anchor_from_the_same_content_reproduces_the_dense_cache(tiny_pair):
    _, model = tiny_pair
    q = torch.randint(30, 128, (14,)).tolist()
    for rank, tol in ((0, 1e-4), (4, None)):
        kv = make_method("kvcmas", tau=2.0, min_anchors=1, rank=rank, base_rank=rank)
        _, dense = two_agents(kv, model, q, 0)  # pool empty: B goes dense, records the anchor
        assert record(dense).decision == "dense"
        _, reused = two_agents(kv, model, q, 1)  # same content and source: one anchor, weight 1
        assert record(reused).decision == "reuse"
        n = dense.cache.length
        err = (reused.cache.k[:, :, :n] - dense.cache.k[:, :, :n]).norm() / dense.cache.k[
            :, :, :n
        ].norm()
        if tol is not None:  # full rank: exact
            assert err < tol
            torch.testing.assert_close(reused.last_logits, dense.last_logits, atol=1e-3, rtol=1e-3)
        else:  # rank 4 of a 14-token delta: only the truncation remains, below FullShared
            full = make_method("fullshared")
            _, fs = two_agents(full, model, q, 0)
            fs_err = (fs.cache.k[:, :, :n] - dense.cache.k[:, :, :n]).norm()
            assert 0 < err * dense.cache.k[:, :, :n].norm() < fs_err


def test_correction_in_a_bf16_cache_stays_bf16_and_still_corrects(tiny_pair):
    """The corrected span is formed in the source's dtype (no fp32 copy): in bf16 a full-rank
    anchor of the same content still brings the reused cache to the dense one, far closer
    than FullShared's, and nothing in the cache is promoted."""
    hf, _ = tiny_pair
    model = ours_from_hf(hf, dtype=torch.bfloat16)
    q = torch.randint(30, 128, (14,)).tolist()
    kv = make_method("kvcmas", tau=2.0, min_anchors=1, rank=0, base_rank=0)
    _, dense = two_agents(kv, model, q, 0)
    _, reused = two_agents(kv, model, q, 1)
    _, fs = two_agents(make_method("fullshared"), model, q, 0)
    assert record(reused).decision == "reuse" and reused.cache.k.dtype == torch.bfloat16
    n = dense.cache.length
    ref = dense.cache.k[:, :, :n].float()
    err = (reused.cache.k[:, :, :n].float() - ref).norm()
    assert err < 0.1 * (fs.cache.k[:, :, :n].float() - ref).norm()


def test_anchors_a_hop_records_do_not_depend_on_its_other_spans(tiny_pair):
    """Every span's source is matched from one reused buffer; a dense fallback's anchor keeps
    its own copy, so two fallbacks in one hop record what each records alone."""
    _, model = tiny_pair
    q1, q2 = (tuple(torch.randint(30, 128, (10,)).tolist()) for _ in range(2))  # equal lengths
    shared = {"q1": SharedSegment("q1", "query", q1), "q2": SharedSegment("q2", "query", q2)}

    def recorded_base(parts):
        kv = make_method("kvcmas", tau=2.0, min_anchors=1, rank=0, base_rank=0)
        run_hop(kv, model, "a", PREFIX_A, parts, shared, "s0", 0)
        b = run_hop(kv, model, "b", PREFIX_B, parts, shared, "s0", 1)  # empty pools: dense
        assert {r.slot: r.decision for r in b.records if r.slot} == dict.fromkeys(
            [p for p in parts if isinstance(p, str)], "dense"
        )
        return kv.pools[("q1", "b")].anchors[0].base_k.a

    together = recorded_base(["q1", TAIL, "q2", TAIL])
    assert torch.equal(recorded_base(["q1", TAIL]), together)


def test_gate_needs_min_anchors_and_records_entropy(tiny_pair):
    _, model = tiny_pair
    kv = make_method("kvcmas", tau=2.0, min_anchors=3)
    decisions = []
    for i in range(5):
        _, b = two_agents(kv, model, torch.randint(30, 128, (10,)).tolist(), i)
        decisions.append(record(b).decision)
        if record(b).decision == "reuse":
            assert 0.0 <= record(b).entropy <= 1.0
    assert decisions == ["dense"] * 3 + ["reuse"] * 2
    assert sum(len(p.anchors) for p in kv.pools.values()) == 3


def test_pools_never_exceed_pool_size(tiny_pair):
    _, model = tiny_pair
    kv = make_method("kvcmas", tau=0.0, pool_size=2)  # always dense: always records
    for i in range(5):
        two_agents(kv, model, torch.randint(30, 128, (8,)).tolist(), i)
    assert [len(p.anchors) for p in kv.pools.values()] == [2]


@pytest.mark.device
def test_two_identical_runs_give_identical_caches(tiny_pair):
    _, model = tiny_pair
    queries = [torch.randint(30, 128, (9 + i,)).tolist() for i in range(5)]
    outs = []
    for _ in range(2):
        kv = make_method("kvcmas", tau=0.95, min_anchors=2, rank=3, base_rank=3)
        outs.append([two_agents(kv, model, q, i)[1] for i, q in enumerate(queries)])
    for x, y in zip(*outs, strict=True):
        assert torch.equal(x.cache.k[:, :, : x.cache.length], y.cache.k[:, :, : y.cache.length])


def test_kvcomm_reuses_at_the_first_agent_from_a_reference_prefill(tiny_pair):
    """Non-chained: the query's base is a context-free prefill, so even agent A can reuse."""
    _, model = tiny_pair
    kc = make_method("kvcomm", tau=2.0, min_anchors=1)
    for i in range(2):
        a, _ = two_agents(kc, model, torch.randint(30, 128, (10,)).tolist(), i)
    assert record(a).decision == "reuse" and record(a).details["source"] == "reference"
    assert kc.params()["rank"] is None and not kc.params()["chain"]  # None: full width


def test_chaining_uses_the_latest_hop_as_source(tiny_pair):
    _, model = tiny_pair
    kv = make_method("kvcmas", tau=2.0, min_anchors=1)
    shared = shared_query(torch.randint(30, 128, (10,)).tolist())
    run_hop(kv, model, "a", PREFIX_A, ["query", TAIL], shared)
    run_hop(kv, model, "b", PREFIX_B, ["query", TAIL], shared)
    c = run_hop(kv, model, "c", [1, 2, 3], ["query", TAIL], shared)
    assert record(c).details["source"] == "b" and shared["query"].latest_agent == "c"


def test_reference_prefills_are_keyed_by_content_and_session(tiny_pair):
    """Round 1 keyed KVCOMM's reference prefill by (request index, slot): a library caller
    whose requests all had index 0 got the previous request's reference. Now a reference is
    keyed by the segment's tokens within one session, and never outlives the session."""
    _, model = tiny_pair
    kc = make_method("kvcomm")
    first, second = (5, 6, 7, 8, 9), (9, 8, 7, 6, 5, 4)

    def source(session, tokens):
        hop = Hop("b", session, 1, [], {})
        return kc.source(hop, SharedSegment("query", "query", tokens), model)[0]

    a = source("s", first)
    b = source("s", second)  # same session and slot, new content: a new reference
    expected = standalone_prefill(model, second)
    torch.testing.assert_close(b.k, expected.k)
    torch.testing.assert_close(b.v, expected.v)
    assert source("s", first) is a  # same content in the same session: computed once
    assert source("t", first) is not a  # another session recomputes: nothing leaks


def test_reference_prefills_survive_interleaved_sessions_within_the_bound(tiny_pair):
    """The connector interleaves sessions on one method object: with room for them, a
    session's reference is computed once however many other sessions' hops come between."""
    _, model = tiny_pair
    tokens = (5, 6, 7, 8, 9)

    def source(kc, session):
        hop = Hop("b", session, 1, [], {})
        return kc.source(hop, SharedSegment("query", "query", tokens), model)[0]

    for max_bytes, kept in ((0, False), (1 << 20, True)):  # kvcmas run's bound, a server's
        kc = make_method("kvcomm")
        kc.session_state.max_bytes = max_bytes
        a = source(kc, "s")
        source(kc, "t")
        assert (source(kc, "s") is a) == kept
        assert kc.memory_bytes() == kc.session_state.nbytes() > 0  # references are counted
        assert kc.pool_report(model.config.n_layers, 8)["pool_bytes"] == 0  # not as pools


def test_hidden_states_are_keyed_by_content_and_session():
    from kvcmas.methods.selective import HiddenStore
    from kvcmas.methods.session_state import SessionState

    store = HiddenStore(SessionState())
    hidden = torch.ones(3, 4)
    store.put("s", (1, 2, 3), 5, hidden)
    assert store.get("s", (1, 2, 3), 5) is hidden
    assert store.get("s", (1, 2, 4), 5) is None  # other content
    assert store.get("t", (1, 2, 3), 5) is None  # other session
    with pytest.raises(ValueError, match="3 rows for 2 tokens"):
        store.put("s", (1, 2), 5, hidden)


def test_gate_at_intermediate_tau_reuses_exactly_below_the_entropy(tiny_pair):
    """Same pool state, tau just above and just below the match's entropy: reuse vs dense."""
    _, model = tiny_pair
    warm = make_method("kvcmas", tau=0.0, min_anchors=2)  # tau 0: every hop records
    for i in range(3):
        two_agents(warm, model, torch.randint(30, 128, (10,)).tolist(), i)
    query = torch.randint(30, 128, (10,)).tolist()
    probe = copy.deepcopy(warm)
    probe.tau = 2.0
    _, b = two_agents(probe, model, query, 9)
    entropy = record(b).entropy
    assert 0.0 < entropy < 1.0
    decisions = {}
    for tau in (entropy + 1e-6, entropy - 1e-6):
        method = copy.deepcopy(warm)
        method.tau = tau
        _, b = two_agents(method, model, query, 9)
        assert record(b).entropy == pytest.approx(entropy, abs=1e-9)
        decisions[tau > entropy] = record(b).decision
    assert decisions == {True: "reuse", False: "dense"}


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_background_modes_build_the_same_caches_as_idle(tiny_pair, mode, request):
    """Where anchors are factorized (idle time, a worker thread, inline) changes no result."""
    _, model = tiny_pair
    queries = [torch.randint(30, 128, (9 + i,)).tolist() for i in range(5)]
    outs = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker thread must follow the caller's count, not its default
    request.addfinalizer(lambda: torch.set_num_threads(before))
    for background in ("idle", mode):
        kv = make_method(
            "kvcmas", tau=0.99, min_anchors=2, rank=3, base_rank=3, background=background
        )
        outs.append([two_agents(kv, model, q, i)[1] for i, q in enumerate(queries)])
        assert kv.background.pending() == 0
    assert [record(b).decision for b in outs[0]] == [record(b).decision for b in outs[1]]
    for x, y in zip(*outs, strict=True):
        assert torch.equal(x.cache.k[:, :, : x.cache.length], y.cache.k[:, :, : y.cache.length])


def test_background_work_waits_only_for_the_pool_it_reads():
    from kvcmas.methods.background import BackgroundWork

    work = BackgroundWork("idle")
    done = []
    work.submit(("query", "b"), lambda: done.append("qb1"))
    work.submit(("query", "c"), lambda: done.append("qc"))
    work.submit(("query", "b"), lambda: done.append("qb2"))
    assert done == [] and work.pending() == 3  # nothing ran on the critical path yet
    work.wait_for(("query", "b"))
    assert done == ["qb1", "qb2"] and work.pending(("query", "c")) == 1
    work.flush()
    assert done == ["qb1", "qb2", "qc"] and work.pending() == 0


def test_background_thread_reports_a_failed_job():
    from kvcmas.methods.background import BackgroundWork

    work = BackgroundWork("thread")
    work.submit("pool", lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="background anchor construction failed"):
        work.flush()
    with pytest.raises(ValueError, match="background mode"):
        BackgroundWork("later")


def test_an_anchor_learned_from_the_engine_equals_a_dense_fallbacks(tiny_pair):
    """The serving connector leaves an unlearned span to vLLM and teaches the pool from vLLM's
    KV of it: the anchor must be the one a dense fallback of the same hop records."""
    from kvcmas.kv.segment import SegmentKV

    _, model = tiny_pair
    q = torch.randint(30, 128, (12,)).tolist()
    options = dict(tau=2.0, min_anchors=1, rank=0, base_rank=0)
    built = make_method("kvcmas", **options)
    _, b = two_agents(built, model, q)  # empty pool: B prefills the query, records an anchor
    assert record(b).decision == "dense"
    taught = make_method("kvcmas", **options)
    shared = shared_query(q)
    run_hop(taught, model, "a", PREFIX_A, ["query", TAIL], shared, "s0", 0)
    rec = record(b)
    engine_kv = SegmentKV.from_cache(b.cache, rec.start, rec.start + rec.length, model.inv_freq)
    assert taught.predicted_recompute("query", "b", len(q)) == len(q)  # no anchor: dense
    taught.learn_from_engine("query", "b", shared["query"].latest, engine_kv)
    assert taught.predicted_recompute("query", "b", len(q)) == 0  # its queued anchor counts
    taught.flush()
    [x], [y] = built.pools[("query", "b")].anchors, taught.pools[("query", "b")].anchors
    for part in ("base_k", "base_v", "delta_k", "delta_v"):
        assert torch.equal(getattr(x, part).a, getattr(y, part).a), part
    # The non-chained variant (KVCOMM's base) has no such source: it learns nothing.
    nochain = make_method("kvcmas", chain=False, **options)
    assert not nochain.learns_from_engine
    nochain.learn_from_engine("query", "b", shared["query"].latest, engine_kv)
    assert nochain.pools == {} and not make_method("kvcomm").learns_from_engine


def test_tau_one_reuses_even_a_uniform_match(tiny_pair):
    """Two anchors recorded from the same content are equally distant from any source: the
    normalized entropy is 1 (up to rounding), which tau 1 ("reuse whenever the pool has
    anchors") must not send dense."""
    _, model = tiny_pair
    q = torch.randint(30, 128, (10,)).tolist()
    warm = make_method("kvcmas", tau=0.0, min_anchors=2)  # tau 0: every hop records
    for i in range(2):
        two_agents(warm, model, q, i)
    method = copy.deepcopy(warm)
    method.tau = 1.0
    _, b = two_agents(method, model, torch.randint(30, 128, (10,)).tolist(), 5)
    assert record(b).entropy > 0.999 and record(b).decision == "reuse"
