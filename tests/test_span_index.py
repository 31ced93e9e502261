"""The scheduler-side span index: exact prefixes per namespace, token spans per session.

Pure numpy: no vLLM, no model.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcmas.serve import span_index
from kvcmas.serve.span_index import Occurrence, PrefixMatch, SpanIndex, SpanMatch

GRAM = 4


def fresh(start: int, n: int) -> list[int]:
    """n distinct tokens from a range no other list of a test uses: they match nothing."""
    return list(range(start, start + n))


def big_index(gram: int = GRAM) -> SpanIndex:
    return SpanIndex(capacity_bytes=1 << 30, bytes_per_token=1, gram=gram)


def test_add_defaults_and_validates_the_new_fields():
    index = big_index()
    index.add("a", "S", "x", [1, 2, 3])
    index.add("b", "S", "x", [4, 5, 6, 7], namespace="t", prompt_len=1, exact_upto=2)
    a, b = index._entries["a"], index._entries["b"]
    assert (a.namespace, a.prompt_len, a.exact_upto) == (None, 3, 3)
    assert (b.namespace, b.prompt_len, b.exact_upto) == ("t", 1, 2)
    assert a.seq < b.seq
    with pytest.raises(ValueError, match="exact_upto"):
        index.add("c", "S", "x", [1, 2], exact_upto=3)
    with pytest.raises(ValueError, match="prompt_len"):
        index.add("c", "S", "x", [1, 2], prompt_len=-1)
    assert "c" not in index


def test_exact_prefix_is_capped_by_exact_upto_within_the_session():
    index = big_index()
    ten = list(range(1, 11))
    index.add("a", "S1", "x", ten, exact_upto=2)  # positions 2.. were built by a method
    index.add("b", "S1", "x", [1, 2, 3, 9, 9])
    index.add("c", "S2", "x", ten)  # another session: never offered to S1
    index.add("e", "S1", "x", [5, 5, 5])
    # Uncapped, "a" shares 10 tokens; only 2 of them are exact, and "b" offers 3 exact ones.
    assert index.longest_prefix("S1", ten) == PrefixMatch("a", 10)
    assert index.longest_prefix("S1", ten, exact_only=True) == PrefixMatch("b", 3)
    assert index.longest_prefix("S2", ten, exact_only=True) == PrefixMatch("c", 10)
    assert index.longest_prefix("S3", ten, exact_only=True) is None
    assert index.longest_prefix("S1", [7, 1, 2], exact_only=True) is None
    index.longest_prefix("S1", [5, 5], exact_only=True)
    assert list(index._entries)[-1] == "e"  # marked recently used


def test_exact_prefix_crosses_sessions_within_a_namespace_only():
    index = big_index()
    ten = list(range(1, 11))
    index.add("a", "S1", "x", ten, exact_upto=4)  # built past 4: that part stays in S1
    index.add("b", "S2", "x", ten[:6] + [0, 0])
    index.add("c", "T1", "x", ten, namespace="tenant")
    # Any session of the default namespace vouches for its exact KV: "b" holds 6 exact tokens.
    assert index.longest_exact_prefix(None, ten) == PrefixMatch("b", 6)
    assert index.longest_exact_prefix("tenant", ten) == PrefixMatch("c", 10)
    assert index.longest_exact_prefix("nobody", ten) is None


def test_find_spans_finds_copied_runs_anywhere_and_tells_prompt_from_output():
    index = big_index()
    rng = np.random.default_rng(1)
    saved = rng.permutation(1000)[:40].tolist()  # prompt 0..19, output 20..39
    index.add("r1", "S", "writer", saved, prompt_len=20)
    index.add("r2", "S", "other", fresh(5000, 30))
    prompt = (
        fresh(2000, 7)
        + saved[23:35]  # from the output, placed at another position
        + fresh(3000, 5)
        + saved[2:12]  # from the prompt
        + fresh(4000, 3)
        + saved[16:26]  # across the prompt/output boundary
        + fresh(6000, 2)
    )
    got = index.find_spans("S", prompt, 0, len(prompt), 8)
    out = Occurrence("r1", 23, "writer", True)
    inp = Occurrence("r1", 2, "writer", False)
    across = Occurrence("r1", 16, "writer", True)  # holds output tokens: the writer's reply
    assert got == [SpanMatch(7, 12, out, out), SpanMatch(24, 10, inp, inp),
                   SpanMatch(37, 10, across, across)]  # fmt: skip
    # begin / end restrict the search: the first span cut to 9 tokens, the others outside.
    assert index.find_spans("S", prompt, 10, 20, 8) == [
        SpanMatch(10, 9, Occurrence("r1", 26, "writer", True), Occurrence("r1", 26, "writer", True))
    ]


def test_find_spans_origin_is_earliest_saved_latest_most_recent_first_occurrence_each():
    index = SpanIndex(capacity_bytes=120, bytes_per_token=1, gram=GRAM)
    x, y = fresh(100, 10), fresh(200, 6)
    index.add("r1", "S", "planner", fresh(300, 5) + x + fresh(400, 5))
    # x twice, each followed by enough tokens that both runs could be reported
    index.add("r2", "S", "coder", x + y + fresh(500, 4) + x + fresh(550, 5), prompt_len=0)
    index.add("r3", "S", "critic", fresh(600, 20))
    index.longest_prefix("S", fresh(300, 2))  # LRU order (r2 r3 r1) now differs from seq order
    prompt = fresh(700, 3) + x + fresh(800, 3)
    match = index.find_spans("S", prompt, 0, len(prompt), 8)
    assert match == [
        SpanMatch(3, 10, Occurrence("r1", 5, "planner", False), Occurrence("r2", 0, "coder", True))
    ]
    # r1 and r2 were used: r3 is least recently used and goes first.
    assert index.add("r4", "S", "x", fresh(900, 60)) == (True, ["r3"])
    # Only r2 holds x followed by y: the longer run wins and is its own origin.
    only_r2 = Occurrence("r2", 0, "coder", True)
    assert index.find_spans("S", x + y, 0, 16, 8) == [SpanMatch(0, 16, only_r2, only_r2)]


def test_find_spans_respects_min_span():
    index = big_index()
    saved = fresh(100, 30)
    index.add("r", "S", "a", saved)
    prompt = fresh(500, 3) + saved[10:18] + fresh(600, 3)  # a run of exactly 8 tokens
    assert index.find_spans("S", prompt, 0, len(prompt), 9) == []
    occurrence = Occurrence("r", 10, "a", False)
    assert index.find_spans("S", prompt, 0, len(prompt), 8) == [
        SpanMatch(3, 8, occurrence, occurrence)
    ]
    with pytest.raises(ValueError, match="min_span"):
        index.find_spans("S", saved, 0, len(saved), GRAM - 1)


def test_find_spans_never_mixes_sessions():
    index = big_index()
    saved = fresh(100, 30)
    index.add("t", "T", "a", saved)
    assert index.find_spans("S", saved, 0, 30, 8) == []
    assert index.find_spans("U", saved, 0, 30, 8) == []
    index.add("s", "S", "a", saved[:12])
    [match] = index.find_spans("S", saved, 0, 30, 8)
    assert (match.length, match.origin.key, match.latest.key) == (12, "s", "s")


def test_find_spans_is_greedy_longest_and_non_overlapping():
    index = big_index()
    a, b, c = fresh(100, 10), fresh(200, 10), fresh(300, 10)
    index.add("r0", "S", "x", a)  # the first candidate at position 0, but the shorter one
    index.add("r1", "S", "x", a + b)
    index.add("r2", "S", "x", b + c)
    got = index.find_spans("S", a + b + c, 0, 30, 8)
    # b is taken with a (longest at position 0), so r2 only supplies c, right after it.
    assert [(m.start, m.length, m.origin.key, m.origin.offset) for m in got] == [
        (0, 20, "r1", 0),
        (20, 10, "r2", 10),
    ]


def brute_force(entries, prompt, begin, end, min_span):
    """The specification, literally: (start, length, origin, latest) as (key, offset) pairs.
    entries: (key, tokens) in admission order."""
    out, p = [], begin
    while p + min_span <= end:
        runs = {}  # key -> (longest run at p, first offset with it)
        for key, tokens in entries:
            for off in range(len(tokens)):
                n = 0
                while p + n < end and off + n < len(tokens) and prompt[p + n] == tokens[off + n]:
                    n += 1
                if n > runs.get(key, (0, 0))[0]:
                    runs[key] = (n, off)
        longest = max((n for n, _ in runs.values()), default=0)
        if longest < min_span:
            p += 1
            continue
        holders = [(k, off) for k, _ in entries for n, off in [runs.get(k, (0, 0))] if n == longest]
        out.append((p, longest, holders[0], holders[-1]))
        p += longest
    return out


@pytest.mark.parametrize("colliding", [False, True])
def test_find_spans_matches_the_specification_even_when_every_hash_collides(monkeypatch, colliding):
    if colliding:  # every window hashes alike: only the token comparison can tell them apart
        monkeypatch.setattr(span_index, "gram_hashes", lambda t, g: [0] * max(0, len(t) - g + 1))
    rng = np.random.default_rng(7)
    found = 0
    for trial in range(300):
        index = SpanIndex(capacity_bytes=1 << 20, bytes_per_token=1, gram=3)
        vocab = int(rng.integers(2, 5))  # tiny vocabularies: many repeated windows
        entries = []
        for i in range(int(rng.integers(1, 5))):
            tokens = rng.integers(0, vocab, int(rng.integers(1, 25))).tolist()
            index.add(f"r{i}", "S", f"agent{i}", tokens, prompt_len=len(tokens) // 2)
            entries.append((f"r{i}", tokens))
        index.add("other", "T", "x", rng.integers(0, vocab, 30).tolist())
        prompt = rng.integers(0, vocab, 40).tolist()
        begin, end = sorted(rng.integers(0, 41, 2).tolist())
        min_span = int(rng.integers(3, 7))
        got = index.find_spans("S", prompt, begin, end, min_span)
        want = brute_force(entries, prompt, begin, end, min_span)
        assert [(m.start, m.length, (m.origin.key, m.origin.offset),
                 (m.latest.key, m.latest.offset)) for m in got] == want, trial  # fmt: skip
        for m in got:
            for occ in (m.origin, m.latest):
                prompt_len = index._entries[occ.key].prompt_len
                assert occ.in_output == (occ.offset + m.length > prompt_len)
                assert occ.agent == f"agent{occ.key[1:]}"
        found += len(got)
    assert found > 100  # the comparison was not vacuous


def test_evicted_requests_leave_the_gram_index_and_are_never_returned():
    index = SpanIndex(capacity_bytes=60, bytes_per_token=1, gram=GRAM)
    x = fresh(100, 20)
    index.add("old", "S", "a", x)
    index.add("keep", "T", "a", fresh(200, 20))
    assert index.find_spans("S", x, 0, 20, 8)[0].origin.key == "old"
    index.find_spans("T", fresh(200, 20), 0, 20, 8)  # "old" is now least recently used
    assert index.add("new", "S", "a", fresh(300, 25)) == (True, ["old"])
    assert index.find_spans("S", x, 0, 20, 8) == []
    assert all(k != "old" for grams in index._grams.values() for b in grams.values() for k, _ in b)
    # The key may come back with other tokens: no stale offsets from its first life.
    index.add("old", "U", "a", fresh(400, 10) + x[:10], prompt_len=10)
    [match] = index.find_spans("U", x, 0, 20, 8)
    assert (match.start, match.length, match.origin) == (0, 10, Occurrence("old", 10, "a", True))
    # A session whose requests are all evicted leaves no index behind, even when one of them
    # was too short to have any window.
    index.add("short", "U", "a", [1, 2])
    index.add("big", "V", "a", fresh(500, 60))
    assert set(index._grams) == {"V"} and list(index._entries) == ["big"]
