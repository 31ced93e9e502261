"""What the connector claims of a new prompt, decided in vLLM's scheduler at admission.

vLLM lets a connector claim one run of tokens, directly after the prefix vLLM computed itself
(``num_computed``), once. So the claim covers, in order:

1. an *exact run*: the prompt continues a saved request token for token, over that
   request's exact KV (``exact_upto``: before any KV a method approximated); the request
   may be of any session of the namespace (exact KV is the same whoever computed it: this is
   how a new session reads its agents' system prompts);
2. then every *shared span* of the rest: a run of at least ``min_span`` tokens equal to tokens
   of an earlier prompt or output of the session, found by token matching
   (:meth:`kvcmas.serve.span_store.SpanIndex.find_spans`); the private text between spans is
   computed in the claim by kvcmas's runtime, and the claim ends where the last span ends.

Spans not worth a build are left to vLLM's forward: either the trailing spans a fixed rule
rejects (:class:`SpanRule`, when the operator pins one), or every span after the point where
the measured costs say the claim stops paying (:mod:`kvcmas.serve.costs`). The claim ends
before them, and they are recorded as computed by the engine (so reuse counts them as
dense). A claim may then supply no tokens at all and still carry that record. An exact run
that is all a claim would supply is left to vLLM too when it is shorter than ``min_span``:
copying a run into the paged cache costs a fixed amount per layer (10-15 ms for a 24-27-token
run over SmolLM2's 30 layers, measured in the engine on the AMX host), more than vLLM's
prefill of those tokens in its batch (about 0.3 ms a token there).

vLLM computes the rest of the prompt (at least its last token, to sample from) and decodes.
No torch or vllm import here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvcmas.serve.params import DEFAULT_MIN_GAIN
from kvcmas.serve.plans import SourceRef, SpanPiece
from kvcmas.serve.span_index import SpanIndex

# A span shorter than this is not worth a slot: with graded repair a span's first 16 tokens
# (the attention sinks) are recomputed, so at 32 at least half of a span is served; and a run
# of 32 equal tokens outside copied text is unlikely (role markers are 3-6 tokens).
DEFAULT_MIN_SPAN = 32


@dataclass
class Claim:
    start: int  # vLLM's computed prefix ends here
    end: int  # the claim ends here
    exact_key: str | None = None
    exact_end: int = 0
    spans: list[SpanPiece] = field(default_factory=list)
    engine_spans: list[SpanPiece] = field(default_factory=list)  # after ``end``: vLLM's

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def span_tokens(self) -> int:
        return sum(s.length for s in self.spans)

    def cut(self, length: int) -> Claim:
        """The claim's first ``length`` tokens (when vLLM admits fewer than claimed): spans
        past the cut are dropped and one across it is shortened."""
        end = self.start + length
        spans = []
        for s in self.spans:
            if s.start < end:
                spans.append(replace(s, length=min(s.length, end - s.start)))
        return Claim(self.start, end, self.exact_key, min(self.exact_end, end), spans,
                     self.engine_spans)


@dataclass(frozen=True)
class SpanRule:
    """Whether the connector builds a shared span or leaves it to vLLM's forward: the span's
    served tokens (those the method does not recompute) must be at least ``min_gain`` times
    its recomputed ones, and more than none (a span the method recomputes whole is the same
    dense work, batched better in the engine)."""

    recomputed_tokens: Callable[[int], int]  # the method's, by span length
    min_gain: float = DEFAULT_MIN_GAIN

    def worth_building(self, length: int) -> bool:
        recomputed = min(length, self.recomputed_tokens(length))
        served = length - recomputed
        return served > 0 and served >= self.min_gain * recomputed


def span_slots(matches) -> list[tuple[str, str]]:
    """(slot, kind) per span. The slot names the producer, so anchor pools are per
    (producer, consumer): an output's producer is the agent that wrote it; a span first seen
    in a prompt (the user's question, a document) is named after that prompt's agent. A second
    span of one producer in the same prompt gets ``#2`` (its own pool)."""
    out, seen = [], {}
    for m in matches:
        kind = "agent" if m.origin.in_output else "input"
        base = f"{'out' if m.origin.in_output else 'in'}:{m.origin.agent}"
        seen[base] = seen.get(base, 0) + 1
        out.append((base if seen[base] == 1 else f"{base}#{seen[base]}", kind))
    return out


def plan_claim(
    index: SpanIndex,
    session: str,
    prompt_ids: Sequence[int],
    num_computed: int,
    *,
    with_spans: bool,
    min_span: int = DEFAULT_MIN_SPAN,
    namespace: str | None = None,
    span_rule: SpanRule | None = None,
    keep_spans: Callable[[int, list[SpanPiece]], int] | None = None,
) -> Claim | None:
    """The claim for a prompt of ``session`` (in ``namespace``), or None when the connector
    neither supplies tokens nor leaves spans to the engine. Spans come from the session only;
    the exact run from the namespace. ``min_span``: the shortest span, and the shortest exact
    run claimed alone. ``span_rule``: which trailing spans are worth a build (None: every
    span). ``keep_spans(exact_end, spans)``: how many of the spans, in order, the claim builds
    (the rest is left to vLLM), decided before ``span_rule``."""
    last = len(prompt_ids) - 1  # vLLM must compute the last prompt token itself
    claim = Claim(num_computed, num_computed, exact_end=num_computed)
    exact = index.longest_exact_prefix(namespace, prompt_ids)
    if exact is not None and min(exact.length, last) > num_computed:
        claim.exact_key, claim.exact_end = exact.key, min(exact.length, last)
        claim.end = claim.exact_end
    if with_spans and last - claim.exact_end >= min_span:
        matches = index.find_spans(session, prompt_ids, claim.exact_end, last, min_span)
        for m, (slot, kind) in zip(matches, span_slots(matches), strict=True):
            origin = SourceRef(m.origin.key, m.origin.offset, m.origin.agent)
            latest = SourceRef(m.latest.key, m.latest.offset, m.latest.agent)
            claim.spans.append(SpanPiece(m.start, m.length, slot, kind, origin, latest))
        if keep_spans is not None:  # the measured costs decide how far the claim reaches
            kept = keep_spans(claim.exact_end, claim.spans)
            claim.spans, claim.engine_spans = claim.spans[:kept], claim.spans[kept:]
        while claim.spans and span_rule and not span_rule.worth_building(claim.spans[-1].length):
            claim.engine_spans.insert(0, claim.spans.pop())
        if claim.spans:
            claim.end = claim.spans[-1].start + claim.spans[-1].length
    if not claim.spans and claim.exact_end - num_computed < min_span:
        claim.exact_key, claim.exact_end, claim.end = None, num_computed, num_computed
    return claim if claim.length > 0 or claim.engine_spans else None
