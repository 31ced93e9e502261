"""A vLLM KV connector that serves shared spans of a session's prompts with kvcmas's methods.

Load it with::

    --kv-transfer-config '{"kv_connector":"KvcmasConnector",
                           "kv_connector_module_path":"kvcmas.serve.connector",
                           "kv_role":"kv_both",
                           "kv_connector_extra_config":{"method":"kvcmas"}}'
    --middleware kvcmas.serve.http.KvcmasMiddleware   # HTTP 400, session salt, /kvcmas/stats

This class only translates vLLM's connector interface; the work is done by two sides that
import no vLLM:

* :class:`kvcmas.serve.scheduler_side.SchedulerSide` (in vLLM's scheduler): at admission of a
  request carrying ``kv_transfer_params={"kvcmas": {"session": ..., "agent": ...}}`` it decides
  the claim (:func:`kvcmas.serve.claims.plan_claim`: an exact run continuing a saved request,
  then the shared spans of the session worth a build); when the request finishes it indexes
  its tokens (prompt and output) as a source and keeps its blocks alive for the copy. Each
  step's orders reach the worker as :class:`kvcmas.serve.plans.StepOrders`.
* :class:`kvcmas.serve.worker_side.WorkerSide` (in vLLM's worker): copies saved requests' blocks
  into the span store (off the engine step), and fills claims before the forward: an exact run
  is copied, a range with spans is built by the method with kvcmas's own runtime, which holds
  a second copy of the weights in the worker (the model's size in its dtype: 0.5 GiB for
  SmolLM2-135M in fp32).

Everything else is plain vLLM.

Extra config (``kv_connector_extra_config``): ``method`` (one of ``CONNECTOR_METHODS``;
default ``exact``), ``method_config`` (the method's options, as ``kvcmas run`` takes them),
``min_span`` (default :data:`kvcmas.serve.claims.DEFAULT_MIN_SPAN`), ``background_saves``
(true: copy saves on a background thread; false: inside the engine step; default: on a thread
only where the KV caches are not on the CPU, whose cores vLLM's forward already uses),
``min_gain`` (pins the fixed cost rule of :class:`kvcmas.serve.claims.SpanRule`; by default
the claim is chosen from costs measured on this server: :mod:`kvcmas.serve.costs`),
``store_bytes`` (bound of
the span store, default 512 MiB), ``max_namespaces`` (method objects kept, one per namespace
and method, least recently used dropped; default 64), ``session_state_bytes`` (bound of each
method object's per-session values, such as KVCOMM's reference prefills and GraphFlow's bases,
kept for the sessions served most recently while many interleave; default 1 GiB). Env
``KVCMAS_STATS_FILE``: where the worker writes its counters as JSON (from startup on, with
the method, so a client can check what it serves). Anchor pools learn per namespace
(tenant): one method object per namespace, sharing nothing. A method runs with its serving
defaults (:mod:`kvcmas.serve.defaults`) under the options given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvcmas.serve.claims import DEFAULT_MIN_SPAN
from kvcmas.serve.costs import Feedback
from kvcmas.serve.defaults import serving_options
from kvcmas.serve.layout_check import check_layout_against_vllm
from kvcmas.serve.params import (
    CONNECTOR_METHODS,
    DEFAULT_MIN_GAIN,
    DEFAULT_NAMESPACES,
    DEFAULT_SESSION_STATE_BYTES,
    DEFAULT_STORE_BYTES,
    method_for,
)
from kvcmas.serve.plans import StepOrders
from kvcmas.serve.scheduler_side import MethodTraits, SchedulerOptions, SchedulerSide
from kvcmas.serve.worker_side import WorkerOptions, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvcmas.connector")  # under "vllm": printed by its handlers

# Only requests that ran to their end are saved (an aborted one's last step may be unwritten).
_SAVED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class KvcmasConnectorMetadata(KVConnectorMetadata):
    orders: StepOrders = field(default_factory=StepOrders)


@dataclass
class KvcmasWorkerMetadata(KVConnectorWorkerMetadata):
    """The worker's measurements for the scheduler's cost model, once a step."""

    feedback: Feedback = field(default_factory=Feedback)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvcmasWorkerMetadata):
            return self
        return KvcmasWorkerMetadata(self.feedback.merge(other.feedback))


def check_parallelism(tensor_parallel: int, pipeline_parallel: int) -> None:
    """Refuse at start-up what the worker cannot fill: under tensor parallelism each rank's
    cache holds a shard of the KV heads while kvcmas's runtime builds all of them, and under
    pipeline parallelism a rank holds only its layers; every build would fail and be
    recomputed. (Plain `vllm serve` can load the connector too: the check lives here.)"""
    if tensor_parallel > 1 or pipeline_parallel > 1:
        raise ValueError(
            f"KvcmasConnector: tensor parallel size {tensor_parallel} and pipeline parallel "
            f"size {pipeline_parallel} are not supported (each rank would hold part of the KV "
            "the connector builds whole): run one instance per device, with --instances N"
        )


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
        parallel = vllm_config.parallel_config
        check_parallelism(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
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
        method_options = serving_options(self.method, extra("method_config", None))
        if self.method != "exact":
            from kvcmas.methods import make_method

            make_method(method_for(self.method), method_options)  # fail at startup
        store_bytes = int(extra("store_bytes", DEFAULT_STORE_BYTES))
        # A pinned cost rule (min_gain) or, by default, claims chosen from measured costs. An
        # exact server loads no runtime to measure: per-request methods there keep the fixed
        # rule at its default.
        min_gain = extra("min_gain", None)
        if min_gain is None and self.method == "exact":
            min_gain = DEFAULT_MIN_GAIN
        min_gain = None if min_gain is None else float(min_gain)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            bytes_per_token = spec.page_size_bytes // spec.block_size * len(groups[0].layer_names)
            options = SchedulerOptions(
                self.block_size, bytes_per_token, self.method, store_bytes,
                int(extra("min_span", DEFAULT_MIN_SPAN)), min_gain,
            )  # fmt: skip
            self.scheduler = SchedulerSide(options, self._traits(method_options))
        else:
            model_config = vllm_config.model_config
            self.worker = WorkerSide(WorkerOptions(
                self.block_size, str(model_config.model), model_config.dtype, self.method,
                method_options, store_bytes,
                int(extra("max_namespaces", DEFAULT_NAMESPACES)),
                int(extra("session_state_bytes", DEFAULT_SESSION_STATE_BYTES)),
                extra("background_saves", None),
                measure_costs=min_gain is None,
            ))  # fmt: skip

    def _traits(self, method_options: dict[str, Any]):
        """A method's traits for the cost rule, from a method object made as the worker makes
        it: the server's method with its options, a per-request one with its defaults."""

        def of(name: str) -> MethodTraits:
            from kvcmas.methods import make_method

            options = method_options if name == self.method else serving_options(name, None)
            method = make_method(method_for(name), options)
            return MethodTraits(method.recomputed_tokens, method.learns_from_engine)

        return of

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(
            request, list(blocks.get_block_ids()[0]), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        tokens = scheduler_output.total_num_scheduled_tokens
        return KvcmasConnectorMetadata(self.scheduler.build_orders(tokens))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvcmasWorkerMetadata):
            self.scheduler.learn(meta.feedback)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(
            request, block_ids, request.status in _SAVED_STATUSES
        )

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
        model_dtype = self._vllm_config.model_config.dtype
        kv_dtype = self._vllm_config.cache_config.cache_dtype
        first = next(iter(kv_caches.values()))
        isa, packing = check_layout_against_vllm(first, model_dtype, kv_dtype)
        logger.info(
            "KvcmasConnector: paged layout checked against vLLM (isa=%s, packing=%s)",
            isa, packing,
        )  # fmt: skip
        self.worker.register(kv_caches, layer_order(kv_caches), packing)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.step_bound()  # the step's forward is timed from here

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        feedback = self.worker.take_feedback()
        return None if feedback is None else KvcmasWorkerMetadata(feedback)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvcmasConnectorMetadata):
            self.worker.apply(meta.orders)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.blocks_with_load_errors()

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
        return (self.worker.finished() or None), None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
