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

vLLM computes the rest of the prompt (at least its last token, to sample from) and decodes.
No vllm import here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvcmas.serve.range_builder import SourceRef, SpanPiece
from kvcmas.serve.span_store import SpanIndex

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
    recomputes_whole: Callable[[int], bool] | None = None,
) -> Claim | None:
    """The claim for a prompt of ``session`` (in ``namespace``), or None when the connector
    supplies nothing. Spans come from the session only; the exact run from the namespace.
    ``recomputes_whole(length)``: the method's rule for spans it would compute densely."""
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
        while len(claim.spans) > 1 and recomputes_whole and recomputes_whole(
            claim.spans[-1].length
        ):
            claim.engine_spans.insert(0, claim.spans.pop())
        if claim.spans:
            claim.end = claim.spans[-1].start + claim.spans[-1].length
    return claim if claim.length > 0 else None
