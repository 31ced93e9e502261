"""A vLLM KV connector that serves shared spans of a session's prompts with kvcmas's methods.

Load it with::

    --kv-transfer-config '{"kv_connector":"KvcmasConnector",
                           "kv_connector_module_path":"kvcmas.serve.connector",
                           "kv_role":"kv_both",
                           "kv_connector_extra_config":{"method":"kvcmas"}}'
    --middleware kvcmas.serve.http.KvcmasMiddleware   # HTTP 400, session salt, /kvcmas/stats

Flow:

* A request carrying ``kv_transfer_params={"kvcmas": {"session": ..., "agent": ...}}`` is saved
  when it finishes: ``request_finished`` (scheduler) indexes its tokens (prompt and output) and
  keeps its blocks alive (returns ``True``); the next step's metadata tells the worker to copy
  the blocks' KV into the span store, which it does on a background thread while the engine
  runs on (:mod:`kvcmas.serve.save_copier`), and ``get_finished`` releases the blocks once the
  copy is done.
* At admission of a later request of the session, :func:`kvcmas.serve.claims.plan_claim`
  decides the claim: an exact run continuing a saved request, then (for every method but
  ``exact``) each span of the prompt that equals tokens of an earlier prompt or output of the
  session, up to the last such span (trailing spans the method would recompute whole are
  left to vLLM's forward: :mod:`kvcmas.serve.claims`).
* The worker fills the claim before the forward (``start_load_kv``): an exact run is copied; a
  range with spans is built by the method with kvcmas's own runtime on the same weights
  (:func:`kvcmas.serve.range_builder.build_range`), which holds a second copy of the weights
  in the worker (the model's size in its dtype: 0.5 GiB for SmolLM2-135M in fp32).
* Everything else is plain vLLM.

Extra config (``kv_connector_extra_config``): ``method`` (one of ``CONNECTOR_METHODS``;
default ``exact``), ``method_config`` (the method's options, as ``kvcmas run`` takes them),
``min_span`` (default :data:`kvcmas.serve.claims.DEFAULT_MIN_SPAN`), ``background_saves``
(default true; false copies each save inside the engine step), ``min_gain`` (the
cost rule of :class:`kvcmas.serve.claims.SpanRule`, default
:data:`kvcmas.serve.params.DEFAULT_MIN_GAIN`), ``store_bytes`` (bound of
the span store, default 512 MiB), ``max_namespaces`` (method objects kept, one per namespace
and method, least recently used dropped; default 64), ``session_state_bytes`` (bound of each
method object's per-session values, such as KVCOMM's reference prefills and GraphFlow's bases,
kept for the sessions served most recently while many interleave; default 1 GiB). Env
``KVCMAS_STATS_FILE``: where the worker writes its counters as JSON (from startup on, with
the method, so a client can check what it serves). Anchor pools learn per namespace
(tenant): one method object per namespace, sharing nothing.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvcmas.methods.base import ReuseCounts, SegmentRecord
from kvcmas.serve.claims import DEFAULT_MIN_SPAN, Claim, SpanRule, plan_claim
from kvcmas.serve.http import STATS_FILE_ENV
from kvcmas.serve.layout_check import check_layout_against_vllm
from kvcmas.serve.method_states import MethodStates
from kvcmas.serve.paged_layout import read_span, write_span
from kvcmas.serve.params import (
    CONNECTOR_METHODS,
    DEFAULT_MIN_GAIN,
    DEFAULT_NAMESPACES,
    DEFAULT_SESSION_STATE_BYTES,
    DEFAULT_STORE_BYTES,
    DUMP_DIR_ENV,
    KvcmasParams,
    KvcmasParamsError,
    method_for,
    parse_kvcmas_params,
)
from kvcmas.serve.range_builder import RangePlan, build_range
from kvcmas.serve.save_copier import SaveCopier
from kvcmas.serve.span_store import GRAM, SpanIndex, SpanStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvcmas.methods.base import Method

logger = init_logger("vllm.kvcmas.connector")  # under "vllm": printed by its handlers

# Only requests that ran to their end are saved (an aborted one's last step may be unwritten).
_SAVED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_RECENT = 100  # entries kept in the stats' logs of recent injections and builds


@dataclass
class SaveOrder:
    key: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    dump: bool = False  # test hook: also write the saved KV to $KVCMAS_DUMP_DIR


@dataclass
class LoadOrder:
    """Fill a claim: ``plan`` says what (an exact copy, or a range a method builds)."""

    plan: RangePlan
    noise_std: float = 0.0


@dataclass
class KvcmasConnectorMetadata(KVConnectorMetadata):
    # The worker applies them in this order: drops free memory before saves, and saves come
    # before loads so a request may read a source indexed in the same step.
    drops: list[str] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    # Claims that supply no tokens, only spans left to vLLM: logged as the requests' builds.
    records: list[RangePlan] = field(default_factory=list)


def session_key(params: KvcmasParams) -> str:
    """Sessions are scoped by namespace: two tenants using one session id never mix."""
    return json.dumps([params.namespace, params.session])


def layer_order(names) -> list[str]:
    """vLLM's attention layer names in model order (``model.layers.<i>.self_attn.attn``)."""

    def index(name: str) -> int:
        found = re.search(r"\.(\d+)\.", name)
        if found is None:
            raise ValueError(f"KvcmasConnector: no layer index in attention layer {name!r}")
        return int(found.group(1))

    return sorted(names, key=index)


class KvcmasConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ValueError(
                f"KvcmasConnector supports models with one KV cache group, got {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        self.block_size: int = spec.block_size
        extra = self._kv_transfer_config.get_from_extra_config
        self.method = str(extra("method", "exact"))
        if self.method not in CONNECTOR_METHODS:
            raise ValueError(
                f"KvcmasConnector: method {self.method!r} is not supported "
                f"(supported: {', '.join(CONNECTOR_METHODS)})"
            )
        self.method_options: dict[str, Any] = dict(extra("method_config", None) or {})
        if self.method != "exact":
            from kvcmas.methods import make_method

            make_method(method_for(self.method), self.method_options)  # fail at startup
        if role == KVConnectorRole.SCHEDULER:
            bytes_per_token = spec.page_size_bytes // spec.block_size * len(groups[0].layer_names)
            capacity = int(extra("store_bytes", DEFAULT_STORE_BYTES))
            self.min_span = int(extra("min_span", DEFAULT_MIN_SPAN))
            if self.min_span < GRAM:  # raised at startup, never in a scheduling step
                raise ValueError(f"KvcmasConnector: min_span must be >= {GRAM}, "
                                 f"got {self.min_span}")
            self.min_gain = float(extra("min_gain", DEFAULT_MIN_GAIN))
            if not self.min_gain >= 0:
                raise ValueError(f"KvcmasConnector: min_gain must be >= 0, got {self.min_gain}")
            self.index = SpanIndex(capacity, bytes_per_token)
            # Per method, which spans are worth a build (claims).
            self._span_rules: dict[str, SpanRule] = {}
            self._claims: dict[str, tuple[Claim, KvcmasParams]] = {}
            self._claimed: dict[str, Claim] = {}  # admitted claims, until the request ends
            self._pending = KvcmasConnectorMetadata()
            self._saves_ordered = 0
            # Sessions holding KV a method built: vLLM's prefix cache (salted per session) may
            # hand their later requests such blocks, which then are not exact (see _exact_cap).
            self._approximate_sessions: set[str] = set()
            self._exact_caps: dict[str, int] = {}  # request -> positions known exact
            self._admitted_now: set[str] = set()  # sessions admitted in this scheduling pass
            self._warned_unsalted = False
        else:
            self.store = SpanStore(int(extra("store_bytes", DEFAULT_STORE_BYTES)))
            self.kv_caches: dict[str, torch.Tensor] = {}
            self._layers: list[str] = []
            self._packing: str | None = None  # vLLM's block packing, checked at registration
            self._loaded = None  # kvcmas's runtime on the same weights, loaded on first use
            # Per (namespace, method): anchor pools never cross tenants; the least recently
            # used tenant's are dropped beyond max_namespaces objects.
            self._methods = MethodStates(
                self._make_method, int(extra("max_namespaces", DEFAULT_NAMESPACES))
            )
            self.session_state_bytes = int(
                extra("session_state_bytes", DEFAULT_SESSION_STATE_BYTES)
            )
            if self.session_state_bytes < 0:
                raise ValueError("KvcmasConnector: session_state_bytes must be >= 0, "
                                 f"got {self.session_state_bytes}")
            self._load_errors: set[int] = set()
            self._finished_saving: set[str] = set()  # released without a copy
            background = extra("background_saves", True)
            if not isinstance(background, bool):  # JSON's true/false; "false" must not pass
                raise ValueError("KvcmasConnector: background_saves must be true or false, "
                                 f"got {background!r}")
            self._copier = SaveCopier(background=background)
            self._stats_changed = False
            self._stats = {"saved_requests": 0, "saved_tokens": 0, "injected_requests": 0,
                           "injected_tokens": 0, "dropped_requests": 0, "built_requests": 0,
                           "span_tokens": 0, "served_tokens": 0, "computed_pairs": 0,
                           "dense_pairs": 0, "load_errors": 0, "injections": [], "builds": [],
                           "save_errors": 0,
                           # Wall seconds of the worker's step spent here, before vLLM's
                           # forward (the batch waits): saves (drops, and waiting for copies
                           # whose memory a drop frees), loads (copies and builds), and
                           # building deferred anchors.
                           "save_s": 0.0, "load_s": 0.0, "flush_s": 0.0,
                           # The saves' copies, on the copier's thread (off the step where
                           # background_saves), and the part of the step spent waiting for
                           # them (a load or drop of an entry still being copied).
                           "save_copy_s": 0.0, "save_wait_s": 0.0,
                           # Within load_s: the builds alone (not the exact copies, nor the
                           # runtime's one-time load at the first build, model_load_s).
                           "build_s": 0.0, "model_load_s": 0.0}

    # ---------------------------------------------------------------- scheduler side

    def _params(self, request: Request):
        try:
            return parse_kvcmas_params(request.kv_transfer_params)
        except KvcmasParamsError as err:
            # The HTTP middleware answers 400 first; raising here would stop the engine.
            logger.warning("request %s served as plain vLLM: %s", request.request_id, err)
            return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._params(request)
        if params is None:
            return 0, False
        if request.cache_salt is None and not self._warned_unsalted:
            # Loaded KV enters vLLM's prefix cache under the request's salt: approximate KV
            # must stay within its session, never reach another session or a plain request.
            logger.warning("kvcmas request without cache_salt: start the server with "
                           "--middleware kvcmas.serve.http.KvcmasMiddleware to salt by session")
            self._warned_unsalted = True
        method = params.method or self.method
        session = session_key(params)
        claim = plan_claim(
            self.index, session, request.prompt_token_ids, num_computed_tokens,
            with_spans=method != "exact", min_span=self.min_span, namespace=params.namespace,
            span_rule=None if method == "exact" else self._span_rule(method),
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

    def _span_rule(self, method: str) -> SpanRule:
        """Which spans are worth a build, by the method's recomputed tokens (the server's
        method with its options, another one with its defaults, as the worker makes them)."""
        if method not in self._span_rules:
            self._span_rules[method] = SpanRule(
                self._new_method(method).recomputed_tokens, self.min_gain
            )
        return self._span_rules[method]

    def _note_exact_cap(self, request: Request, session: str, num_computed: int) -> None:
        """In a session holding built KV, vLLM's own prefix hit is exact only as far as a
        saved request vouches for it; remember the cap for when this request is saved."""
        if session not in self._approximate_sessions or not num_computed:
            return
        vouched = self.index.longest_prefix(session, request.prompt_token_ids, exact_only=True)
        exact = vouched.length if vouched else 0
        if num_computed > exact:
            self._exact_caps[request.request_id] = exact

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pending = self._claims.pop(request.request_id, None)
        only_records = pending is not None and pending[0].length == 0
        if pending is None or (num_external_tokens == 0 and not only_records):
            self._claimed.pop(request.request_id, None)  # a readmission that claims nothing
            return
        claim, params = pending
        if num_external_tokens < claim.length:  # vLLM admitted only the claim's start
            claim = claim.cut(num_external_tokens)
        plan = RangePlan(
            request.request_id, session_key(params), params.agent, params.namespace,
            list(blocks.get_block_ids()[0]), claim.start, claim.end,
            list(request.prompt_token_ids[: claim.end]), claim.exact_key, claim.exact_end,
            list(claim.spans), params.method or self.method, list(claim.engine_spans),
        )  # fmt: skip
        self._claimed[request.request_id] = claim
        if only_records:
            self._pending.records.append(plan)
            return
        self._pending.loads.append(LoadOrder(plan, params.test_noise_std))
        if claim.spans:
            self._approximate_sessions.add(plan.session)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._pending = self._pending, KvcmasConnectorMetadata()
        self._admitted_now.clear()  # the end of a scheduling pass
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._claims.pop(request.request_id, None)
        params = self._params(request)
        if params is None:
            return False, None
        claim = self._claimed.pop(request.request_id, None)
        cap = self._exact_caps.pop(request.request_id, None)
        saved_tokens = self._order_save(request, params, block_ids, claim, cap)
        info = {"kvcmas": {
            "method": params.method or self.method,
            "claimed_tokens": claim.length if claim else 0,
            "span_tokens": claim.span_tokens if claim else 0,
            "engine_span_tokens": sum(p.length for p in claim.engine_spans) if claim else 0,
            "spans": len(claim.spans) if claim else 0,
            "saved_tokens": saved_tokens,
            "store_bytes": self.index.bytes_used,
            "store_requests": len(self.index),
            "saved_requests_total": self._saves_ordered,  # the worker's count catches up
        }}
        # True keeps the blocks alive until the worker has copied them (get_finished).
        return saved_tokens > 0, info

    def _order_save(
        self,
        request: Request,
        params: KvcmasParams,
        block_ids: list[int],
        claim: Claim | None,
        exact_cap: int | None,
    ) -> int:
        """Index the finished request as a source and order its copy; returns tokens saved."""
        # A request fed deliberately corrupted KV (test hook) must never become a source, nor
        # one that did not run to its end (its last step may not have written KV).
        if params.test_noise_std or request.status not in _SAVED_STATUSES:
            return 0
        # Tokens whose KV is in the blocks: all computed ones, minus any still in flight.
        num_tokens = min(
            request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0),
            len(request.all_token_ids),
            len(block_ids) * self.block_size,
        )
        if num_tokens <= 0:
            return 0
        tokens = request.all_token_ids[:num_tokens]
        covered = self.index.longest_prefix(session_key(params), tokens)
        if covered is not None and covered.length >= num_tokens:
            return 0  # an earlier source of the session already holds all of it
        # KV after the first span a method built is approximate (and so is everything that
        # attended to it): only the part before it may serve later exact claims.
        exact_upto = claim.exact_end if claim and claim.spans else num_tokens
        if exact_cap is not None:  # its prefix-cache hit may hold built KV (_note_exact_cap)
            exact_upto = min(exact_upto, exact_cap)
        admitted, evicted = self.index.add(
            request.request_id, session_key(params), params.agent, tokens,
            namespace=params.namespace, prompt_len=min(request.num_prompt_tokens, num_tokens),
            exact_upto=min(exact_upto, num_tokens),
        )  # fmt: skip
        self._pending.drops.extend(evicted)
        if not admitted:
            return 0  # larger than the whole store
        self._pending.saves.append(
            SaveOrder(request.request_id, request.request_id, list(block_ids), num_tokens,
                      params.test_dump))
        self._saves_ordered += 1
        return num_tokens

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
                raise ValueError(f"KvcmasConnector: layer {name} has no 4-d paged KV tensor")
            if cache.shape[2] != self.block_size:
                raise ValueError(
                    f"KvcmasConnector: layer {name} uses blocks of {cache.shape[2]} tokens but "
                    f"the scheduler's are {self.block_size}"
                )
        self.kv_caches = dict(kv_caches)
        self._layers = layer_order(kv_caches)
        model_dtype = self._vllm_config.model_config.dtype
        kv_dtype = self._vllm_config.cache_config.cache_dtype
        first = next(iter(self.kv_caches.values()))
        isa, self._packing = check_layout_against_vllm(first, model_dtype, kv_dtype)
        logger.info(
            "KvcmasConnector: paged layout checked against vLLM (isa=%s, packing=%s)",
            isa, self._packing,
        )  # fmt: skip
        self._write_stats()  # from startup on, /kvcmas/stats names the method

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcmasConnectorMetadata):
            return
        changed = bool(meta.drops or meta.saves or meta.loads or meta.records)
        dropped = set(meta.drops)
        clock = time.perf_counter()
        for key in meta.drops:
            self.store.drop(key)
            self._stats["dropped_requests"] += 1
        for order in meta.saves:
            if order.key in dropped:  # evicted in the step it was admitted: only release
                self._finished_saving.add(order.request_id)
                continue
            self._save(order)
        clock = self._spent("save_s", clock)
        for order in meta.loads:
            self._load_or_report(order)
        clock = self._spent("load_s", clock)
        for plan in meta.records:
            self._log_build(plan, [], None)
        if not meta.loads:
            # No claim to fill in this step: build the methods' deferred anchors now. This
            # delays the step's decode by the SVDs it runs (the serving counterpart of `kvcmas
            # run`'s idle time); under constant admissions a pool's next reader builds them.
            for method in self._methods.values():
                method.flush()
            self._spent("flush_s", clock)
        self._stats_changed |= changed

    def _spent(self, key: str, since: float) -> float:
        """Add the wall seconds since ``since`` to the stats' ``key``; return the time now."""
        now = time.perf_counter()
        self._stats[key] += now - since
        return now

    def _save(self, order: SaveOrder) -> None:
        first = self.kv_caches[self._layers[0]]
        heads, head_dim = first.shape[1], first.shape[3] // 2
        # One tensor for all layers, each read straight into its place, so that a build
        # reads a source's spans as views instead of copying every layer (measured at 2K:
        # 67 ms less per build); in the memory of a dropped request where one fits.
        kv = self.store.new((len(self._layers), 2, heads, order.num_tokens, head_dim),
                            first.dtype, first.device)  # fmt: skip
        caches = [self.kv_caches[name] for name in self._layers]
        block_ids = torch.as_tensor(order.block_ids, dtype=torch.long)  # once, not per layer

        def copy() -> None:  # vLLM keeps the blocks until get_finished reports the request
            for i, cache in enumerate(caches):
                read_span(cache, block_ids, 0, order.num_tokens,
                          packing=self._packing, out=(kv[i, 0], kv[i, 1]))  # fmt: skip
            if order.dump:  # test hook: the KV as read back from vLLM's blocks, layers in order
                self._dump(order.request_id, kv)

        job = self._copier.submit(order.request_id, order.num_tokens, copy)
        self.store.put(order.key, kv, filling=job)

    def _reap_saves(self) -> set[str]:
        """Account the copies done since the last step; returns their requests' ids (their
        blocks may go back to vLLM, copied or not)."""
        released = set()
        for job in self._copier.reap():
            released.add(job.request_id)
            self._stats["save_copy_s"] += job.copy_s
            self._stats["save_wait_s"] += job.waited_s
            if job.error is not None:  # the store drops the entry at its next read or drop
                logger.error("KvcmasConnector: saving request %s failed: %r",
                             job.request_id, job.error)
                self._stats["save_errors"] += 1
                continue
            self._stats["saved_requests"] += 1
            self._stats["saved_tokens"] += job.num_tokens
        self._stats_changed |= bool(released)
        return released

    def _dump(self, request_id: str, kv: torch.Tensor) -> None:
        folder = os.environ.get(DUMP_DIR_ENV)
        if not folder:  # never stop the engine over a test hook
            logger.warning("test_dump for %s ignored: %s is not set", request_id, DUMP_DIR_ENV)
            return
        torch.save(kv, Path(folder) / f"{request_id}.pt")

    def _load_or_report(self, order: LoadOrder) -> None:
        """A failed load must not stop the engine: its blocks are reported, and vLLM
        recomputes them (``kv_load_failure_policy: recompute``), with the error logged."""
        try:
            self._load(order)
        except Exception:
            plan = order.plan
            logger.exception("KvcmasConnector: filling request %s failed; vLLM recomputes it",
                             plan.request_id)
            first, last = plan.start // self.block_size, (plan.end - 1) // self.block_size
            self._load_errors.update(plan.block_ids[first : last + 1])
            self._stats["load_errors"] += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def _load(self, order: LoadOrder) -> None:
        if not self.kv_caches:
            raise RuntimeError("KvcmasConnector: asked to load KV before vLLM registered caches")
        plan = order.plan
        if plan.end > plan.exact_end:  # a method builds the rest (spans, text between them)
            self._build(plan)
        else:
            self._copy_exact(plan, order.noise_std)
            if plan.engine_spans:  # the spans after the exact run were left to vLLM
                self._log_build(plan, [], None)
        self._stats["injected_requests"] += 1
        self._stats["injected_tokens"] += plan.end - plan.start
        self._stats["injections"].append({
            "request_id": plan.request_id, "source": plan.exact_key, "start": plan.start,
            "length": plan.end - plan.start, "spans": len(plan.spans),
            "noise_std": order.noise_std,
        })
        del self._stats["injections"][:-_RECENT]

    def _copy_exact(self, plan: RangePlan, noise_std: float) -> None:
        saved = self.store.get(plan.exact_key)
        generator = torch.Generator().manual_seed(0)
        for i, name in enumerate(self._layers):
            cache = self.kv_caches[name]
            kv = saved[i, :, :, plan.start : plan.end]
            if noise_std:
                noise = torch.randn(kv.shape, generator=generator).to(kv.device) * noise_std
                kv = (kv.float() + noise).to(kv.dtype)
            write_span(cache, plan.block_ids, plan.start, kv[0], kv[1], packing=self._packing)

    def _new_method(self, name: str) -> Method:
        """A new method object: the server's method takes its configured options, a
        per-request one its defaults."""
        from kvcmas.methods import make_method

        options = self.method_options if name == self.method else {}
        return make_method(method_for(name), options)

    def _make_method(self, name: str) -> Method:
        method = self._new_method(name)
        # Sessions interleave here: their per-session values must outlive other sessions' hops.
        method.session_state.max_bytes = self.session_state_bytes
        return method

    def _model(self):
        if self._loaded is None:
            from kvcmas.model.loader import load_model

            config = self._vllm_config.model_config
            # On the device of vLLM's KV caches: the range is built next to the blocks it fills.
            device = next(iter(self.kv_caches.values())).device
            start = time.perf_counter()
            # vLLM's process: how its allocator keeps memory is the server's choice, not ours.
            self._loaded = load_model(str(config.model), config.dtype, device=str(device),
                                      keep_memory=False)
            self._stats["model_load_s"] += time.perf_counter() - start
            logger.info("KvcmasConnector: kvcmas runtime loaded %s in %s for %s",
                        config.model, config.dtype, self.method)
        return self._loaded.model

    def _build(self, plan: RangePlan) -> None:
        model = self._model()
        layers = [self.kv_caches[name] for name in self._layers]
        method = self._methods.get(plan.namespace, plan.method)
        start = time.perf_counter()
        records = build_range(plan, method, model, layers, self.store.read, self._packing)
        self._log_build(plan, records, time.perf_counter() - start)

    def _log_build(
        self, plan: RangePlan, records: list[SegmentRecord], seconds: float | None
    ) -> None:
        """Count and log what the method built of ``plan`` (``records``) and the spans it left
        to vLLM; ``seconds`` None: nothing was built (every span was left to vLLM)."""
        n_layers = len(self._layers)  # vLLM's attention layers: the model's
        shared = [r for r in records if r.slot is not None] + [
            SegmentRecord(p.slot, p.kind, p.start, p.length, "dense", p.length * n_layers,
                          details={"computed_by": "engine"})
            for p in plan.engine_spans
        ]  # fmt: skip
        counts = ReuseCounts.of(shared, n_layers)  # the one definition of reuse
        s = self._stats
        if seconds is not None:
            s["built_requests"] += 1
            s["build_s"] += seconds
        s["span_tokens"] += counts.shared_tokens
        s["served_tokens"] += counts.served_tokens
        s["computed_pairs"] += counts.computed_pairs
        s["dense_pairs"] += counts.dense_pairs
        spans = [{"slot": r.slot, "kind": r.kind, "start": r.start, "length": r.length,
                  "decision": r.decision,
                  "served_tokens": r.served_tokens, "computed_pairs": r.computed_pairs,
                  "entropy": r.entropy, "origin": p.origin.key, "latest": p.latest.key,
                  "computed_by": r.details.get("computed_by", "connector")}
                 for r, p in zip(shared, plan.spans + plan.engine_spans, strict=True)]
        s["builds"].append({
            "request_id": plan.request_id, "session": plan.session, "agent": plan.agent,
            "namespace": plan.namespace, "method": plan.method, "start": plan.start,
            "end": plan.end, "exact_end": plan.exact_end, "spans": spans,
            "seconds": None if seconds is None else round(seconds, 4),
        })
        del s["builds"][:-_RECENT]

    def _write_stats(self) -> None:
        path = os.environ.get(STATS_FILE_ENV)
        if not path:
            return
        pools = sum(m.memory_bytes() for m in self._methods.values())
        reports = {}  # per namespace and method: anchors, largest pool against V, bytes
        for (namespace, name), m in self._methods.items():  # methods exist once _loaded does
            config = self._loaded.config
            report = m.pool_report(config.n_layers, config.kv_width)
            if report is not None:
                reports[json.dumps([namespace, name])] = report
        stats = dict(self._stats, method=self.method, method_config=self.method_options,
                     store_bytes=self.store.num_bytes, store_requests=len(self.store),
                     store_spare_bytes=self.store.spare_bytes,
                     reused_saves=self.store.reused_saves, method_state_bytes=pools,
                     namespaces=len({namespace for (namespace, _), _ in self._methods.items()}),
                     method_states_dropped=self._methods.dropped,
                     pools=reports)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, path)  # readers never see a half-written file

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv before the forward

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saving happens once per request, from its held blocks, after it finishes

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_saving = self._finished_saving, set()
        done |= self._reap_saves()
        if self._stats_changed:  # at most once a step, after the forward
            self._write_stats()
            self._stats_changed = False
        return (done or None), None

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._copier.close()
