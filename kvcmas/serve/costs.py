"""What a claim costs and saves on the critical path, from times measured where the server runs.

A claim moves prefill work out of vLLM's batch into the connector: the tokens it supplies are
not computed by the engine, but the connector spends time before the step's forward reading
the context, recomputing what the method recomputes (private text between spans, each span's
repaired head, spans the gate sends dense) and placing the rest. Which side is faster depends
on the model, dtype, device and load, so nothing here is a constant of one machine:

* the engine's cost per prefill token is fitted to vLLM's own step times (tokens scheduled in
  a step against the seconds of its forward), measured by the worker each step;
* the connector's costs come from a short calibration at start-up (kvcmas's runtime prefilling
  two lengths, a copy into a scratch paged cache) and are then refined by every build;
* what the method will recompute of a span is what the worker last predicted for its
  (namespace, producer slot, consumer) edge: the method's head rule, or the whole span while
  its gate has no anchors for the edge (:meth:`kvcmas.methods.base.Method.predicted_recompute`).
  An edge not reported yet is predicted by the rule, or dense for a method that learns from
  the spans vLLM computes (KVCMAS: such a span is left to vLLM, whose KV of it becomes an
  anchor, so a pool fills without a single dense prefill outside vLLM's batch).

Until the worker has sent its first measurements, nothing is built (``CostModel.ready`` is
false): the claim is then an exact copy or nothing, and the spans are left to vLLM.
No torch or vllm import here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_WINDOW = 64  # recent samples a fit uses, of each kind below
# Steps that prefill at least this many tokens are kept apart from decode steps: a long decode
# would otherwise fill the window with one-token steps, whose average time per token is the
# step's fixed cost, many times a prefill token's.
PREFILL_STEP_TOKENS = 16


@dataclass(frozen=True)
class Calibration:
    """The worker's start-up measurements of kvcmas's runtime (seconds)."""

    runtime_per_token: float  # a recomputed token, from two prefill lengths
    runtime_fixed: float  # a build's fixed part: the intercept of that fit
    place_per_token: float  # writing a token of every layer into the paged cache


@dataclass(frozen=True)
class BuildSample:
    recomputed: int  # tokens the build computed (gaps, heads, spans sent dense)
    placed: int  # tokens it supplied (the claim's length)
    context: int  # tokens of context read back before the claim
    seconds: float


@dataclass(frozen=True)
class EdgeRecord:
    """How much of a span of ``length`` the method's next build on this edge will recompute
    (its prediction, after a build or after learning from the engine)."""

    edge: tuple[str | None, str, str]  # (namespace, producer slot, consumer agent)
    length: int
    recomputed: int


@dataclass
class Feedback:
    """The worker's measurements since its last report (vLLM's worker -> scheduler channel)."""

    calibration: Calibration | None = None
    steps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, forward seconds)
    builds: list[BuildSample] = field(default_factory=list)
    edges: list[EdgeRecord] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.calibration or self.steps or self.builds or self.edges)

    def merge(self, other: Feedback) -> Feedback:
        return Feedback(self.calibration or other.calibration, self.steps + other.steps,
                        self.builds + other.builds, self.edges + other.edges)  # fmt: skip


def fit_line(samples: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b x`` (a, b >= 0); None without two distinct x."""
    n = len(samples)
    if n < 2:
        return None
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    if sxx <= 0:
        return None
    b = max(0.0, sum((x - mx) * (y - my) for x, y in samples) / sxx)
    return max(0.0, my - b * mx), b


@dataclass(frozen=True)
class SpanCost:
    """A shared span of the claim as the cost rule sees it."""

    start: int
    length: int
    recomputed: int  # tokens the build is predicted to recompute of it


class CostModel:
    def __init__(self) -> None:
        self.calibration: Calibration | None = None
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=_WINDOW)
        self._prefill_steps: deque[tuple[int, float]] = deque(maxlen=_WINDOW)
        self._builds: deque[BuildSample] = deque(maxlen=_WINDOW)
        self._edges: dict[tuple, float] = {}  # edge -> share of a span the next build recomputes

    @property
    def ready(self) -> bool:
        return self.calibration is not None and self.engine_per_token() is not None

    def learn(self, feedback: Feedback) -> None:
        if feedback.calibration is not None:
            self.calibration = feedback.calibration
        for tokens, seconds in feedback.steps:
            kind = self._prefill_steps if tokens >= PREFILL_STEP_TOKENS else self._decode_steps
            kind.append((tokens, seconds))
        self._builds.extend(feedback.builds)
        for record in feedback.edges:
            if record.length > 0:
                self._edges[record.edge] = record.recomputed / record.length

    # ------------------------------------------------------------------ estimates

    def engine_per_token(self) -> float | None:
        """Seconds per prefill token of vLLM's forward: the slope of its step times against
        their tokens. None until a prefill step was seen (decode steps alone cannot tell)."""
        if not self._prefill_steps:
            return None
        steps = [(float(t), s) for t, s in (*self._decode_steps, *self._prefill_steps)]
        line = fit_line(steps)
        if line is not None and line[1] > 0:
            return line[1]
        big = self._prefill_steps  # no spread: their average, an upper bound
        return sum(s for _, s in big) / sum(t for t, _ in big)

    def runtime_scale(self) -> float:
        """Measured build seconds over what the calibration predicted for them (1 without
        builds): the calibration's few seconds cannot see the load a server runs under."""
        if self.calibration is None or not self._builds:
            return 1.0
        predicted = sum(self._build_seconds(b.recomputed, b.placed) for b in self._builds)
        measured = sum(b.seconds for b in self._builds)
        return measured / predicted if predicted > 0 else 1.0

    def _build_seconds(self, recomputed: int, placed: int) -> float:
        c = self.calibration
        return c.runtime_fixed + c.runtime_per_token * recomputed + c.place_per_token * placed

    def build_seconds(self, recomputed: int, placed: int) -> float:
        """Predicted seconds of a build that recomputes ``recomputed`` tokens and supplies
        ``placed`` (the claim's length)."""
        return self._build_seconds(recomputed, placed) * self.runtime_scale()

    def predicted_recompute(self, edge: tuple, length: int, unknown: int) -> int:
        """Tokens of a span of ``edge`` the next build will recompute, as the worker last
        predicted for the edge (``unknown`` before it has)."""
        share = self._edges.get(edge)
        return unknown if share is None else min(length, round(share * length))

    def snapshot(self) -> dict:
        """The current estimates, for /kvcmas/stats."""
        c = self.calibration
        return {
            "ready": self.ready,
            "engine_s_per_token": self.engine_per_token(),
            "runtime_s_per_token": None if c is None else c.runtime_per_token,
            "runtime_fixed_s": None if c is None else c.runtime_fixed,
            "place_s_per_token": None if c is None else c.place_per_token,
            "runtime_scale": self.runtime_scale(),
            "engine_steps": len(self._decode_steps) + len(self._prefill_steps),
            "builds": len(self._builds),
        }

    # ------------------------------------------------------------------ the decision

    def best_span_count(
        self, start: int, exact_end: int, spans: Sequence[SpanCost]
    ) -> int:
        """How many of the claim's spans (in order) to build so that the request's
        predicted critical path is shortest; the claim ends after the last one kept, and the
        rest is vLLM's. 0: build none (the claim is at most the exact run). A span predicted
        to be recomputed whole ends the claim before it: the same dense work is batched with
        vLLM's other work, never run outside it to reach a span behind it."""
        engine = self.engine_per_token()
        if not self.ready or engine is None:
            return 0
        best, best_saving = 0, 0.0
        recomputed, at = 0, exact_end
        for k, span in enumerate(spans, start=1):
            if span.recomputed >= span.length:
                break
            recomputed += (span.start - at) + span.recomputed  # private text, then the span
            at = span.start + span.length
            placed = at - start
            saving = engine * placed - self.build_seconds(recomputed, placed)
            if saving > best_saving:
                best, best_saving = k, saving
        return best
