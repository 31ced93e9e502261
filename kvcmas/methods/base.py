"""The interface every reuse method implements, and the records it reports.

A method builds one hop's context KV from the hop's segments on top of the agent's cached
system prefix (METHOD.md section 2, rule 2). Private segments are prefilled densely here for
every method (rule 3); a method decides only how each shared segment gets its K/V, given the
caches that earlier hops hold of it (its *sources*).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, astuple, dataclass, field
from typing import Any, ClassVar

import torch

from kvcmas.chat import Segment
from kvcmas.kv.segment import SegmentKV, place_segment
from kvcmas.methods.config import MethodConfig
from kvcmas.methods.session_state import SessionState
from kvcmas.model.cache import KVCache
from kvcmas.model.transformer import Transformer


@dataclass
class SharedSegment:
    """One shared segment of a request and the caches earlier hops hold of it.

    ``origin`` is exact: for an agent output, the producer's decode cache; for the query or a
    supplied input, the cache of its first consumer (which prefilled it densely). ``latest``
    is the cache held by the most recent hop that had the segment in its context, corrected
    or not: the source of chained correction (METHOD.md section 4.1).
    """

    slot: str
    kind: str  # "query", "agent" or "input"
    tokens: tuple[int, ...]
    origin: SegmentKV | None = None
    origin_agent: str | None = None
    latest: SegmentKV | None = None
    latest_agent: str | None = None

    def record(self, agent: str, kv: SegmentKV) -> None:
        if self.origin is None:
            self.origin, self.origin_agent = kv, agent
        self.latest, self.latest_agent = kv, agent

    def nbytes(self) -> int:
        held = {id(x): x for x in (self.origin, self.latest) if x is not None}
        return sum(x.nbytes() for x in held.values())


@dataclass
class Hop:
    """One agent call: its segments (the first is the cached system prefix) and shared state."""

    agent: str
    session: str  # scopes per-request state (saved hidden states, reference prefills)
    step: int  # position of this hop in the request's execution order
    segments: list[Segment]
    shared: dict[str, SharedSegment]

    @property
    def prefix_len(self) -> int:
        return len(self.segments[0])

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]


@dataclass
class SegmentRecord:
    """What a method did for one segment of a hop."""

    slot: str | None  # None for private text
    kind: str  # "private", "query", "agent", "input"
    start: int
    length: int
    decision: str  # "dense", "reuse" (all layers reused) or "partial" (some pairs recomputed)
    computed_pairs: int  # (token, layer) pairs computed through the model for this segment
    served_tokens: int = 0  # tokens served from a source: neither dense nor selected (rho)
    entropy: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


@dataclass
class HopBuild:
    cache: KVCache  # the full prompt's KV (in the connector: up to the built range's end)
    last_logits: torch.Tensor | None  # float32 logits of the last token (None: connector)
    records: list[SegmentRecord]


class Method(ABC):
    """A way of building a hop's context KV. Instances live across requests (pools persist).

    Capabilities are explicit class members, read by the runner, the experiments and the
    serving connector: ``reads_sources`` (the runner keeps each hop's segment caches for it),
    ``needs_hidden_states`` (it saves hidden states of shared spans while they are computed or
    decoded, which a serving engine that hands over only KV cannot provide) and
    ``learns_across_requests`` (its state, such as anchor pools, carries from one request to
    the next, so benchmarks warm it up first).
    """

    name: ClassVar[str]
    Config: ClassVar[type[MethodConfig]] = MethodConfig
    reads_sources: ClassVar[bool] = True
    needs_hidden_states: ClassVar[bool] = False
    learns_across_requests: ClassVar[bool] = False

    def __init__(self, config: MethodConfig | None = None):
        config = self.Config() if config is None else config
        if not isinstance(config, self.Config):
            raise TypeError(f"{self.name} takes a {self.Config.__name__}, got {type(config)}")
        self.config = config
        # Per-session values (reference prefills, bases, hidden states), by session.
        self.session_state = SessionState()

    def params(self) -> dict[str, Any]:
        """The method's parameters, reported with every result."""
        return self.config.to_json()

    def memory_bytes(self) -> int:
        """Bytes of state the method keeps across hops (anchor pools, saved hidden states)."""
        return self.session_state.nbytes()

    def pool_report(self, n_layers: int, width: int) -> dict[str, int] | None:
        """Anchor-pool bytes (measured and analytic) for methods that keep pools; else None."""
        return None

    def recomputed_tokens(self, length: int) -> int:
        """Tokens of a shared span of ``length`` this method recomputes through every layer
        whenever it builds the span, whatever its source and gate (a repaired head): the
        serving connector's cost rule weighs them against the tokens the span serves."""
        return 0

    def recomputes_whole(self, length: int) -> bool:
        """True when this method computes every (token, layer) pair of a shared span of
        ``length`` tokens densely, whatever its source and gate. The serving connector leaves
        such a span to the engine's own forward: the same dense computation, batched with the
        engine's other work instead of run in the connector."""
        return length > 0 and self.recomputed_tokens(length) >= length

    def predicted_recompute(self, slot: str, agent: str, length: int) -> int:
        """Tokens of a span of ``slot`` read by ``agent`` that this method's next build of it
        is expected to recompute: its rule (``recomputed_tokens``), or more where its state
        says so (a gate with no anchors yet prefills densely). The serving connector's cost
        rule reads it."""
        return min(length, self.recomputed_tokens(length))

    @property
    def learns_from_engine(self) -> bool:
        """Whether ``learn_from_engine`` learns: then a span of an edge the method has not
        learned yet is better left to the engine (which teaches it) than built cold."""
        return False

    def learn_from_engine(self, slot: str, agent: str, source: SegmentKV, dense: SegmentKV):
        """A span of ``slot`` the engine computed densely in ``agent``'s prompt (``dense``,
        canonical frame) while the method would have reused ``source`` (the span's latest
        earlier cache): what a dense fallback of the method learns from, at no cost to the
        critical path. Methods that learn nothing ignore it."""
        return

    def flush(self) -> float:
        """Finish deferred background work (anchor construction); seconds it took here.
        Runs are deterministic after a flush: tests and replays call it between requests."""
        return 0.0

    def build(self, hop: Hop, model: Transformer, cache: KVCache) -> HopBuild:
        """Extend ``cache`` (holding the system prefix) with the rest of the hop's prompt."""
        records, logits = self.build_segments(hop, model, cache)
        if logits is None:
            raise ValueError("a hop's prompt must end with private text (the generation prompt)")
        return HopBuild(cache, logits, records)

    def build_segments(
        self, hop: Hop, model: Transformer, cache: KVCache
    ) -> tuple[list[SegmentRecord], torch.Tensor | None]:
        """Extend ``cache`` with ``hop.segments[1:]``; returns the records and the logits of the
        last token when the last segment is private text. The serving connector builds a
        range that ends with a shared span this way (the engine computes the rest)."""
        self.session_state.enter(hop.session)
        records: list[SegmentRecord] = []
        logits = None
        for seg in hop.segments[1:]:
            if len(seg) == 0:  # e.g. an agent that answered nothing
                continue
            if seg.shared:
                records.append(self.build_shared(hop, seg, hop.shared[seg.slot], model, cache))
                logits = None
            else:
                start = cache.length
                logits = model.prefill(seg.tokens, cache)
                pairs = len(seg) * model.config.n_layers
                records.append(SegmentRecord(None, "private", start, len(seg), "dense", pairs))
        return records, logits

    @abstractmethod
    def build_shared(
        self, hop: Hop, seg: Segment, shared: SharedSegment, model: Transformer, cache: KVCache
    ) -> SegmentRecord:
        """Append the K/V of shared segment ``seg`` to ``cache`` and say how."""

    def after_hop(self, hop: Hop, build: HopBuild) -> None:  # noqa: B027 - optional hook
        """After the hop's first token: queue background work (anchor construction)."""

    def decode_capture_layers(self) -> tuple[int, ...]:
        """Layers whose hidden input the runner captures for an agent's output tokens while
        decoding them (only for ``needs_hidden_states`` methods)."""
        return ()

    def after_decode(  # noqa: B027 - optional hook
        self, hop: Hop, captured: dict[int, torch.Tensor]
    ) -> None:
        """Receives ``layer -> [n_output_tokens, hidden]`` for ``decode_capture_layers()``."""


@dataclass(frozen=True)
class ReuseCounts:
    """The one definition of reuse (METHOD.md section 5), summed over any set of records.

    ``rho`` is the share of shared tokens served from a source: neither prefilled densely nor
    selected for recomputation (recomputing *all* tokens in a fixed set of layers, as
    DroidSpeak's block or CacheBlend's check layer do, does not unselect a token; it shows in
    the recompute fraction). ``recompute_fraction`` is computed (token, layer) pairs of shared
    tokens over the pairs a dense prefill computes.
    """

    shared_tokens: int = 0
    served_tokens: int = 0
    computed_pairs: int = 0
    dense_pairs: int = 0

    @classmethod
    def of(cls, records: list[SegmentRecord], n_layers: int) -> ReuseCounts:
        shared = [r for r in records if r.slot is not None]
        n = sum(r.length for r in shared)
        return cls(
            n, sum(r.served_tokens for r in shared), sum(r.computed_pairs for r in shared),
            n * n_layers,
        )

    def __add__(self, other: ReuseCounts) -> ReuseCounts:
        return ReuseCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def rho(self) -> float | None:
        return self.served_tokens / self.shared_tokens if self.shared_tokens else None

    @property
    def recompute_fraction(self) -> float | None:
        return self.computed_pairs / self.dense_pairs if self.dense_pairs else None


def dense_shared(
    seg: Segment,
    shared: SharedSegment,
    model: Transformer,
    cache: KVCache,
    entropy: float | None = None,
) -> SegmentRecord:
    """Prefill a shared segment densely in the hop's context built so far."""
    start = cache.length
    model.prefill(seg.tokens, cache)
    pairs = len(seg) * model.config.n_layers
    return SegmentRecord(seg.slot, shared.kind, start, len(seg), "dense", pairs, entropy=entropy)


def standalone_prefill(model: Transformer, tokens: tuple[int, ...]) -> SegmentKV:
    """A context-free cache of ``tokens``: prefilled alone from position 0 (no prefix)."""
    cache = model.new_cache(capacity=len(tokens))
    model.prefill(list(tokens), cache)
    k, v = cache.span(0, len(tokens))
    return SegmentKV(k, v)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix: a binary search over slice comparisons (done in C),
    not a Python loop over the tokens of a 2K-token span."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def kept_standalone_prefill(
    state: SessionState, session: str, kind: str, model: Transformer, tokens: tuple[int, ...]
) -> tuple[SegmentKV, int]:
    """``standalone_prefill(model, tokens)``, kept per session under ``(kind, tokens)`` and
    built on the kept one sharing the longest prefix with ``tokens``: a prefill is causal, so
    those rows are exactly this one's first rows and only the rest is computed. (In the
    connector a later hop's span often extends an earlier hop's: the document, then the notes
    that followed it there.) A kept prefill that is a prefix of the new one is dropped.
    Returns the prefill and how many of its tokens were computed now."""
    best, shared = None, 0
    for key, kv in state.items(session):
        if key[0] == kind:
            n = common_prefix(key[1], tokens)
            if n > shared:
                best, shared = (key, kv), n
    if best is not None and shared == len(tokens):  # kept, or inside a longer one kept
        kv = best[1] if len(best[0][1]) == shared else SegmentKV(
            best[1].k[:, :, :shared], best[1].v[:, :, :shared])
        return kv, 0
    cache = model.new_cache(capacity=len(tokens))
    if best is not None:
        cache.append(best[1].k[:, :, :shared], best[1].v[:, :, :shared])
        if shared == len(best[0][1]):
            state.drop(session, best[0])  # the new one holds all of it
    model.prefill(list(tokens[shared:]), cache)
    k, v = cache.span(0, len(tokens))
    kv = SegmentKV(k, v)
    state.put(session, (kind, tokens), kv)
    return kv, len(tokens) - shared


def reuse_shared(
    seg: Segment,
    shared: SharedSegment,
    kv: SegmentKV,
    model: Transformer,
    cache: KVCache,
    **details: Any,
) -> SegmentRecord:
    """Place a canonical-frame cache of the segment at the hop's position, all layers reused."""
    if len(kv) != len(seg):
        raise ValueError(f"source of slot {seg.slot!r} has {len(kv)} tokens, segment {len(seg)}")
    start = place_segment(cache, kv, model.inv_freq)
    n = len(seg)
    return SegmentRecord(seg.slot, shared.kind, start, n, "reuse", 0, n, details=details)
