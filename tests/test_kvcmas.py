"""KVCMAS and KVCOMM on tiny random models: exactness where it is owed, gating, determinism."""

from __future__ import annotations

import torch

from kvcmas.methods import make_method
from kvcmas.methods.nonshared import NonShared
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
