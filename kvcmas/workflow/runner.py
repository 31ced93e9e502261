"""Run requests through a workflow with one reuse method, hop by hop.

Data flows one way: the runner renders each agent's segments, asks the method to build the
hop's context KV on top of the agent's cached system prefix, decodes greedily, and hands the
output (as generated token ids and their exact decode-time KV) to the agents that read it.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcmas.chat import render_segments, tokenize
from kvcmas.kv.cache import KVCache
from kvcmas.kv.segment import SegmentKV
from kvcmas.methods.base import Hop, Method, SharedSegment
from kvcmas.methods.nonshared import NonShared
from kvcmas.model.generate import greedy_decode, stop_ids
from kvcmas.model.loader import LoadedModel
from kvcmas.workflow.spec import Workflow, WorkflowError


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


@dataclass
class HopResult:
    agent: str
    method: str
    ttft_s: float  # all critical-path work up to the first output token
    latency_s: float  # the whole hop, decoding and post-token bookkeeping included
    prompt_tokens: int
    prefix_tokens: int  # served by the shared system-prompt prefix cache
    prefilled_tokens: int  # run through every layer for this hop (beyond the prefix)
    reused_tokens: int  # shared tokens whose K/V came (fully or partly) from a source
    recompute_fraction: float  # computed (token, layer) pairs of shared tokens / dense pairs
    output: str
    output_tokens: int
    segments: list[dict[str, Any]]
    kv_bytes: int  # this hop's context cache
    source_bytes: int  # shared-segment caches held for later hops
    method_state_bytes: int  # anchor pools and other state the method keeps
    peak_rss_bytes: int
    output_ids: list[int] = field(default_factory=list, repr=False)
    fidelity: dict[str, Any] | None = None

    def to_json(self, full: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not full:
            d.pop("output_ids")
        fid = d.pop("fidelity")
        if fid:
            d.update({k: v for k, v in fid.items() if k != "reference_output"})
        return d


@dataclass
class RequestResult:
    request: str
    method: str
    final_answer: str
    hops: list[HopResult]
    reference_final_answer: str | None = None

    @property
    def same_final_answer(self) -> bool | None:
        if self.reference_final_answer is None:
            return None
        return self.final_answer == self.reference_final_answer

    def to_json(self) -> dict[str, Any]:
        d = {
            "request": self.request,
            "method": self.method,
            "final_answer": self.final_answer,
            "hops": [h.to_json() for h in self.hops],
        }
        if self.reference_final_answer is not None:
            d["reference_final_answer"] = self.reference_final_answer
            d["same_final_answer"] = self.same_final_answer
        return d


def publish_sources(hop: Hop, build, model) -> None:
    """After a hop, its cache of each shared segment becomes that segment's latest source."""
    for rec in build.records:
        if rec.slot is not None:
            end = rec.start + rec.length
            kv = SegmentKV.from_cache(build.cache, rec.start, end, model.inv_freq)
            hop.shared[rec.slot].record(hop.agent, kv)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Runner:
    """Runs a stream of requests; method state (anchor pools) persists across requests."""

    def __init__(
        self,
        loaded: LoadedModel,
        workflow: Workflow,
        method: Method,
        reference: LoadedModel | None = None,
        reference_answers: bool = True,
    ):
        self.loaded = loaded
        self.workflow = workflow
        self.method = method
        self.stop = stop_ids(loaded)
        self.prefixes = PrefixCache()
        self.reference = reference
        self._ref_prefixes = PrefixCache()
        # A whole NonShared run per request for final-answer agreement; a benchmark that runs
        # NonShared itself anyway turns this off and compares against that run.
        self._ref_runner = None
        if reference is not None and reference_answers:
            self._ref_runner = Runner(reference, workflow, NonShared(), reference_answers=False)
        self._check_reply_prefixes()
        tok = loaded.tokenizer
        self._reply_prefixes = {a.name: tokenize(tok, a.reply_prefix) for a in workflow.agents}
        self._warm_prefixes()

    def _check_reply_prefixes(self) -> None:
        """Methods that save decode-time hidden states (DroidSpeak, RelayCaching) hold them
        for generated tokens only; a read reply with a prefix would lose them silently."""
        # The capture layers resolve only once the model is seen; overriding the hook is the sign.
        if type(self.method).decode_capture_layers is Method.decode_capture_layers:
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
            if self.reference is not None:
                self._ref_prefixes.get(self.reference.model, prefix)

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
            value = request[slot]
            if not isinstance(value, str) or not value.strip():
                raise WorkflowError(f"request input {slot!r} must be a non-empty string")
            tokens = tokenize(self.loaded.tokenizer, value.strip())
            shared[slot] = SharedSegment(slot, self.workflow.slot_kind(slot), tokens)
        return shared

    def run(self, request: dict, index: int = 0) -> RequestResult:
        shared = self._request_inputs(request)
        hops = []
        for step, name in enumerate(self.workflow.order):
            hops.append(self._run_hop(self.workflow.agent(name), shared, index, step))
        final = next(h for h in hops if h.agent == self.workflow.final).output
        ref_final = None
        if self._ref_runner is not None:
            ref_final = self._ref_runner.run(request, index).final_answer
        rid = str(request.get("id", index))
        return RequestResult(rid, self.method.name, final, hops, ref_final)

    def run_stream(self, requests: Iterable[dict], progress=None) -> Iterator[RequestResult]:
        for i, request in enumerate(requests):
            result = self.run(request, i)
            if progress:
                progress(i, result)
            yield result

    def _fidelity(self, hop: Hop, build, out, max_new_tokens: int) -> dict[str, Any] | None:
        """The hop's prompt cache against a dense reference prefill of the same tokens."""
        if self.reference is None:
            return None
        from kvcmas.bench.fidelity import hop_fidelity

        ref_prefix = self._ref_prefixes.get(self.reference.model, hop.segments[0].tokens)
        spans = [(r.start, r.start + r.length) for r in build.records if r.slot is not None]
        return asdict(
            hop_fidelity(
                self.reference.model,
                ref_prefix,
                hop.tokens,
                self.loaded.model,
                build.cache,
                out.first_logits,
                out.tokens,
                max_new_tokens,
                self.stop,
                spans,
            )
        )

    def _run_hop(self, agent, shared: dict[str, SharedSegment], index: int, step: int) -> HopResult:
        model = self.loaded.model
        segments = self._segments(agent, {k: v.tokens for k, v in shared.items()})
        hop = Hop(agent.name, index, step, segments, shared)
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
            model, cache, build.last_logits, agent.max_new_tokens, self.stop, capture=capture
        )
        if capture:
            self.method.after_decode(hop, out.captured)
        n = len(prompt)
        # The reply prefix is the opening of the agent's reply: successors read it too.
        prefix = self._reply_prefixes[agent.name]  # the prompt's last tokens
        reply = prefix + tuple(out.tokens)
        produced = SharedSegment(agent.name, "agent", reply)
        if self.method.reads_sources:
            begin, end = n - len(prefix), n + len(out.tokens)
            produced.record(agent.name, SegmentKV.from_cache(cache, begin, end, model.inv_freq))
            publish_sources(hop, build, model)
        self.method.after_hop(hop, build)
        cache.truncate(n)
        latency = time.perf_counter() - start
        fidelity = self._fidelity(hop, build, out, agent.max_new_tokens)
        shared[agent.name] = produced

        shared_recs = [r for r in build.records if r.slot is not None]
        shared_pairs = sum(r.length for r in shared_recs) * model.config.n_layers
        return HopResult(
            agent=agent.name,
            method=self.method.name,
            ttft_s=ttft,
            latency_s=latency,
            prompt_tokens=n,
            prefix_tokens=hop.prefix_len,
            prefilled_tokens=sum(r.length for r in build.records if r.decision == "dense"),
            reused_tokens=sum(r.length for r in shared_recs if r.decision != "dense"),
            recompute_fraction=(
                sum(r.computed_pairs for r in shared_recs) / shared_pairs if shared_pairs else 1.0
            ),
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
