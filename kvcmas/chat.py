"""Render a system prompt and a user prompt with named slots into token segments.

The model's chat template is rendered once with a unique marker in place of each slot; the
rendered text is split at the markers into private pieces, each tokenized on its own, and
slot contents are tokenized on their own too (METHOD.md section 2, rule 1). Concatenating the
pieces equals tokenizing the whole rendered string whenever every slot boundary is a
pre-tokenizer boundary (e.g. a slot that starts a line); a boundary inside a word-with-space,
such as ``"Question: {query}"``, tokenizes differently (``" What"`` becomes ``" "`` + ``"What"``),
and so does a slot whose content ends in punctuation before a newline on tokenizers that
merge the two (Qwen2: ``"?\n"`` is one token). That is the price of a shared segment having
one token sequence in every agent; every method sees the same sequence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SLOT_PATTERN = re.compile(r"\{([A-Za-z_][A-Za-z0-9_\-]*)\}")
_MARK = "\u2063kvcmas-slot:{}\u2063"  # invisible separator: never produced by a template
_MARK_PATTERN = re.compile("\u2063kvcmas-slot:([^\u2063]+)\u2063")


@dataclass(frozen=True)
class Segment:
    """A piece of a hop's prompt: private text (``slot is None``) or a shared slot's content."""

    tokens: tuple[int, ...]
    slot: str | None = None

    @property
    def shared(self) -> bool:
        return self.slot is not None

    def __len__(self) -> int:
        return len(self.tokens)


def slot_names(prompt: str) -> list[str]:
    """Slot names in order of appearance (``{query}``, ``{solver}``...)."""
    return SLOT_PATTERN.findall(prompt)


def tokenize(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat(tokenizer, system: str | None, user: str) -> str:
    """The chat template's text for one system + user turn, ready for the assistant."""
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_template(tokenizer, system: str | None, prompt: str) -> list[str | tuple[str]]:
    """Render the chat template; return private strings and ``(slot,)`` markers in order."""
    marked = SLOT_PATTERN.sub(lambda m: _MARK.format(m.group(1)), prompt)
    text = render_chat(tokenizer, system, marked)
    parts: list[str | tuple[str]] = []
    pos = 0
    for m in _MARK_PATTERN.finditer(text):
        parts.append(text[pos : m.start()])
        parts.append((m.group(1),))
        pos = m.end()
    parts.append(text[pos:])
    return [p for p in parts if p != ""]


def render_segments(
    tokenizer,
    system: str | None,
    prompt: str,
    slot_tokens: dict[str, tuple[int, ...]],
    reply_prefix: tuple[int, ...] = (),
) -> list[Segment]:
    """Token segments of one agent call; ``slot_tokens`` holds each slot's content tokens.

    ``reply_prefix`` (tokens that open the assistant's reply) extends the last private
    segment, which always ends with the generation prompt.
    """
    segments = []
    for part in render_template(tokenizer, system, prompt):
        if isinstance(part, tuple):
            name = part[0]
            if name not in slot_tokens:
                raise KeyError(f"no content for slot {{{name}}}")
            segments.append(Segment(tuple(slot_tokens[name]), slot=name))
        else:
            segments.append(Segment(tokenize(tokenizer, part)))
    if reply_prefix:
        segments[-1] = Segment(segments[-1].tokens + tuple(reply_prefix))
    return segments


def chat_segments(tokenizer, system: str | None, prompt: str) -> list[Segment]:
    """A plain chat prompt (braces are text, not slots) as one private segment."""
    return [Segment(tokenize(tokenizer, render_chat(tokenizer, system, prompt)))]
