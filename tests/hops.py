"""Drive single hops of a method on a tiny model, the way the runner does, without a tokenizer."""

from __future__ import annotations

from kvcmas.chat import Segment
from kvcmas.methods.base import Hop, HopBuild, Method, SharedSegment
from kvcmas.workflow.runner import publish_sources


def shared_query(tokens) -> dict[str, SharedSegment]:
    return {"query": SharedSegment("query", "query", tuple(tokens))}


def run_hop(method: Method, model, agent: str, prefix, parts, shared, session="s0", step=0):
    """``parts``: token lists (private text) and slot names, after the system ``prefix``.
    Deferred anchor work is flushed after the hop, so pools are complete on return."""
    segments = [Segment(tuple(prefix))]
    for p in parts:
        segments.append(
            Segment(shared[p].tokens, slot=p) if isinstance(p, str) else Segment(tuple(p))
        )
    hop = Hop(agent, session, step, segments, shared)
    cache = model.new_cache()
    model.prefill(list(prefix), cache)
    build: HopBuild = method.build(hop, model, cache)
    publish_sources(hop, build, model)
    method.after_hop(hop, build)
    method.flush()
    return build
