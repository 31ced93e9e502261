"""Run requests through a workflow with one reuse method, hop by hop.

Data flows one way: the runner renders each agent's segments, asks the method to build the
hop's context KV on top of the agent's cached system prefix, decodes greedily, and hands the
output (as generated token ids and their exact decode-time KV) to the agents that read it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcmas.chat import render_segments, tokenize
from kvcmas.errors import WorkflowError
from kvcmas.kv.segment import SegmentKV
from kvcmas.methods.base import Hop, HopBuild, Method, ReuseCounts, SharedSegment
from kvcmas.model.cache import KVCache
from kvcmas.model.generate import greedy_decode, stop_ids
from kvcmas.model.loader import LoadedModel
from kvcmas.model.transformer import Transformer
from kvcmas.workflow.records import HopResult, RequestResult, peak_rss_bytes
from kvcmas.workflow.spec import Workflow


class PrefixCache:
    """Exact KV of each agent's leading private segment, computed once (METHOD.md 2, rule 2)."""

    def __init__(self) -> None:
        self._caches: dict[tuple[int, ...], KVCache] = {}

    def get(self, model, tokens: tuple[int, ...]) -> KVCache:
        if tokens not in self._caches:
            cache = model.new_cache(capacity=len(tokens))
            model.prefill(list(tokens), cache)
            self._caches[tokens] = cache
        return self._caches[tokens]

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self._caches.values())


def publish_sources(hop: Hop, build, model) -> None:
    """After a hop, its cache of each shared segment becomes that segment's latest source."""
    for rec in build.records:
        if rec.slot is not None:
            end = rec.start + rec.length
            kv = SegmentKV.from_cache(build.cache, rec.start, end, model.inv_freq)
            hop.shared[rec.slot].record(hop.agent, kv)


@dataclass
class HopView:
    """What a hop observer sees (for fidelity measurement, :mod:`kvcmas.eval.fidelity`)."""

    hop: Hop
    build: HopBuild  # build.cache holds the hop's prompt
    model: Transformer  # the method's model
    first_logits: torch.Tensor
    output_ids: list[int]
    max_new_tokens: int
    stop: set[int]


HopObserver = Callable[[HopView], dict[str, Any]]


class Runner:
    """Runs a stream of requests; method state (anchor pools) persists across requests.

    Each :meth:`run` is its own session: method state scoped to a request (reference prefills,
    saved hidden states) is keyed by that session and by content, never by a stream position.
    A request may name its session (``"session"``) to share that scope on purpose. An optional
    ``observer`` measures every hop (fidelity) off the clock.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        workflow: Workflow,
        method: Method,
        observer: HopObserver | None = None,
    ):
        self.loaded = loaded
        self.workflow = workflow
        self.method = method
        self.observer = observer
        self.stop = stop_ids(loaded)
        self.prefixes = PrefixCache()
        self._check_reply_prefixes()
        tok = loaded.tokenizer
        self._reply_prefixes = {a.name: tokenize(tok, a.reply_prefix) for a in workflow.agents}
        self._warm_prefixes()

    def _check_reply_prefixes(self) -> None:
        """Methods that save decode-time hidden states (DroidSpeak, RelayCaching) hold them
        for generated tokens only; a read reply with a prefix would lose them silently."""
        if not self.method.needs_hidden_states:
            return
        read = {s for a in self.workflow.agents for s in a.slots}
        for agent in self.workflow.agents:
            if agent.reply_prefix and agent.name in read:
                raise WorkflowError(
                    f"agent {agent.name!r}: {self.method.name} cannot reuse a reply that opens "
                    "with reply_prefix; give the prefix only to agents no one reads"
                )

    def _warm_prefixes(self) -> None:
        """Build every agent's system-prefix cache before any request: shared by all methods."""
        dummy = {s: (0,) for a in self.workflow.agents for s in a.slots}
        for agent in self.workflow.agents:
            prefix = self._segments(agent, dummy)[0].tokens
            self.prefixes.get(self.loaded.model, prefix)

    def _segments(self, agent, slot_tokens):
        reply_prefix = self._reply_prefixes[agent.name]
        segs = render_segments(
            self.loaded.tokenizer, agent.system, agent.prompt, slot_tokens, reply_prefix
        )
        if segs[0].shared:
            raise WorkflowError(f"agent {agent.name!r}: the prompt must not start with a slot")
        return segs

    def _request_inputs(self, request: dict) -> dict[str, SharedSegment]:
        self.workflow.check_request(request)
        shared = {}
        for slot in self.workflow.inputs():
            tokens = tokenize(self.loaded.tokenizer, request[slot].strip())
            shared[slot] = SharedSegment(slot, self.workflow.slot_kind(slot), tokens)
        return shared

    def run(self, request: dict, forced_outputs: dict[str, list[int]] | None = None
            ) -> RequestResult:
        """Run one request through every agent; then finish the method's deferred work.

        ``forced_outputs`` (agent -> token ids) replays replies produced elsewhere (a serving
        engine's) instead of decoding them, so both build every later hop from the same tokens.
        """
        session = str(request.get("session") or uuid.uuid4().hex)
        cpu0, start = time.process_time(), time.perf_counter()
        shared = self._request_inputs(request)
        hops = []
        for step, name in enumerate(self.workflow.order):
            forced = (forced_outputs or {}).get(name)
            hops.append(self._run_hop(self.workflow.agent(name), shared, session, step, forced))
        # The observer (fidelity measurement) is not the request's work: off the clock.
        observed_s = sum(h.fidelity["observer_s"] for h in hops if h.fidelity)
        latency = time.perf_counter() - start - observed_s
        background = self.method.flush()  # idle time after the request's answer
        final = next(h for h in hops if h.agent == self.workflow.final).output
        rid = str(request.get("id", session))
        return RequestResult(
            rid,
            self.method.name,
            final,
            hops,
            latency_s=latency,
            background_s=background,
            cpu_s=time.process_time() - cpu0 - sum(
                h.fidelity["observer_cpu_s"] for h in hops if h.fidelity
            ),
        )

    def run_stream(self, requests: Iterable[dict], progress=None) -> Iterator[RequestResult]:
        for i, request in enumerate(requests):
            result = self.run({"id": str(i), **request})  # a display id, never a state key
            if progress:
                progress(i, result)
            yield result

    def _run_hop(self, agent, shared: dict[str, SharedSegment], session: str, step: int,
                 forced: list[int] | None = None):
        model = self.loaded.model
        segments = self._segments(agent, {k: v.tokens for k, v in shared.items()})
        hop = Hop(agent.name, session, step, segments, shared)
        prompt = hop.tokens
        if len(prompt) + agent.max_new_tokens > model.config.max_position:
            raise WorkflowError(
                f"agent {agent.name!r}: prompt of {len(prompt)} tokens plus "
                f"{agent.max_new_tokens} new ones exceeds the context of "
                f"{model.config.max_position}"
            )
        prefix = self.prefixes.get(model, segments[0].tokens)

        start = time.perf_counter()
        cache = prefix.clone()
        cache.reserve(len(prompt) + agent.max_new_tokens + 1)
        build = self.method.build(hop, model, cache)
        int(torch.argmax(build.last_logits))  # the first token is known here
        ttft = time.perf_counter() - start

        capture = self.method.decode_capture_layers()
        out = greedy_decode(
            model, cache, build.last_logits, agent.max_new_tokens, self.stop, capture=capture,
            forced=forced,
        )
        if capture:
            self.method.after_decode(hop, tuple(out.tokens), out.captured)
        n = len(prompt)
        # The reply prefix is the opening of the agent's reply: successors read it too.
        reply_prefix = self._reply_prefixes[agent.name]  # the prompt's last tokens
        reply = reply_prefix + tuple(out.tokens)
        produced = SharedSegment(agent.name, "agent", reply)
        if self.method.reads_sources:
            begin, end = n - len(reply_prefix), n + len(out.tokens)
            produced.record(agent.name, SegmentKV.from_cache(cache, begin, end, model.inv_freq))
            publish_sources(hop, build, model)
        self.method.after_hop(hop, build)
        cache.truncate(n)
        latency = time.perf_counter() - start
        fidelity = None
        if self.observer is not None:
            view = HopView(
                hop, build, model, out.first_logits, out.tokens, agent.max_new_tokens, self.stop
            )
            cpu0, wall0 = time.process_time(), time.perf_counter()
            fidelity = self.observer(view)
            fidelity["observer_cpu_s"] = time.process_time() - cpu0
            fidelity["observer_s"] = time.perf_counter() - wall0
        shared[agent.name] = produced

        return HopResult(
            agent=agent.name,
            method=self.method.name,
            ttft_s=ttft,
            latency_s=latency,
            prompt_tokens=n,
            prefix_tokens=hop.prefix_len,
            prefilled_tokens=sum(r.length for r in build.records if r.decision == "dense"),
            reuse=ReuseCounts.of(build.records, model.config.n_layers),
            output=self.loaded.tokenizer.decode(reply, skip_special_tokens=True),
            output_tokens=len(out.tokens),
            segments=[r.to_json() for r in build.records],
            kv_bytes=cache.nbytes(),
            source_bytes=sum(s.nbytes() for s in shared.values()),
            method_state_bytes=self.method.memory_bytes(),
            peak_rss_bytes=peak_rss_bytes(),
            output_ids=list(out.tokens),
            fidelity=fidelity,
        )


def read_requests(path: str | Path) -> list[dict]:
    """A JSONL stream of requests: one object per line with ``query`` and other inputs."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"requests file not found: {path}")
    requests = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkflowError(f"{path} line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise WorkflowError(f"{path} line {i}: expected a JSON object")
        requests.append(obj)
    if not requests:
        raise WorkflowError(f"{path}: no requests")
    return requests
