"""What the connector's scheduler claims of a prompt (kvcmas.serve.claims), without vLLM."""

from __future__ import annotations

import numpy as np

from kvcmas.serve.claims import SpanRule, plan_claim
from kvcmas.serve.span_index import SpanIndex


def fresh(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def index_with(*requests) -> SpanIndex:
    index = SpanIndex(1 << 30, 1)
    for key, agent, tokens, prompt_len, exact_upto in requests:
        index.add(key, "S", agent, tokens, prompt_len=prompt_len, exact_upto=exact_upto)
    return index


def test_claim_is_exact_run_then_spans_up_to_the_last_one():
    system, doc, reply = fresh(1000, 20), fresh(2000, 50), fresh(3000, 40)
    first = system + doc + fresh(4000, 5)  # the analyst's prompt, then its reply
    index = index_with(("a", "analyst", first + reply, len(first), len(first) + 40))
    prompt = system + fresh(5000, 6) + doc + fresh(6000, 4) + reply + fresh(7000, 8)
    claim = plan_claim(index, "S", prompt, 0, with_spans=True, min_span=32)
    # the shared system prompt: shorter than min_span, claimed as it comes before spans
    assert claim.exact_key == "a" and claim.exact_end == 20
    assert [(s.start, s.length, s.slot, s.kind) for s in claim.spans] == [
        (26, 50, "in:analyst", "input"), (80, 40, "out:analyst", "agent")]
    assert claim.spans[1].origin.offset == len(first)
    assert (claim.start, claim.end) == (0, 120)  # vLLM computes the last 8 tokens
    cut = claim.cut(90)  # vLLM took fewer tokens: the second span is shortened
    assert cut.end == 90 and cut.spans[1].length == 10
    # "exact" claims only the exact run; nothing to claim past vLLM's own prefix: None.
    assert plan_claim(index, "S", prompt, 0, with_spans=False, min_span=16).end == 20
    assert plan_claim(index, "S", prompt, 20, with_spans=False, min_span=16) is None
    # Another session of the namespace: only the exact run (the system prompt), no spans.
    other = plan_claim(index, "T", prompt, 0, with_spans=True, min_span=16)
    assert (other.exact_key, other.end, other.spans) == ("a", 20, [])
    assert plan_claim(index, "T", prompt, 0, with_spans=True, min_span=16,
                      namespace="tenant-2") is None


def test_exact_run_stops_where_the_saved_kv_was_built():
    tokens = fresh(0, 100)
    index = index_with(("a", "x", tokens, 100, 30))  # positions 30.. were built by a method
    claim = plan_claim(index, "S", tokens + [7], 0, with_spans=False, min_span=16)
    assert claim.end == claim.exact_end == 30
    # Built KV stays in its session: another one gets the same exact cap, never more.
    assert plan_claim(index, "T", tokens + [7], 0, with_spans=False, min_span=16).end == 30


def test_an_exact_run_alone_shorter_than_min_span_is_left_to_vllm():
    """Copying a few tokens into the paged cache costs more than vLLM's prefill of them."""
    tokens = fresh(0, 100)
    index = index_with(("a", "x", tokens, 100, 100))
    prompt = tokens[:40] + fresh(500, 10)
    assert plan_claim(index, "S", prompt, 0, with_spans=False, min_span=32).end == 40
    assert plan_claim(index, "S", prompt, 8, with_spans=False, min_span=32).end == 40  # 32 new
    assert plan_claim(index, "S", prompt, 9, with_spans=False, min_span=32) is None  # 31 new
    assert plan_claim(index, "S", prompt, 9, with_spans=True, min_span=32) is None


def test_the_claim_leaves_the_last_prompt_token_to_vllm():
    tokens = fresh(0, 64)
    index = index_with(("a", "x", tokens, 64, 64))
    claim = plan_claim(index, "S", np.array(tokens), 0, with_spans=True)
    assert claim.end == 63


def whole_up_to(limit: int) -> SpanRule:
    """A method that recomputes spans of up to ``limit`` tokens whole, and nothing of longer
    ones; no minimum gain."""
    return SpanRule(lambda n: n if n <= limit else 0, min_gain=0.0)


def analyst_critic_judge():
    """An analyst read a document (its reply: 40 tokens), a critic the document and 40 tokens
    of notes; the judge's prompt reads document, notes and reply in a row: a 120-token span
    (document and notes, from the critic) at 6, then the reply (40, from the analyst) at 126."""
    system, doc, notes, reply = fresh(1000, 20), fresh(2000, 80), fresh(2500, 40), fresh(3000, 40)
    first = system + doc + fresh(4000, 5)
    second = system + doc + notes + fresh(4500, 5)
    index = index_with(("a", "analyst", first + reply, len(first), len(first)),
                       ("b", "critic", second, len(second), len(second)))
    return index, fresh(5000, 6) + doc + notes + reply + fresh(7000, 8)


def test_trailing_spans_the_method_recomputes_whole_are_left_to_vllm():
    index, prompt = analyst_critic_judge()
    whole = plan_claim(index, "S", prompt, 0, with_spans=True, min_span=32,
                       span_rule=whole_up_to(40))
    assert [(s.start, s.length) for s in whole.spans] == [(6, 120)]  # document and notes
    assert [(s.start, s.length, s.slot) for s in whole.engine_spans] == [(126, 40, "out:analyst")]
    assert whole.end == 126  # vLLM computes the reply and the rest
    assert whole.cut(100).engine_spans == whole.engine_spans
    # When every span would be, the claim supplies nothing and still records them, so that
    # reuse counts them; a span recomputed whole that is not at the end stays in the claim.
    none = plan_claim(index, "S", prompt, 0, with_spans=True, min_span=32,
                      span_rule=whole_up_to(10**6))
    assert none.length == 0 and none.spans == [] and len(none.engine_spans) == 2
    middle = plan_claim(index, "S", prompt[:126] + fresh(8000, 3), 0, with_spans=True,
                        min_span=32, span_rule=whole_up_to(40))
    assert middle.engine_spans == [] and middle.end == 126
    plain = plan_claim(index, "S", prompt, 0, with_spans=True, min_span=32)
    assert plain.engine_spans == [] and plain.end == 166


def test_span_rule_weighs_served_tokens_against_recomputed_ones():
    head16 = SpanRule(lambda n: min(n, 16), min_gain=4.0)
    assert head16.worth_building(80)  # serves 64 = 4 x 16
    assert not head16.worth_building(79)
    assert not head16.worth_building(16) and not head16.worth_building(10)  # all head
    assert SpanRule(lambda n: min(n, 16), min_gain=0.0).worth_building(17)
    assert not SpanRule(lambda n: min(n, 16), min_gain=0.0).worth_building(16)
    assert SpanRule(lambda n: 0, min_gain=100.0).worth_building(32)  # recomputes nothing


def test_spans_below_the_gain_are_left_to_vllm_and_the_rest_claimed():
    index, prompt = analyst_critic_judge()
    head16 = SpanRule(lambda n: min(n, 16), min_gain=4.0)
    claim = plan_claim(index, "S", prompt, 0, with_spans=True, min_span=32, span_rule=head16)
    # document and notes (120 tokens: 104 served per 16 recomputed) are built; the reply
    # (40: 24 per 16) is left to vLLM
    assert [(s.start, s.length) for s in claim.spans] == [(6, 120)]
    assert [(s.start, s.length) for s in claim.engine_spans] == [(126, 40)]
    strict = plan_claim(index, "S", prompt, 0, with_spans=True, min_span=32,
                        span_rule=SpanRule(lambda n: min(n, 16), min_gain=7.0))
    assert strict.length == 0 and len(strict.engine_spans) == 2
