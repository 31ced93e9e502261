"""The connector's scheduler side: which tokens of a new prompt it claims, which finished
requests it saves, and the exactness bookkeeping that keeps approximate KV inside its session.

It runs inside vLLM's scheduler, where an exception stops the engine: malformed requests are
served as plain vLLM, never raised on. vLLM's request objects are read by duck typing (the
fields named in :class:`RequestView`), so the unit tests drive this class with small fakes.
No torch or vllm import here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvcmas.serve.claims import DEFAULT_MIN_SPAN, Claim, SpanRule, plan_claim
from kvcmas.serve.costs import CostModel, Feedback, SpanCost
from kvcmas.serve.params import (
    KvcmasParams,
    KvcmasParamsError,
    parse_kvcmas_params,
    salt_belongs_to,
    session_key,
)
from kvcmas.serve.plans import (
    EngineSpan,
    LoadOrder,
    RangePlan,
    SaveOrder,
    SpanPiece,
    StepOrders,
)
from kvcmas.serve.span_index import GRAM, SpanIndex

logger = logging.getLogger("vllm.kvcmas.connector")  # under "vllm": printed by its handlers


class RequestView(Protocol):
    """What the scheduler side reads of a vLLM request."""

    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: Any
    cache_salt: str | None
    num_computed_tokens: int
    all_token_ids: Sequence[int]
    num_prompt_tokens: int


@dataclass(frozen=True)
class MethodTraits:
    """What the cost rule needs to know of a method (made as the worker makes it)."""

    recomputed_tokens: Callable[[int], int]  # of a span, by length, whenever it is built
    learns_from_engine: bool = False  # an edge it has not learned is left to vLLM, which teaches it


@dataclass(frozen=True)
class SchedulerOptions:
    block_size: int
    bytes_per_token: int  # of the span store's copy, all layers
    method: str  # the server's method
    store_bytes: int
    min_span: int = DEFAULT_MIN_SPAN
    # None: the claim is chosen from measured costs (kvcmas.serve.costs); a number pins the
    # fixed rule of SpanRule (served tokens per recomputed token), as an operator may.
    min_gain: float | None = None

    def __post_init__(self) -> None:  # raised at startup, never in a scheduling step
        if self.min_span < GRAM:
            raise ValueError(f"KvcmasConnector: min_span must be >= {GRAM}, got {self.min_span}")
        if self.min_gain is not None and not self.min_gain >= 0:
            raise ValueError(f"KvcmasConnector: min_gain must be >= 0, got {self.min_gain}")


class SchedulerSide:
    def __init__(self, options: SchedulerOptions, traits: Callable[[str], MethodTraits]):
        """``traits(method)``: that method's traits for the cost rule (the server's method
        with its options, another with its serving defaults, as the worker makes them)."""
        self.options = options
        self._traits_of = traits
        self._traits: dict[str, MethodTraits] = {}
        self.index = SpanIndex(options.store_bytes, options.bytes_per_token)
        self._span_rules: dict[str, SpanRule] = {}  # per method: which spans are worth a build
        self._claims: dict[str, tuple[Claim, KvcmasParams]] = {}  # planned, not yet admitted
        self._claimed: dict[str, Claim] = {}  # admitted claims, until the request ends
        self._pending = StepOrders()
        self.saves_ordered = 0
        # Sessions holding KV a method built: vLLM's prefix cache (salted per session) may
        # hand their later requests such blocks, which then are not exact (see _note_exact_cap).
        self._approximate_sessions: set[str] = set()
        self._exact_caps: dict[str, int] = {}  # request -> positions known exact
        self._admitted_now: set[str] = set()  # sessions admitted in this scheduling pass
        # Requests whose salt is not their own session's: exact-only, never saved.
        self._unsalted: set[str] = set()
        self._warned_unsalted = False
        self.costs = CostModel()  # measured by the worker, used where min_gain is not pinned

    def learn(self, feedback: Feedback) -> None:
        """The worker's latest measurements (step times, builds, calibration)."""
        self.costs.learn(feedback)

    # ------------------------------------------------------------------ requests

    def params(self, request: RequestView) -> KvcmasParams | None:
        try:
            return parse_kvcmas_params(request.kv_transfer_params)
        except KvcmasParamsError as err:
            # The HTTP middleware answers 400 first; raising here would stop the engine.
            logger.warning("request %s served as plain vLLM: %s", request.request_id, err)
            return None

    def _salted_for(self, request: RequestView, params: KvcmasParams) -> bool:
        """Fail closed: KV a method built enters vLLM's prefix cache under the request's salt,
        so only a request salted for its own (namespace, session) may read or write it."""
        if salt_belongs_to(request.cache_salt, params):
            return True
        if not self._warned_unsalted:
            logger.warning(
                "kvcmas request %s without its session's cache_salt: served exact-only. Start "
                "the server with --middleware kvcmas.serve.http.KvcmasMiddleware to salt by "
                "session", request.request_id)  # fmt: skip
            self._warned_unsalted = True
        return False

    def num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = self.params(request)
        if params is None:
            return 0, False
        salted = self._salted_for(request, params)
        if not salted:
            self._unsalted.add(request.request_id)
        method = (params.method or self.options.method) if salted else "exact"
        session = session_key(params)
        pinned = self.options.min_gain is not None
        claim = plan_claim(
            self.index, session, request.prompt_token_ids, num_computed_tokens,
            with_spans=method != "exact", min_span=self.options.min_span,
            namespace=params.namespace,
            span_rule=self._span_rule(method) if method != "exact" else None,
            keep_spans=None if pinned or method == "exact" else self._keep_spans(
                num_computed_tokens, params, method),
        )  # fmt: skip
        if claim is not None and claim.spans and num_computed_tokens and (
            session in self._admitted_now
        ):
            # Another request of the session was admitted in this pass: vLLM may have handed
            # this one blocks that request computes only in this step's forward, after the
            # worker would read them as context. Ask again next step.
            return None, False
        self._admitted_now.add(session)
        self._note_exact_cap(request, session, num_computed_tokens)
        if claim is None:
            self._claims.pop(request.request_id, None)
            return 0, False
        self._claims[request.request_id] = (claim, params)
        return claim.length, False

    def traits(self, method: str) -> MethodTraits:
        if method not in self._traits:
            self._traits[method] = self._traits_of(method)
        return self._traits[method]

    def _span_rule(self, method: str) -> SpanRule:
        """The fixed rule: pinned by min_gain; otherwise only spans the method recomputes
        whole are left to vLLM by it (the same dense work, batched better in the engine)."""
        if method not in self._span_rules:
            self._span_rules[method] = SpanRule(
                self.traits(method).recomputed_tokens, self.options.min_gain or 0.0
            )
        return self._span_rules[method]

    def _keep_spans(self, start: int, params: KvcmasParams, method: str):
        """How many of a claim's spans to build: the count whose predicted critical path is
        shortest (the engine's measured cost of the tokens against the build's). A span of an
        edge the worker has not reported on is predicted by the method's rule, or dense for a
        method that learns from the engine (leaving it to vLLM teaches the method)."""
        traits = self.traits(method)

        def predicted(span: SpanPiece) -> int:
            cold = span.length if traits.learns_from_engine else min(
                span.length, traits.recomputed_tokens(span.length))  # fmt: skip
            edge = (params.namespace, span.slot, params.agent)
            return self.costs.predicted_recompute(edge, span.length, cold)

        def keep(exact_end: int, spans: list[SpanPiece]) -> int:
            costs = [SpanCost(s.start, s.length, predicted(s)) for s in spans]
            return self.costs.best_span_count(start, exact_end, costs)

        return keep

    def _note_exact_cap(self, request: RequestView, session: str, num_computed: int) -> None:
        """In a session holding built KV, vLLM's own prefix hit is exact only as far as a
        saved request vouches for it; remember the cap for when this request is saved."""
        if session not in self._approximate_sessions or not num_computed:
            return
        vouched = self.index.longest_prefix(session, request.prompt_token_ids, exact_only=True)
        exact = vouched.length if vouched else 0
        if num_computed > exact:
            self._exact_caps[request.request_id] = exact

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pending = self._claims.pop(request.request_id, None)
        only_records = pending is not None and pending[0].length == 0
        if pending is None or (num_external_tokens == 0 and not only_records):
            self._claimed.pop(request.request_id, None)  # a readmission that claims nothing
            return
        claim, params = pending
        if num_external_tokens < claim.length:  # vLLM admitted only the claim's start
            claim = claim.cut(num_external_tokens)
        method = "exact" if request.request_id in self._unsalted else (
            params.method or self.options.method)  # fmt: skip
        plan = RangePlan(
            request.request_id, session_key(params), params.agent, params.namespace,
            list(block_ids), claim.start, claim.end,
            list(request.prompt_token_ids[: claim.end]), claim.exact_key, claim.exact_end,
            list(claim.spans), method, list(claim.engine_spans),
        )  # fmt: skip
        self._claimed[request.request_id] = claim
        if only_records:
            self._pending.records.append(plan)
            return
        self._pending.loads.append(LoadOrder(plan, params.test_noise_std))
        if claim.spans:
            self._approximate_sessions.add(plan.session)

    def build_orders(self, scheduled_tokens: int = 0) -> StepOrders:
        """This step's orders to the worker (``scheduled_tokens``: what vLLM computes in the
        step's forward); the end of a scheduling pass."""
        orders, self._pending = self._pending, StepOrders()
        orders.scheduled_tokens = scheduled_tokens
        self._admitted_now.clear()
        return orders

    def request_finished(
        self, request: RequestView, block_ids: list[int], ran_to_end: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """Save a finished request (``ran_to_end``: stopped or length-capped; an aborted one's
        last step may be unwritten); returns whether its blocks must be kept for the copy, and
        the info returned to the client with the response."""
        self._claims.pop(request.request_id, None)
        unsalted = request.request_id in self._unsalted
        self._unsalted.discard(request.request_id)
        params = self.params(request)
        if params is None:
            return False, None
        claim = self._claimed.pop(request.request_id, None)
        cap = self._exact_caps.pop(request.request_id, None)
        saved_tokens = 0
        if ran_to_end and not unsalted:  # its prefix hit may hold a foreign salt's blocks
            saved_tokens = self._order_save(request, params, block_ids, claim, cap)
        info = {"kvcmas": {
            "method": "exact" if unsalted else (params.method or self.options.method),
            "claimed_tokens": claim.length if claim else 0,
            "span_tokens": claim.span_tokens if claim else 0,
            "engine_span_tokens": sum(p.length for p in claim.engine_spans) if claim else 0,
            "spans": len(claim.spans) if claim else 0,
            "saved_tokens": saved_tokens,
            "store_bytes": self.index.bytes_used,
            "store_requests": len(self.index),
            "saved_requests_total": self.saves_ordered,  # the worker's count catches up
        }}
        # True keeps the blocks alive until the worker has copied them (get_finished).
        return saved_tokens > 0, info

    def _order_save(
        self,
        request: RequestView,
        params: KvcmasParams,
        block_ids: list[int],
        claim: Claim | None,
        exact_cap: int | None,
    ) -> int:
        """Index the finished request as a source and order its copy; returns tokens saved."""
        # A request fed deliberately corrupted KV (test hook) must never become a source.
        if params.test_noise_std:
            return 0
        # Tokens whose KV is in the blocks: all computed ones, minus any still in flight.
        num_tokens = min(
            request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0),
            len(request.all_token_ids),
            len(block_ids) * self.options.block_size,
        )
        if num_tokens <= 0:
            return 0
        tokens = request.all_token_ids[:num_tokens]
        session = session_key(params)
        covered = self.index.longest_prefix(session, tokens)
        if covered is not None and covered.length >= num_tokens:
            return 0  # an earlier source of the session already holds all of it
        if request.request_id in self.index:
            # vLLM's request-id randomization is off and a client reused an id: keep the
            # first source (raising here would stop the engine).
            logger.warning("request id %s saved already: not saved again", request.request_id)
            return 0
        # KV after the first span a method built is approximate (and so is everything that
        # attended to it): only the part before it may serve later exact claims.
        exact_upto = claim.exact_end if claim and claim.spans else num_tokens
        if exact_cap is not None:  # its prefix-cache hit may hold built KV (_note_exact_cap)
            exact_upto = min(exact_upto, exact_cap)
        admitted, evicted = self.index.add(
            request.request_id, session, params.agent, tokens,
            namespace=params.namespace, prompt_len=min(request.num_prompt_tokens, num_tokens),
            exact_upto=min(exact_upto, num_tokens),
        )  # fmt: skip
        self._pending.drops.extend(evicted)
        if not admitted:
            return 0  # larger than the whole store
        method = params.method or self.options.method
        learns = method != "exact" and self.traits(method).learns_from_engine
        learn = [EngineSpan(s.start, s.length, s.slot, s.latest)
                 for s in (claim.engine_spans if claim and learns else ())
                 if s.start + s.length <= num_tokens and s.latest.key in self.index]
        self._pending.saves.append(SaveOrder(
            request.request_id, request.request_id, list(block_ids), num_tokens,
            params.test_dump, learn, method, params.namespace, params.agent))  # fmt: skip
        self.saves_ordered += 1
        return num_tokens
