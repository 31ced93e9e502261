"""Shared documents of exactly N tokens, cut deterministically from benchmark questions."""

from __future__ import annotations

from typing import Any

from kvcmas.chat import tokenize


def exact_prefix(tokenizer: Any, ids: list[int], n: int, slack: int = 8) -> str:
    """Text whose tokenization (after ``strip``) is exactly ``n`` tokens, cut from ``ids``.

    Cuts near ``n`` are tried first; where stripping a trailing space leaves one token short
    at every cut (digits split off a space token), a final ``.`` supplies the last token."""
    cuts = [n + d for d in sorted(range(-slack, slack + 1), key=abs) if 0 < n + d <= len(ids)]
    for suffix in ("", "."):
        for cut in cuts:
            text = tokenizer.decode(ids[:cut]).strip() + suffix
            if len(tokenize(tokenizer, text)) == n:
                return text
    raise ValueError(f"no cut near {n} tokens re-tokenizes to exactly {n} tokens")


def documents(tokenizer: Any, texts: list[str], n_tokens: int, count: int) -> list[str]:
    """``count`` documents of exactly ``n_tokens`` tokens, each from the next ``texts``.

    Where no cut of a block of text re-tokenizes to exactly ``n_tokens`` (seen at 1024), the
    block is skipped and the next texts are tried."""
    docs, pos = [], 0
    while len(docs) < count:
        parts, total = [], 0
        while total < n_tokens + 16:
            if pos >= len(texts):
                raise ValueError(f"not enough text for {count} documents of {n_tokens} tokens")
            parts.append(texts[pos])
            total += len(tokenize(tokenizer, texts[pos])) + 1
            pos += 1
        ids = list(tokenize(tokenizer, "\n\n".join(parts)))
        try:
            docs.append(exact_prefix(tokenizer, ids, n_tokens))
        except ValueError:
            continue
    return docs


def source_texts(source: str, split: str = "test") -> list[str]:
    """The questions of a dataset's split (prepared on first use)."""
    from kvcmas.eval.requests import load_requests

    return [r["query"] for r in load_requests(source, None, split=split)]
