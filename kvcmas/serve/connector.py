"""A vLLM KV connector that re-injects the exact saved KV of earlier requests of a session.

Load it with::

    --kv-transfer-config '{"kv_connector":"KvcmasConnector",
                           "kv_connector_module_path":"kvcmas.serve.connector",
                           "kv_role":"kv_both"}'
    --middleware kvcmas.serve.http.KvcmasMiddleware   # HTTP 400, session salt, /kvcmas/stats

Flow (this spike's "exact source" behaviour):

* A request carrying ``kv_transfer_params={"kvcmas": {"session": ..., "agent": ...}}`` is saved
  when it finishes: ``request_finished`` (scheduler) indexes its tokens and keeps its blocks
  alive (returns ``True``); the next step's metadata tells the worker to copy the blocks'
  KV into the span store, and ``get_finished`` then releases the blocks.
* A later request of the same session whose prompt shares a prefix with a saved request, beyond
  vLLM's locally computed prefix, has that run claimed in ``get_num_new_matched_tokens`` and
  written into its blocks by the worker before the forward (``start_load_kv``). A shared prefix
  makes the saved KV exact: the KV of token ``p`` depends only on tokens ``0..p``.
* Everything else is plain vLLM.

Extra config (``kv_connector_extra_config``): ``store_bytes`` (bound of the span store,
default 512 MiB), ``method`` (one of ``CONNECTOR_METHODS``; default ``exact``). Env
``KVCMAS_STATS_FILE``: where the worker writes its counters as JSON (from startup on, with the
method, so a client can check what the server does).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvcmas.serve.http import STATS_FILE_ENV
from kvcmas.serve.layout_check import check_layout_against_vllm
from kvcmas.serve.paged_layout import read_span, write_span
from kvcmas.serve.params import (
    CONNECTOR_METHODS,
    KvcmasParams,
    KvcmasParamsError,
    parse_kvcmas_params,
)
from kvcmas.serve.span_store import SpanIndex, SpanStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.kvcmas.connector")  # under "vllm": printed by its handlers

DEFAULT_STORE_BYTES = 512 << 20
# Only requests that ran to their end are saved (an aborted one's last step may be unwritten).
_SAVED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class SaveOrder:
    key: str
    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class LoadOrder:
    request_id: str
    key: str
    block_ids: list[int]
    start: int
    length: int
    noise_std: float = 0.0


@dataclass
class KvcmasConnectorMetadata(KVConnectorMetadata):
    # The worker applies them in this order: drops free memory before saves, and saves come
    # before loads so a request may read a source indexed in the same step.
    drops: list[str] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)


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
        self.method = str(self._kv_transfer_config.get_from_extra_config("method", "exact"))
        if self.method not in CONNECTOR_METHODS:
            raise ValueError(
                f"KvcmasConnector: method {self.method!r} is not supported "
                f"(supported: {', '.join(CONNECTOR_METHODS)})"
            )
        if role == KVConnectorRole.SCHEDULER:
            bytes_per_token = spec.page_size_bytes // spec.block_size * len(groups[0].layer_names)
            capacity = int(self._kv_transfer_config.get_from_extra_config(
                "store_bytes", DEFAULT_STORE_BYTES))
            self.index = SpanIndex(capacity, bytes_per_token)
            self._claims: dict[str, tuple[str, int, int, float]] = {}  # req -> key, start, len
            self._claimed_tokens: dict[str, int] = {}
            self._pending = KvcmasConnectorMetadata()
            self._saves_ordered = 0
            self._warned_unsalted = False
        else:
            self.store = SpanStore()
            self.kv_caches: dict[str, torch.Tensor] = {}
            self._finished_saving: set[str] = set()
            self._stats = {"saved_requests": 0, "saved_tokens": 0, "injected_requests": 0,
                           "injected_tokens": 0, "dropped_requests": 0, "injections": []}

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
            # Loaded KV enters vLLM's prefix cache under the request's salt. Exact KV is
            # harmless there, but approximate KV (the full connector) must stay per session.
            logger.warning("kvcmas request without cache_salt: start the server with "
                           "--middleware kvcmas.serve.http.KvcmasMiddleware to salt by session")
            self._warned_unsalted = True
        match = self.index.longest_prefix(params.session, request.prompt_token_ids)
        if match is None:
            return 0, False
        # vLLM must compute at least the last prompt token itself, to sample from its logits.
        usable = min(match.length, request.num_prompt_tokens - 1)
        claim = usable - num_computed_tokens
        if claim <= 0:
            return 0, False
        self._claims[request.request_id] = (
            match.key, num_computed_tokens, claim, params.test_noise_std)
        return claim, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        claim = self._claims.pop(request.request_id, None)
        if num_external_tokens == 0 or claim is None:
            return
        key, start, length, noise = claim
        length = min(length, num_external_tokens)
        self._pending.loads.append(LoadOrder(
            request.request_id, key, list(blocks.get_block_ids()[0]), start, length, noise))
        self._claimed_tokens[request.request_id] = length

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._pending = self._pending, KvcmasConnectorMetadata()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._claims.pop(request.request_id, None)
        params = self._params(request)
        if params is None:
            return False, None
        claimed = self._claimed_tokens.pop(request.request_id, 0)
        saved_tokens = self._order_save(request, params, block_ids)
        info = {"kvcmas": {
            "method": self.method,
            "claimed_tokens": claimed,
            "saved_tokens": saved_tokens,
            "store_bytes": self.index.bytes_used,
            "store_requests": len(self.index),
            "saved_requests_total": self._saves_ordered,  # the worker's count catches up
        }}
        # True keeps the blocks alive until the worker has copied them (get_finished).
        return saved_tokens > 0, info

    def _order_save(self, request: Request, params: KvcmasParams, block_ids: list[int]) -> int:
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
        covered = self.index.longest_prefix(params.session, tokens)
        if covered is not None and covered.length >= num_tokens:
            return 0  # an earlier source of the session already holds all of it
        admitted, evicted = self.index.add(request.request_id, params.session, params.agent, tokens)
        self._pending.drops.extend(evicted)
        if not admitted:
            return 0  # larger than the whole store
        self._pending.saves.append(
            SaveOrder(request.request_id, request.request_id, list(block_ids), num_tokens))
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
        model_dtype = self._vllm_config.model_config.dtype
        kv_dtype = self._vllm_config.cache_config.cache_dtype
        isa = check_layout_against_vllm(next(iter(self.kv_caches.values())), model_dtype, kv_dtype)
        logger.info("KvcmasConnector: paged layout checked against vLLM (isa=%s)", isa)
        self._write_stats()  # from startup on, /kvcmas/stats names the method

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcmasConnectorMetadata):
            return
        changed = bool(meta.drops or meta.saves or meta.loads)
        for key in meta.drops:
            self.store.drop(key)
            self._stats["dropped_requests"] += 1
        for order in meta.saves:
            self._save(order)
        for order in meta.loads:
            self._load(order)
        if changed:
            self._write_stats()

    def _save(self, order: SaveOrder) -> None:
        layers = {}
        for name, cache in self.kv_caches.items():
            k, v = read_span(cache, order.block_ids, 0, order.num_tokens)
            layers[name] = torch.stack((k, v))
        self.store.put(order.key, layers)
        self._finished_saving.add(order.request_id)
        self._stats["saved_requests"] += 1
        self._stats["saved_tokens"] += order.num_tokens

    def _load(self, order: LoadOrder) -> None:
        if not self.kv_caches:
            raise RuntimeError("KvcmasConnector: asked to load KV before vLLM registered caches")
        saved = self.store.get(order.key)
        end = order.start + order.length
        generator = torch.Generator().manual_seed(0)
        for name, cache in self.kv_caches.items():
            kv = saved[name][:, :, order.start:end]
            if order.noise_std:
                noise = torch.randn(kv.shape, generator=generator) * order.noise_std
                kv = (kv.float() + noise).to(kv.dtype)
            write_span(cache, order.block_ids, order.start, kv[0], kv[1])
        self._stats["injected_requests"] += 1
        self._stats["injected_tokens"] += order.length
        self._stats["injections"].append({
            "request_id": order.request_id, "source": order.key,
            "start": order.start, "length": order.length, "noise_std": order.noise_std,
        })
        del self._stats["injections"][:-100]  # a bounded log of the latest injections

    def _write_stats(self) -> None:
        path = os.environ.get(STATS_FILE_ENV)
        if not path:
            return
        stats = dict(self._stats, method=self.method, store_bytes=self.store.num_bytes,
                     store_requests=len(self.store))
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
        return (done or None), None
