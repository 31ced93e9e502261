"""Selective repair of a span already placed in the cache (METHOD.md sections 4.6 and 5).

A reused span (a raw source, or KVCMAS's corrected one) sits at the hop's positions. Repair
recomputes exactly a chosen set of its tokens and writes their fresh K/V over the placed ones;
CacheBlend, KVCMAS's graded repair and the head-recompute baseline all go through
:func:`repair_span`.

The chosen set is the span's first ``head`` tokens (attention-sink tokens carry much of a
reused span's deviation) plus ``extra`` tokens scored at a check layer ``c``:

* ``select="deviation"`` (CacheBlend's rule): layers ``0..c`` run for *all* span tokens, and
  a token's score is ``sum((fresh - placed)^2)`` of its values (or keys) at layer ``c``;
* ``select="head"``: nothing is scored; the ``extra`` tokens are the ones right after the head,
  so the whole budget lengthens the head and no check pass is paid (head recompute's cost at
  the same count);
* ``select="attention"``: after the same pass, the attention the hop's question (its final
  private text: the instruction and generation prompt) pays to each span token at layer ``c``.
  The question's rows are run through layers ``0..c-1`` placed right after the span, attending
  to the context so far (segments between the span and the question are not built yet and are
  skipped); their K/V is then dropped. Its cost is reported as ``probe_tokens``, not as pairs.

The chosen tokens then run layers ``c+1..L-1`` entering with their exact hidden state from the
pass, attending with the exact causal mask to the prefix, to fresh K/V of chosen tokens and to
placed K/V of the rest. With ``extra == 0`` (or ``select="head"``) nothing is scored: the
head tokens run all layers from their embeddings and no all-token pass is made. ``pairs``
counts every (token, layer) pair run: ``n * (c + 1) + k * (L - c - 1)`` with a pass,
``head * L`` without.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcmas.methods.base import Hop
from kvcmas.methods.relaycaching import received_attention
from kvcmas.model.cache import KVCache
from kvcmas.model.transformer import Transformer

SELECTIONS = ("deviation", "attention", "head")
SCORED = ("value", "key")


@dataclass(frozen=True)
class Repair:
    """What :func:`repair_span` did: chosen token indices (into the span, sorted) and cost."""

    selected: torch.Tensor
    pairs: int
    probe_tokens: int = 0

    @property
    def count(self) -> int:
        return len(self.selected)


def fraction_count(fraction: float, n: int) -> int:
    """Tokens a budget fraction selects out of ``n``: ``ceil(fraction * n)`` (0 only for 0)."""
    return min(n, math.ceil(fraction * n - 1e-9))


def question_tokens(hop: Hop) -> tuple[int, ...]:
    """The hop's question for attention scoring: its final private text (the prompt ends with
    the instruction and the generation prompt, which every hop has)."""
    return tuple(hop.segments[-1].tokens) if not hop.segments[-1].shared else ()


def check_layer_fits(check_layer: int, n_layers: int) -> None:
    if not 0 <= check_layer < n_layers:
        raise ValueError(f"check_layer {check_layer} is not below the model's {n_layers} layers")


def repair_span(
    model: Transformer,
    cache: KVCache,
    tokens: Sequence[int],
    start: int,
    *,
    head: int = 0,
    extra: int = 0,
    select: str = "deviation",
    check_layer: int = 1,
    score_on: str = "value",
    question: Sequence[int] = (),
) -> Repair:
    """Recompute the first ``head`` tokens and ``extra`` scored tokens of the span ``tokens``
    placed at ``start..start+n-1`` of ``cache`` (see the module docstring)."""
    n, n_layers = len(tokens), model.config.n_layers
    check_layer_fits(check_layer, n_layers)
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {', '.join(SELECTIONS)}, got {select!r}")
    if score_on not in SCORED:
        raise ValueError(f"score_on must be one of {', '.join(SCORED)}, got {score_on!r}")
    if cache.length != start + n:
        raise ValueError("the span to repair must be the last thing placed in the cache")
    head = max(0, min(head, n))
    extra = max(0, min(extra, n - head))
    if select == "head":  # the budget lengthens the head: nothing to score
        head, extra = head + extra, 0
    device = cache.device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    rows = torch.arange(start, start + n, device=device)
    if extra == 0:
        chosen = torch.arange(head, device=device)
        if head:
            model.forward(ids[:head], rows[:head], cache, logits_rows=None)
        return Repair(chosen, head * n_layers)
    c = check_layer
    store = cache.v if score_on == "value" else cache.k
    placed = store[c, :, start : start + n].float().clone() if select == "deviation" else None
    capture = (c,) if select == "attention" else ()
    out = model.forward(ids, rows, cache, layers=range(c + 1), logits_rows=None, capture=capture)
    probe = 0
    if select == "deviation":
        score = (store[c, :, start : start + n].float() - placed).pow(2).sum((0, 2))
    else:
        score, probe = _question_attention(model, cache, question, out.captured[c], start, c)
    if head:  # the head is chosen anyway: the extra come from the rest
        top = torch.topk(score[head:], extra).indices + head
    else:
        top = torch.topk(score, extra).indices
    chosen = torch.cat([torch.arange(head, device=device), top]).sort().values
    if c + 1 < n_layers:
        model.forward(
            None,
            rows[chosen],
            cache,
            layers=range(c + 1, n_layers),
            hidden=out.hidden[chosen],
            logits_rows=None,
        )
    pairs = n * (c + 1) + len(chosen) * (n_layers - c - 1)
    return Repair(chosen, pairs, probe)


def _question_attention(
    model: Transformer,
    cache: KVCache,
    question: Sequence[int],
    span_hidden: torch.Tensor,
    start: int,
    layer: int,
) -> tuple[torch.Tensor, int]:
    """Mean attention the question's rows pay to each span token at ``layer`` (see the module
    docstring). Without a question the span's own last 10 tokens ask, as in RelayCaching;
    ``span_hidden`` is the span's hidden input to ``layer`` from the check pass."""
    n = span_hidden.shape[0]
    end = start + n
    if not question:
        rows = torch.arange(end - min(10, n), end, device=cache.device)
        with torch.inference_mode():
            q, _, _ = model.project_kv(layer, span_hidden[rows - start], rows)
        return received_attention(q, cache.k[layer, :, :end], rows, start), 0
    ids = torch.tensor(question, dtype=torch.long, device=cache.device)
    rows = torch.arange(end, end + len(ids), device=cache.device)
    try:
        with torch.inference_mode():
            if layer == 0:
                hidden = model.embed_tokens(ids)
            else:
                hidden = model.forward(ids, rows, cache, layers=range(layer), logits_rows=None)
                hidden = hidden.hidden
            q, _, _ = model.project_kv(layer, hidden, rows)
        att = received_attention(q, cache.k[layer, :, :end], rows, start)
    finally:
        cache.truncate(end)  # the probe's K/V beyond the span is dropped
    return att, len(ids) * layer
