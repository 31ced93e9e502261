"""The connector's worker side: obeys the scheduler side's step orders against vLLM's paged
KV caches.

Drops free span-store memory, saves copy a finished request's blocks into the span store (on
a background thread: :mod:`kvcmas.serve.save_copier`), loads fill a claim before the forward
(an exact copy, or a range a method builds with kvcmas's own runtime on the same weights:
:func:`kvcmas.serve.range_builder.build_range`). It keeps the counters ``/kvcmas/stats``
shows. A load that fails is reported to vLLM, which recomputes those blocks. No vllm import
here: the thin connector checks vLLM's layout and hands over the caches.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcmas.methods.base import ReuseCounts, SegmentRecord
from kvcmas.model.cache import KVCache
from kvcmas.serve.costs import BuildSample, Calibration, CostModel, EdgeRecord, Feedback, fit_line
from kvcmas.serve.defaults import serving_options
from kvcmas.serve.method_states import MethodStates
from kvcmas.serve.paged_layout import read_span, write_span
from kvcmas.serve.params import (
    DEFAULT_NAMESPACES,
    DEFAULT_SESSION_STATE_BYTES,
    DEFAULT_STORE_BYTES,
    DUMP_DIR_ENV,
    STATS_FILE_ENV,
    method_for,
)
from kvcmas.serve.plans import LoadOrder, RangePlan, SaveOrder, SourceRef, StepOrders
from kvcmas.serve.range_builder import build_range, canonical
from kvcmas.serve.save_copier import SaveCopier
from kvcmas.serve.span_store import SpanStore

if TYPE_CHECKING:
    from kvcmas.methods.base import Method

logger = logging.getLogger("vllm.kvcmas.connector")  # under "vllm": printed by its handlers

_RECENT = 100  # entries kept in the stats' logs of recent injections and builds


@dataclass(frozen=True)
class WorkerOptions:
    block_size: int  # tokens per block of vLLM's cache
    model: str  # what kvcmas's runtime loads (vLLM's model path)
    dtype: torch.dtype
    method: str  # the server's method
    method_options: dict[str, Any]  # with its serving defaults
    store_bytes: int = DEFAULT_STORE_BYTES
    max_namespaces: int = DEFAULT_NAMESPACES
    session_state_bytes: int = DEFAULT_SESSION_STATE_BYTES
    # Copy saves on a background thread (True) or inside the engine step (False); None: on a
    # thread only where the caches are not on the CPU. On a CPU the thread shares the cores
    # vLLM's forward is bound to: at 512 tokens, sessions one at a time on 2 cores, it made
    # inter-token latency 1.16x plain vLLM's where in-step copies kept it 1.00x (RESULTS.md).
    background_saves: bool | None = None
    # Measure kvcmas's runtime at start-up and report costs to the scheduler (its claims are
    # chosen from them unless the operator pinned a fixed rule).
    measure_costs: bool = False

    def __post_init__(self) -> None:
        if self.session_state_bytes < 0:
            raise ValueError("KvcmasConnector: session_state_bytes must be >= 0, "
                             f"got {self.session_state_bytes}")  # fmt: skip
        if self.background_saves not in (True, False, None):  # JSON's; "false" must fail
            raise ValueError("KvcmasConnector: background_saves must be true, false or null, "
                             f"got {self.background_saves!r}")  # fmt: skip


def new_stats() -> dict[str, Any]:
    return {"saved_requests": 0, "saved_tokens": 0, "injected_requests": 0,
            "injected_tokens": 0, "dropped_requests": 0, "built_requests": 0,
            "span_tokens": 0, "served_tokens": 0, "computed_pairs": 0,
            "dense_pairs": 0, "load_errors": 0, "injections": [], "builds": [],
            "save_errors": 0,
            # Wall seconds of the worker's step spent here, before vLLM's forward (the batch
            # waits): saves (drops, and waiting for copies whose memory a drop frees), loads
            # (copies and builds), and building deferred anchors.
            "save_s": 0.0, "load_s": 0.0, "flush_s": 0.0,
            # The saves' copies, on the copier's thread (off the step where background_saves),
            # and the part of the step spent waiting for them (a load or drop of an entry
            # still being copied).
            "save_copy_s": 0.0, "save_wait_s": 0.0,
            # Within load_s: the builds alone (not the exact copies, nor the runtime's
            # one-time load at the first build, model_load_s).
            "build_s": 0.0, "model_load_s": 0.0,
            # Spans vLLM computed whose KV taught the method (KVCMAS: anchors).
            "engine_spans_learned": 0}  # fmt: skip


class WorkerSide:
    def __init__(self, options: WorkerOptions):
        self.options = options
        self.store = SpanStore(options.store_bytes)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layers: list[str] = []  # vLLM's attention layers in model order
        self.packing: str | None = None  # vLLM's block packing, checked at registration
        self._loaded = None  # kvcmas's runtime on the same weights, loaded on first use
        # Per (namespace, method): anchor pools never cross tenants; the least recently used
        # tenant's are dropped beyond max_namespaces objects.
        self._methods = MethodStates(self._make_method, options.max_namespaces)
        self._load_errors: set[int] = set()
        self._finished_saving: set[str] = set()  # released without a copy
        self._copier: SaveCopier | None = None  # made at registration (by the caches' device)
        self._stats_changed = False
        self.stats = new_stats()
        # Costs: what this worker measured since its last report to the scheduler, and its own
        # copy of the estimates for /kvcmas/stats.
        self._feedback = Feedback()
        self.costs = CostModel()
        self._step_started: float | None = None  # when vLLM bound this step's orders
        self._step_busy = 0.0  # seconds of the step spent here, not in vLLM's forward
        self._step_tokens = 0
        self._to_learn: list[SaveOrder] = []  # saves with spans vLLM computed, to learn from

    def register(self, kv_caches: dict[str, torch.Tensor], layers: list[str], packing: str):
        """vLLM's caches (one per attention layer; ``layers`` their names in model order) and
        the packing their blocks were checked to have."""
        self.kv_caches, self.layers, self.packing = dict(kv_caches), list(layers), packing
        background = self.options.background_saves
        if background is None:
            background = next(iter(kv_caches.values())).device.type != "cpu"
        self._copier = SaveCopier(background=background)
        if self.options.measure_costs:
            self._calibrate()
        self.write_stats()  # from startup on, /kvcmas/stats names the method

    def _calibrate(self) -> None:
        """A few seconds at start-up: kvcmas's runtime prefills two lengths (the slope is a
        recomputed token, the intercept a build's fixed part) and writes a range into a
        scratch copy of vLLM's cache layout. If it fails the server still starts, building
        nothing until measured (the scheduler leaves every span to vLLM)."""
        try:
            model = self._model()
            c = model.config
            first = self.kv_caches[self.layers[0]]
            lengths, samples = (32, 256), []
            for n in lengths * 2:  # the first round warms up; the fit takes the faster of two
                cache = KVCache(c.n_layers, c.n_kv_heads, c.head_dim, model.dtype, n,
                                device=first.device)  # fmt: skip
                clock = time.perf_counter()
                model.prefill(torch.arange(n) % 1000 + 10, cache)
                samples.append((n, time.perf_counter() - clock))
            best = [(n, min(s for m, s in samples if m == n)) for n in lengths]
            fixed, per_token = fit_line(best)
            n = 256
            blocks = -(-n // self.options.block_size)
            scratch = torch.zeros((blocks, *first.shape[1:]), dtype=first.dtype,
                                  device=first.device)  # fmt: skip
            k = torch.zeros((first.shape[1], n, first.shape[3] // 2), dtype=first.dtype)
            clock = time.perf_counter()
            for _ in self.layers:
                write_span(scratch, list(range(blocks)), 0, k, k, packing=self.packing)
            place = (time.perf_counter() - clock) / n
        except Exception:
            logger.exception("KvcmasConnector: cost calibration failed; every span is left "
                             "to vLLM until builds are measured")  # fmt: skip
            return
        calibration = Calibration(per_token, fixed, place)
        self._feedback.calibration = calibration
        self.costs.learn(Feedback(calibration=calibration))
        logger.info("KvcmasConnector: measured kvcmas's runtime: %.3f ms a recomputed token, "
                    "%.1f ms a build, %.4f ms a placed token", per_token * 1e3, fixed * 1e3,
                    place * 1e3)  # fmt: skip

    # ------------------------------------------------------------------ step timing

    def step_bound(self) -> None:
        """vLLM bound this step's orders: its forward runs between now and the report."""
        self._step_started, self._step_busy = time.perf_counter(), 0.0

    def take_feedback(self) -> Feedback | None:
        """What the scheduler should learn from this step (vLLM's worker -> scheduler
        metadata): the forward's seconds against its tokens, the builds, the calibration."""
        if self.options.measure_costs and self._step_started is not None and self._step_tokens:
            forward = time.perf_counter() - self._step_started - self._step_busy
            self._feedback.steps.append((self._step_tokens, forward))
        self._step_started, self._step_tokens = None, 0
        feedback, self._feedback = self._feedback, Feedback()
        if not feedback:
            return None
        self.costs.learn(Feedback(None, feedback.steps, feedback.builds, feedback.edges))
        return feedback

    # ------------------------------------------------------------------ one step

    def apply(self, orders: StepOrders) -> None:
        """Carry out a step's orders before vLLM's forward."""
        dropped = set(orders.drops)
        clock = began = time.perf_counter()
        self._step_tokens = orders.scheduled_tokens
        for key in orders.drops:
            self.store.drop(key)
            self.stats["dropped_requests"] += 1
        for order in orders.saves:
            if order.key in dropped:  # evicted in the step it was admitted: only release
                self._finished_saving.add(order.request_id)
                continue
            self._save(order)
        clock = self._spent("save_s", clock)
        for order in orders.loads:
            self._load_or_report(order)
        clock = self._spent("load_s", clock)
        for plan in orders.records:
            self._log_build(plan, [], None)
        if not orders.loads:
            # No claim to fill in this step: build the methods' deferred anchors now. This
            # delays the step's decode by the SVDs it runs (the serving counterpart of `kvcmas
            # run`'s idle time); under constant admissions a pool's next reader builds them.
            for method in self._methods.values():
                method.flush()
            self._spent("flush_s", clock)
        self._stats_changed |= bool(orders)
        self._step_busy += time.perf_counter() - began

    def finished(self) -> set[str]:
        """Requests whose blocks vLLM may take back (their copies are done, or none was
        needed); writes the stats file at most once a step."""
        began = time.perf_counter()
        done, self._finished_saving = self._finished_saving, set()
        copied = self._reap_saves()
        done |= copied
        if self._to_learn and copied:
            self._learn_from_engine(copied)
        if self._stats_changed:
            self.write_stats()
            self._stats_changed = False
        self._step_busy += time.perf_counter() - began
        return done

    def blocks_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()

    def _spent(self, key: str, since: float) -> float:
        """Add the wall seconds since ``since`` to the stats' ``key``; return the time now."""
        now = time.perf_counter()
        self.stats[key] += now - since
        return now

    # ------------------------------------------------------------------ saves

    def _save(self, order: SaveOrder) -> None:
        first = self.kv_caches[self.layers[0]]
        heads, head_dim = first.shape[1], first.shape[3] // 2
        # One tensor for all layers, each read straight into its place, so that a build
        # reads a source's spans as views instead of copying every layer; in the memory of a
        # dropped request where one fits.
        kv = self.store.new((len(self.layers), 2, heads, order.num_tokens, head_dim),
                            first.dtype, first.device)  # fmt: skip
        caches = [self.kv_caches[name] for name in self.layers]
        block_ids = torch.as_tensor(order.block_ids, dtype=torch.long)  # once, not per layer

        def copy() -> None:  # vLLM keeps the blocks until get_finished reports the request
            for i, cache in enumerate(caches):
                read_span(cache, block_ids, 0, order.num_tokens,
                          packing=self.packing, out=(kv[i, 0], kv[i, 1]))  # fmt: skip
            if order.dump:  # test hook: the KV as read back from vLLM's blocks, layers in order
                self._dump(order.request_id, kv)

        job = self._copier.submit(order.request_id, order.num_tokens, copy)
        self.store.put(order.key, kv, filling=job)
        if order.learn:
            self._to_learn.append(order)

    def _learn_from_engine(self, copied: set[str]) -> None:
        """Teach the methods from spans vLLM computed for saved requests whose copies are
        done (``copied``; on the engine's thread: method objects are not thread-safe); anchors
        are then built as deferred work. A request or source dropped meanwhile is skipped."""
        waiting = []
        for order in self._to_learn:
            if order.request_id not in copied:
                waiting.append(order)
                continue
            try:
                self._learn_from(order)
            except Exception:  # never stop the engine over what it could have learned
                logger.exception("KvcmasConnector: learning from request %s failed",
                                 order.request_id)  # fmt: skip
        self._to_learn = waiting

    def _learn_from(self, order: SaveOrder) -> None:
        if order.key not in self.store:
            return
        model = self._model()
        method = self._methods.get(order.namespace, order.method)
        for span in order.learn:
            if span.latest.key not in self.store:
                continue
            source = canonical(self.store.read, span.latest, span.length, model.inv_freq)
            here = SourceRef(order.key, span.start, order.agent)
            dense = canonical(self.store.read, here, span.length, model.inv_freq)
            method.learn_from_engine(span.slot, order.agent, source, dense)
            self.stats["engine_spans_learned"] += 1
            self._report_edge(method, order.namespace, span.slot, order.agent, span.length)

    def _report_edge(self, method, namespace, slot: str, agent: str, length: int) -> None:
        """Tell the scheduler what the method's next build of this edge will recompute."""
        predicted = method.predicted_recompute(slot, agent, length)
        self._feedback.edges.append(EdgeRecord((namespace, slot, agent), length, predicted))

    def _reap_saves(self) -> set[str]:
        """Account the copies done since the last step; returns their requests' ids (their
        blocks may go back to vLLM, copied or not)."""
        released = set()
        for job in self._copier.reap() if self._copier is not None else ():
            released.add(job.request_id)
            self.stats["save_copy_s"] += job.copy_s
            self.stats["save_wait_s"] += job.waited_s
            if job.error is not None:  # the store drops the entry at its next read or drop
                logger.error("KvcmasConnector: saving request %s failed: %r",
                             job.request_id, job.error)  # fmt: skip
                self.stats["save_errors"] += 1
                continue
            self.stats["saved_requests"] += 1
            self.stats["saved_tokens"] += job.num_tokens
        self._stats_changed |= bool(released)
        return released

    def _dump(self, request_id: str, kv: torch.Tensor) -> None:
        folder = os.environ.get(DUMP_DIR_ENV)
        if not folder:  # never stop the engine over a test hook
            logger.warning("test_dump for %s ignored: %s is not set", request_id, DUMP_DIR_ENV)
            return
        torch.save(kv, Path(folder) / f"{request_id}.pt")

    # ------------------------------------------------------------------ loads

    def _load_or_report(self, order: LoadOrder) -> None:
        """A failed load must not stop the engine: its blocks are reported, and vLLM
        recomputes them (``kv_load_failure_policy: recompute``), with the error logged."""
        try:
            self._load(order)
        except Exception:
            plan = order.plan
            logger.exception("KvcmasConnector: filling request %s failed; vLLM recomputes it",
                             plan.request_id)  # fmt: skip
            block_size = self.options.block_size
            first, last = plan.start // block_size, (plan.end - 1) // block_size
            self._load_errors.update(plan.block_ids[first : last + 1])
            self.stats["load_errors"] += 1

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
        self.stats["injected_requests"] += 1
        self.stats["injected_tokens"] += plan.end - plan.start
        self.stats["injections"].append({
            "request_id": plan.request_id, "source": plan.exact_key, "start": plan.start,
            "length": plan.end - plan.start, "spans": len(plan.spans),
            "noise_std": order.noise_std,
        })  # fmt: skip
        del self.stats["injections"][:-_RECENT]

    def _copy_exact(self, plan: RangePlan, noise_std: float) -> None:
        saved = self.store.get(plan.exact_key)
        generator = torch.Generator().manual_seed(0)
        for i, name in enumerate(self.layers):
            cache = self.kv_caches[name]
            kv = saved[i, :, :, plan.start : plan.end]
            if noise_std:
                noise = torch.randn(kv.shape, generator=generator).to(kv.device) * noise_std
                kv = (kv.float() + noise).to(kv.dtype)
            write_span(cache, plan.block_ids, plan.start, kv[0], kv[1], packing=self.packing)

    # ------------------------------------------------------------------ builds

    def new_method(self, name: str) -> Method:
        """A new method object: the server's method takes its configured options, a
        per-request one its defaults."""
        from kvcmas.methods import make_method

        if name == self.options.method:
            options = self.options.method_options
        else:
            options = serving_options(name, None)
        return make_method(method_for(name), options)

    def _make_method(self, name: str) -> Method:
        method = self.new_method(name)
        # Sessions interleave here: their per-session values must outlive other sessions' hops.
        method.session_state.max_bytes = self.options.session_state_bytes
        return method

    def _model(self):
        if self._loaded is None:
            from kvcmas.model.loader import load_model

            # On the device of vLLM's KV caches: the range is built next to the blocks it fills.
            device = next(iter(self.kv_caches.values())).device
            start = time.perf_counter()
            # vLLM's process: how its allocator keeps memory is the server's choice, not ours.
            self._loaded = load_model(self.options.model, self.options.dtype,
                                      device=str(device), keep_memory=False)  # fmt: skip
            self.stats["model_load_s"] += time.perf_counter() - start
            logger.info("KvcmasConnector: kvcmas runtime loaded %s in %s for %s",
                        self.options.model, self.options.dtype, self.options.method)
        return self._loaded.model

    def _build(self, plan: RangePlan) -> None:
        model = self._model()
        layers = [self.kv_caches[name] for name in self.layers]
        method = self._methods.get(plan.namespace, plan.method)
        start = time.perf_counter()
        records = build_range(plan, method, model, layers, self.store.read, self.packing)
        seconds = time.perf_counter() - start
        self._log_build(plan, records, seconds)
        self._measure_build(plan, records, seconds, model.config.n_layers)

    def _measure_build(
        self, plan: RangePlan, records: list[SegmentRecord], seconds: float, n_layers: int
    ) -> None:
        """Feed the cost model: the build's time against what it computed and placed, and
        per span edge how much of the span it recomputed."""
        in_spans = sum(r.computed_pairs for r in records if r.slot is not None) // n_layers
        private = (plan.end - plan.exact_end) - sum(s.length for s in plan.spans)
        placed = plan.end - plan.start
        self._feedback.builds.append(BuildSample(private + in_spans, placed, plan.start, seconds))
        method = self._methods.get(plan.namespace, plan.method)
        for r in records:
            if r.slot is not None and r.length:
                self._report_edge(method, plan.namespace, r.slot, plan.agent, r.length)

    def _log_build(
        self, plan: RangePlan, records: list[SegmentRecord], seconds: float | None
    ) -> None:
        """Count and log what the method built of ``plan`` (``records``) and the spans it left
        to vLLM; ``seconds`` None: nothing was built (every span was left to vLLM)."""
        n_layers = len(self.layers)  # vLLM's attention layers: the model's
        shared = [r for r in records if r.slot is not None] + [
            SegmentRecord(p.slot, p.kind, p.start, p.length, "dense", p.length * n_layers,
                          details={"computed_by": "engine"})
            for p in plan.engine_spans
        ]  # fmt: skip
        counts = ReuseCounts.of(shared, n_layers)  # the one definition of reuse
        s = self.stats
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
        })  # fmt: skip
        del s["builds"][:-_RECENT]

    # ------------------------------------------------------------------ stats

    def write_stats(self) -> None:
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
        o = self.options
        stats = dict(self.stats, method=o.method, method_config=o.method_options,
                     store_bytes=self.store.num_bytes, store_requests=len(self.store),
                     store_spare_bytes=self.store.spare_bytes,
                     reused_saves=self.store.reused_saves, method_state_bytes=pools,
                     namespaces=len({namespace for (namespace, _), _ in self._methods.items()}),
                     method_states_dropped=self._methods.dropped,
                     pools=reports,
                     costs=self.costs.snapshot() if o.measure_costs else None)  # fmt: skip
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, path)  # readers never see a half-written file
