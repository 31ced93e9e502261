"""What the connector's scheduler side hands its worker side each step, and what a claim is.

The two sides of the connector run in vLLM's scheduler and in its worker (possibly different
processes); these plain records are all that crosses between them, through vLLM's connector
metadata. No torch or vllm import here, so the scheduler side stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SourceRef:
    """Where a span's tokens sit in a saved request: its store key and first position."""

    key: str
    offset: int
    agent: str  # the agent of that saved request


@dataclass(frozen=True)
class SpanPiece:
    """A shared span of the prompt at ``[start, start + length)``, built by the method."""

    start: int
    length: int
    slot: str  # names the anchor pool with the consumer agent: the producer, see connector
    kind: str  # "agent" (first seen in an output) or "input" (first seen in a prompt)
    origin: SourceRef
    latest: SourceRef


@dataclass
class RangePlan:
    """What the scheduler claimed for one request, and how the worker fills it."""

    request_id: str
    session: str
    agent: str  # the consumer: the agent of this request
    namespace: str | None
    block_ids: list[int]
    start: int  # vLLM computed the prompt up to here
    end: int  # the claim ends here (vLLM computes the rest of the prompt)
    token_ids: list[int]  # the prompt's tokens [0, end)
    exact_key: str | None = None  # copy [start, exact_end) from this saved request
    exact_end: int = 0
    spans: list[SpanPiece] = field(default_factory=list)
    method: str = "exact"  # the method that builds the spans
    # Spans after the claim that the method would recompute whole: vLLM computes them (they
    # are recorded with the build, so reuse counts them).
    engine_spans: list[SpanPiece] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.exact_end = max(self.exact_end, self.start)
        bounds = [(self.exact_end, self.exact_end)] + [(s.start, s.start + s.length)
                                                        for s in self.spans]
        for (_, prev_end), (begin, end) in zip(bounds, bounds[1:], strict=False):
            if begin < prev_end or end <= begin:
                raise ValueError(f"request {self.request_id}: spans overlap or are empty")
        if bounds[-1][1] > self.end or len(self.token_ids) < self.end:
            raise ValueError(f"request {self.request_id}: spans run past the claimed range")
        if any(s.start < self.end for s in self.engine_spans):
            raise ValueError(f"request {self.request_id}: an engine span inside the claim")


@dataclass(frozen=True)
class EngineSpan:
    """A shared span the claim left to vLLM: once the request is saved, its KV there (dense,
    in the consumer's context) and the span's ``latest`` source teach the method."""

    start: int  # in the saved request
    length: int
    slot: str
    latest: SourceRef


@dataclass
class SaveOrder:
    """Copy a finished request's KV out of its blocks into the span store under ``key``."""

    key: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    dump: bool = False  # test hook: also write the saved KV to $KVCMAS_DUMP_DIR
    # Spans vLLM computed for the request, and for whom (the method, its namespace and the
    # consumer agent): learned from once the copy is done.
    learn: list[EngineSpan] = field(default_factory=list)
    method: str = "exact"
    namespace: str | None = None
    agent: str = ""


@dataclass
class LoadOrder:
    """Fill a claim: ``plan`` says what (an exact copy, or a range a method builds)."""

    plan: RangePlan
    noise_std: float = 0.0


@dataclass
class StepOrders:
    """One step's orders to the worker. It applies them in this order: drops free memory
    before saves, and saves come before loads so a request may read a source indexed in the
    same step."""

    drops: list[str] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    # Claims that supply no tokens, only spans left to vLLM: logged as the requests' builds.
    records: list[RangePlan] = field(default_factory=list)
    # Tokens vLLM computes in this step's forward, which the worker times (the engine's cost).
    scheduled_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.drops or self.saves or self.loads or self.records)
