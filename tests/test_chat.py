"""Chat templates rendered into token segments with slots."""

from __future__ import annotations

import pytest

from kvcmas.chat import render_chat, render_segments, slot_names, tokenize


@pytest.fixture(scope="module")
def tokenizer(real_model):
    return real_model.tokenizer


def test_slots_split_the_rendered_template(tokenizer):
    q = tokenize(tokenizer, "What is 2+2?")
    segs = render_segments(tokenizer, "You are terse.", "Question:\n{query}\nAnswer.", {"query": q})
    assert [s.slot for s in segs] == [None, "query", None]
    assert segs[1].tokens == q
    tail = tokenizer.decode(list(segs[2].tokens))
    assert tail.endswith("<|im_start|>assistant\n")  # the generation prompt is appended


def test_concatenation_equals_tokenizing_rendered_text_at_line_boundaries(tokenizer):
    prompt = "Question:\n{query}\nThe solver wrote:\n{solver}\nGive the final answer."
    values = {"query": "How many legs has a spider?", "solver": "Eight legs, it is an arachnid."}
    segs = render_segments(
        tokenizer, "You judge.", prompt, {k: tokenize(tokenizer, v) for k, v in values.items()}
    )
    joined = [t for s in segs for t in s.tokens]
    text = render_chat(tokenizer, "You judge.", prompt.format(**values))
    assert joined == list(tokenize(tokenizer, text))


def test_slot_after_a_space_is_documented_to_differ(tokenizer):
    # "Question: {query}": jointly " What" is one token, split it is " " + "What" (README).
    segs = render_segments(
        tokenizer, None, "Question: {query}", {"query": tokenize(tokenizer, "What")}
    )
    joined = [t for s in segs for t in s.tokens]
    assert joined != list(tokenize(tokenizer, render_chat(tokenizer, None, "Question: What")))


def test_missing_slot_content_is_an_error(tokenizer):
    with pytest.raises(KeyError, match="query"):
        render_segments(tokenizer, None, "{query}", {})


def test_slot_names_in_order():
    assert slot_names("a {query} b {solver} {query}") == ["query", "solver", "query"]
