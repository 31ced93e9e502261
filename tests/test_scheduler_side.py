"""The connector's scheduler side with fake requests: no vLLM, no torch, no model.

Its bookkeeping (which claims it plans, what it saves as exact, when it defers, which salts
it trusts) decides what KV a request reads; the real-server tests in test_vllm_connector.py
check the same end to end.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvcmas.serve.params import session_cache_salt
from kvcmas.serve.scheduler_side import MethodTraits, SchedulerOptions, SchedulerSide

BLOCK = 16


def fresh(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def side(method: str = "kvcmas") -> SchedulerSide:
    options = SchedulerOptions(BLOCK, 1, method, 1 << 30, min_span=32, min_gain=0.0)
    return SchedulerSide(options, lambda name: MethodTraits(lambda n: 0))


def request(rid, prompt, *, session="S", agent="a", namespace=None, salt="own", output=()):
    params = {"session": session, "agent": agent, "namespace": namespace}
    if salt == "own":
        salt = session_cache_salt(namespace, session, None)
    tokens = list(prompt) + list(output)
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=list(prompt), kv_transfer_params={"kvcmas": params},
        cache_salt=salt, num_computed_tokens=len(tokens), all_token_ids=tokens,
        num_prompt_tokens=len(prompt),
    )  # fmt: skip


def blocks_for(n: int) -> list[int]:
    return list(range((n + BLOCK - 1) // BLOCK))


def finish(s: SchedulerSide, req) -> dict:
    keep, info = s.request_finished(req, blocks_for(len(req.all_token_ids)), ran_to_end=True)
    return info["kvcmas"] | {"kept": keep}


def admit(s: SchedulerSide, req, num_computed: int = 0, admitted: int | None = None):
    """One request through admission: (claimed tokens, the load order or None)."""
    n, _ = s.num_new_matched_tokens(req, num_computed)
    if n is None:
        return None, None
    s.update_state_after_alloc(req, blocks_for(len(req.prompt_token_ids)),
                               n if admitted is None else admitted)  # fmt: skip
    loads = s.build_orders().loads
    return n, (loads[0] if loads else None)


def session_with_a_document():
    """Agent a read a 64-token document (its prompt) and answered; saved."""
    s = side()
    doc = fresh(2000, 64)
    first = request("r1", fresh(1000, 8) + doc, output=fresh(3000, 20))
    admit(s, first)
    assert finish(s, first)["saved_tokens"] == len(first.all_token_ids)
    s.build_orders()
    return s, doc


def test_a_salted_request_claims_the_sessions_span():
    s, doc = session_with_a_document()
    second = request("r2", fresh(5000, 8) + doc + fresh(6000, 4), agent="b")
    n, load = admit(s, second)
    assert n == 8 + 64 and [(p.start, p.length) for p in load.plan.spans] == [(8, 64)]
    assert load.plan.method == "kvcmas"


def test_a_request_without_its_sessions_salt_is_served_exact_only_and_never_saved():
    s, doc = session_with_a_document()
    for rid, salt in (("r2", None), ("r3", session_cache_salt(None, "other", None)),
                      ("r4", "kvcmas:not json"), ("r5", session_cache_salt("t", "S", None))):
        unsalted = request(rid, fresh(5000, 8) + doc + fresh(6000, 4), agent="b", salt=salt)
        n, load = admit(s, unsalted)
        assert n == 0 and load is None, rid  # no exact run, and no span is read
        done = finish(s, unsalted)
        assert (done["saved_tokens"], done["kept"], done["method"]) == (0, False, "exact")
    # Its exact run of the namespace is still copied (exact KV is the same for everyone).
    prefix = request("r6", fresh(1000, 8) + doc + fresh(7000, 4), salt=None)
    n, load = admit(s, prefix)
    assert n == 72 and load.plan.spans == [] and load.plan.method == "exact"


def test_a_second_request_of_the_session_in_one_pass_waits_for_the_next_step():
    s, doc = session_with_a_document()
    one = request("r2", fresh(5000, 8) + doc + fresh(6000, 4), agent="b")
    two = request("r3", fresh(5000, 8) + doc + fresh(6100, 4), agent="c")
    assert s.num_new_matched_tokens(one, 0)[0] == 72
    s.update_state_after_alloc(one, blocks_for(76), 72)
    # vLLM handed r3 r2's prefix blocks, which r2 computes only in this step's forward
    assert s.num_new_matched_tokens(two, 8) == (None, False)
    s.build_orders()  # the pass ends
    assert s.num_new_matched_tokens(two, 8)[0] == 64
    # A claim with no spans (exact runs only) needs no wait.
    three = request("r4", fresh(1000, 8) + doc + fresh(7000, 4), agent="d")
    assert s.num_new_matched_tokens(three, 8)[0] > 0


def test_a_claim_vllm_admits_in_part_is_cut():
    s, doc = session_with_a_document()
    second = request("r2", fresh(5000, 8) + doc + fresh(6000, 4), agent="b")
    n, load = admit(s, second, admitted=40)
    assert n == 72 and (load.plan.start, load.plan.end) == (0, 40)
    assert [(p.start, p.length) for p in load.plan.spans] == [(8, 32)]
    assert finish(s, second)["claimed_tokens"] == 40


def test_a_prefix_hit_past_what_a_saved_request_vouches_is_saved_as_approximate():
    s, doc = session_with_a_document()
    built = request("r2", fresh(5000, 8) + doc + fresh(6000, 4), agent="b", output=fresh(9, 5))
    admit(s, built)
    assert finish(s, built)["saved_tokens"] == 81
    s.build_orders()
    # r3 continues r2: vLLM's prefix cache (same salt) hands it r2's 76 prompt tokens, whose
    # KV after position 8 a method built. Saved, r3 may serve exact claims only up to 8.
    third = request("r3", built.prompt_token_ids + fresh(8000, 40), agent="c")
    admit(s, third, num_computed=76)
    finish(s, third)
    orders = s.build_orders()
    assert [o.key for o in orders.saves] == ["r3"]
    other = request("r4", third.prompt_token_ids + fresh(8500, 2), session="T")
    n, load = admit(s, other)
    assert n == 0 or load.plan.exact_end <= 8  # nothing past 8 crosses as exact


def test_a_reused_request_id_is_not_saved_twice_and_does_not_raise():
    s, doc = session_with_a_document()
    again = request("r1", fresh(4000, 50), output=fresh(4100, 3))
    admit(s, again)
    assert finish(s, again)["saved_tokens"] == 0


def test_an_aborted_request_is_not_saved():
    s, _ = session_with_a_document()
    cut = request("r9", fresh(4000, 50), output=fresh(4100, 3))
    admit(s, cut)
    keep, info = s.request_finished(cut, blocks_for(53), ran_to_end=False)
    assert keep is False and info["kvcmas"]["saved_tokens"] == 0


def test_plain_requests_are_none_of_its_business():
    s = side()
    plain = SimpleNamespace(request_id="p", prompt_token_ids=fresh(0, 40),
                            kv_transfer_params=None, cache_salt=None)  # fmt: skip
    assert s.num_new_matched_tokens(plain, 0) == (0, False)
    assert s.request_finished(plain, [0, 1, 2], ran_to_end=True) == (False, None)
    bad = SimpleNamespace(request_id="b", prompt_token_ids=fresh(0, 40),
                          kv_transfer_params={"kvcmas": {"session": 3}}, cache_salt=None)
    assert s.num_new_matched_tokens(bad, 0) == (0, False)  # served as plain, never raised


def adaptive(head: int = 16, learns: bool = False) -> SchedulerSide:
    """No pinned rule: the claim comes from measured costs; the method recomputes a
    ``head``-token head of every span (and ``learns`` from spans vLLM computes)."""
    options = SchedulerOptions(BLOCK, 1, "kvcmas", 1 << 30, min_span=32)
    return SchedulerSide(options, lambda name: MethodTraits(lambda n: min(n, head), learns))


def measure(s: SchedulerSide, engine_ms=0.3, runtime_ms=0.5, fixed_ms=1.0) -> None:
    from kvcmas.serve.costs import Calibration, Feedback

    steps = [(n, 0.005 + engine_ms * 1e-3 * n) for n in (1, 64, 512)]
    s.learn(Feedback(Calibration(runtime_ms * 1e-3, fixed_ms * 1e-3, 0.0), steps))


def test_unmeasured_costs_leave_every_span_to_vllm_and_record_it():
    s = adaptive()
    doc = fresh(2000, 300)
    first = request("r1", fresh(1000, 8) + doc, output=fresh(3000, 20))
    admit(s, first)
    finish(s, first)
    s.build_orders()
    second = request("r2", fresh(5000, 8) + doc + fresh(6000, 4), agent="b")
    n, _ = s.num_new_matched_tokens(second, 0)
    s.update_state_after_alloc(second, blocks_for(312), n)
    orders = s.build_orders()
    assert n == 0 and orders.loads == []
    assert [(p.start, p.length) for p in orders.records[0].engine_spans] == [(8, 300)]


def test_measured_costs_build_a_long_span_and_leave_a_short_one():
    s = adaptive(head=16)
    measure(s)
    doc, reply = fresh(2000, 300), fresh(3000, 40)
    first = request("r1", fresh(1000, 8) + doc, output=reply)
    admit(s, first)
    finish(s, first)
    s.build_orders()
    # the 40-token reply: 24 served tokens save 7 ms in vLLM; recomputing the head and the
    # text before it costs more
    second = request("r2", fresh(5000, 8) + doc + fresh(6000, 30) + reply + fresh(7000, 3),
                     agent="b")  # fmt: skip
    n, load = admit(s, second)
    assert n == 8 + 300 and [(p.start, p.length) for p in load.plan.spans] == [(8, 300)]
    assert [(p.start, p.length) for p in load.plan.engine_spans] == [(338, 40)]


def test_a_method_that_learns_from_vllm_leaves_an_unlearned_edge_to_it_and_learns_from_it():
    from kvcmas.serve.costs import EdgeRecord, Feedback

    s = adaptive(head=16, learns=True)
    measure(s)
    doc = fresh(2000, 300)
    first = request("r1", fresh(1000, 8) + doc, output=fresh(3000, 20))
    admit(s, first)
    finish(s, first)
    s.build_orders()
    second = request("r2", fresh(5000, 8) + doc + fresh(6000, 4), agent="b",
                     output=fresh(6500, 10))  # fmt: skip
    n, _ = s.num_new_matched_tokens(second, 0)
    s.update_state_after_alloc(second, blocks_for(312), n)
    assert n == 0  # no report on edge (in:a, b) yet: a cold build would be dense
    s.build_orders()
    finish(s, second)
    [save] = s.build_orders().saves
    # vLLM's KV of the document in b's prompt, beside its latest source, teaches the method
    assert [(x.start, x.length, x.slot, x.latest.key) for x in save.learn] == [
        (8, 300, "in:a", "r1")]
    assert (save.method, save.agent) == ("kvcmas", "b")
    # Once the worker reports the edge learned (the head rule), the span is built.
    s.learn(Feedback(edges=[EdgeRecord((None, "in:a", "b"), 300, 16)]))
    third = request("r3", fresh(5500, 8) + doc + fresh(6100, 4), agent="b")  # not b's prefix
    n, load = admit(s, third)
    assert n == 308 and [(p.start, p.length) for p in load.plan.spans] == [(8, 300)]
