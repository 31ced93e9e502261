"""``kvcmas run --engine vllm``: a workflow's requests through a vLLM server, hop by hop.

Each hop's prompt is rendered exactly as the local runner renders it (``render_segments``: the
chat template split at slots, each piece tokenized on its own) and sent as token ids; an
agent's reply comes back as token ids and fills that agent's slot in later prompts, so every
workflow and request file runs unchanged. With a kvcmas method, each request carries
``kv_transfer_params={"kvcmas": {"session", "agent"[, "namespace"]}}`` (one session per
workflow request) and names the method (the server builds with it, whatever its own default);
``--method nonshared`` sends none, i.e. plain vLLM (with its own prefix
cache), the reference for the kvcmas server's outputs.

Results have the shape of ``kvcmas run``'s. What only the server knows is reported as far as
the client sees it: the prompt tokens it did not compute (``cached_tokens``: vLLM's prefix
cache plus the connector's claim) and the connector's share (``claimed_tokens``). rho counts
shared tokens inside the served range, or, where a method built spans in the claim, the
tokens its record says it served from sources (recomputed and densely prefilled ones not).
KV bytes, background and compute seconds live in the server process and are null here.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvcmas.chat import Segment, render_segments, tokenize
from kvcmas.errors import UsageError, WorkflowError
from kvcmas.methods.base import ReuseCounts, SegmentRecord
from kvcmas.model.generate import stop_ids
from kvcmas.serve.client import Completion, EngineClient, EngineError, ModelSide
from kvcmas.serve.params import CONNECTOR_METHODS
from kvcmas.workflow.runner import HopResult, RequestResult
from kvcmas.workflow.spec import AgentSpec, Workflow

PLAIN = "nonshared"  # no kvcmas params: plain vLLM
ENGINE_METHODS = (PLAIN, *CONNECTOR_METHODS)


@dataclass
class EngineHopResult(HopResult):
    cached_tokens: int | None = None  # prompt tokens the server did not compute
    claimed_tokens: int | None = None  # of those, supplied by the kvcmas connector


def served_records(
    segments: list[Segment], served: int, workflow: Workflow, n_layers: int
) -> list[SegmentRecord]:
    """Records of the segments after the system prefix, as the local runner's methods write
    them: a token is served when it lies in the prompt range the server did not compute
    (always a prefix: vLLM's cache and the connector's claim both start at position 0)."""
    records = []
    start = len(segments[0])
    for seg in segments[1:]:
        end = start + len(seg)
        hit = max(0, min(end, served) - start)
        decision = "reuse" if hit == len(seg) else "dense" if hit == 0 else "partial"
        kind = workflow.slot_kind(seg.slot) if seg.shared else "private"
        records.append(SegmentRecord(
            seg.slot, kind, start, len(seg), decision, (len(seg) - hit) * n_layers, hit))
        start = end
    return records


def built_records(build: dict) -> list[SegmentRecord]:
    """Records of the spans the connector's method built (the worker's log of the request):
    the server found them by token matching, so they are named by producer, not by slot.
    Only the spans count: text an exact run or vLLM's prefix cache served is not in them."""
    return [
        SegmentRecord(s["slot"], s["kind"], s["start"], s["length"], s["decision"],
                      s["computed_pairs"], s["served_tokens"], entropy=s.get("entropy"))
        for s in build["spans"]
    ]  # fmt: skip


def check_engine_method(method: str) -> None:
    if method not in ENGINE_METHODS:
        raise UsageError(
            f"--method {method!r} cannot run on the vLLM engine: choose one of "
            f"{', '.join(ENGINE_METHODS)} ({PLAIN} = plain vLLM, no kvcmas params)"
        )


class EngineRunner:
    """Runs requests through a server: one session per request, hops in workflow order."""

    def __init__(
        self,
        side: ModelSide,
        workflow: Workflow,
        client: EngineClient,
        method: str,
        namespace: str | None = None,
    ):
        check_engine_method(method)
        self.side, self.workflow, self.client = side, workflow, client
        self.method, self.namespace = method, namespace
        self._check_server()
        self.stop = stop_ids(side)
        tok = side.tokenizer
        self._reply_prefixes = {a.name: tokenize(tok, a.reply_prefix) for a in workflow.agents}

    def _check_server(self) -> None:
        served = self.client.served_models()
        if self.side.name not in served:
            raise EngineError(
                f"the server at {self.client.base_url} serves {', '.join(served)}, not "
                f"{self.side.name}: pass the --model it was started with"
            )
        if self.method == PLAIN:
            return
        stats = self.client.stats()
        if stats is None:
            raise EngineError(
                f"the server at {self.client.base_url} has no kvcmas connector "
                "(GET /kvcmas/stats failed): start it with `kvcmas serve`"
            )

    def run(self, request: dict) -> RequestResult:
        self.workflow.check_request(request)
        session = str(request.get("session") or uuid.uuid4().hex)
        tok = self.side.tokenizer
        slot_tokens = {s: tokenize(tok, request[s].strip()) for s in self.workflow.inputs()}
        start = time.perf_counter()
        hops = [
            self._run_hop(self.workflow.agent(name), slot_tokens, session)
            for name in self.workflow.order
        ]
        latency = time.perf_counter() - start
        final = next(h for h in hops if h.agent == self.workflow.final).output
        return RequestResult(
            str(request.get("id", session)), self.method, final, hops, latency_s=latency,
            background_s=None, cpu_s=None,  # spent in the server process
        )

    def run_stream(self, requests: Iterable[dict]) -> Iterator[RequestResult]:
        for i, request in enumerate(requests):
            yield self.run({"id": str(i), **request})

    def _run_hop(self, agent: AgentSpec, slot_tokens: dict, session: str) -> EngineHopResult:
        reply_prefix = self._reply_prefixes[agent.name]
        segments = render_segments(
            self.side.tokenizer, agent.system, agent.prompt, slot_tokens, reply_prefix
        )
        if segments[0].shared:
            raise WorkflowError(f"agent {agent.name!r}: the prompt must not start with a slot")
        prompt = [t for s in segments for t in s.tokens]
        if len(prompt) + agent.max_new_tokens > self.side.config.max_position:
            raise WorkflowError(
                f"agent {agent.name!r}: prompt of {len(prompt)} tokens plus "
                f"{agent.max_new_tokens} new ones exceeds the context of "
                f"{self.side.config.max_position}"
            )
        params = None
        if self.method != PLAIN:
            # The method goes with every request: one server serves them all side by side.
            params = {"session": session, "agent": agent.name, "method": self.method}
            if self.namespace:
                params["namespace"] = self.namespace
        done = self.client.complete(
            self.side.name, prompt, agent.max_new_tokens, self.stop, params
        )
        reply = reply_prefix + tuple(done.token_ids)
        slot_tokens[agent.name] = reply  # later agents read the reply as its token ids
        return self._hop_result(agent, segments, done, reply)

    def _hop_result(
        self, agent: AgentSpec, segments: list[Segment], done: Completion, reply: tuple
    ) -> EngineHopResult:
        n_layers = self.side.config.n_layers
        served = done.cached_tokens or 0
        records = served_records(segments, served, self.workflow, n_layers)
        if done.build is not None:  # a method built spans: its own account of each
            records = built_records(done.build)
        return EngineHopResult(
            agent=agent.name,
            method=self.method,
            ttft_s=done.ttft_s,
            latency_s=done.latency_s,
            prompt_tokens=done.prompt_tokens,
            prefix_tokens=min(served, len(segments[0])),
            prefilled_tokens=done.prompt_tokens - served,
            reuse=ReuseCounts.of(records, n_layers),
            output=self.side.tokenizer.decode(reply, skip_special_tokens=True),
            output_tokens=len(done.token_ids),
            segments=[r.to_json() for r in records],
            kv_bytes=None,  # the server's; not visible to a client
            source_bytes=None,
            method_state_bytes=None,
            peak_rss_bytes=None,
            output_ids=list(done.token_ids),
            cached_tokens=done.cached_tokens,
            claimed_tokens=done.claimed_tokens,
        )


def print_engine_table(result: RequestResult) -> None:
    """``kvcmas run``'s table, with what the server did not compute instead of decisions."""
    print(f"request {result.request} [{result.method} on vLLM]")
    cols = ["agent", "ttft_s", "latency_s", "prompt", "cached", "claimed", "prefilled", "rho"]
    print("  " + "  ".join(f"{c:>10}" for c in cols))
    for h in result.hops:
        row = [
            h.agent, f"{h.ttft_s:.3f}", f"{h.latency_s:.3f}", h.prompt_tokens,
            "?" if h.cached_tokens is None else h.cached_tokens,
            "?" if h.claimed_tokens is None else h.claimed_tokens,
            h.prefilled_tokens, "-" if h.rho is None else f"{h.rho:.2f}",
        ]
        print("  " + "  ".join(f"{str(c):>10}" for c in row))
    print(f"  final answer: {result.final_answer}")
    print(f"  request latency {result.latency_s:.3f} s (server-side compute not measured)")


def run_on_engine(args: argparse.Namespace) -> int:
    """``kvcmas run --engine vllm``: every input checked before the first request is sent."""
    from kvcmas.eval.tasks import load_workflow
    from kvcmas.serve.client import load_model_side
    from kvcmas.workflow.runner import read_requests

    check_engine_method(args.method)
    if args.compare:
        raise UsageError("--compare needs the local engine (it reads every hop's KV)")
    if getattr(args, "method_options", None) or getattr(args, "method_config", None):
        raise UsageError("method options configure the server: pass them to `kvcmas serve`")
    workflow = load_workflow(args.workflow)
    requests = read_requests(args.requests) if args.requests else [{"query": args.question}]
    for i, r in enumerate(requests, 1):
        workflow.check_request(r, where=f"request {i}")
    runner = EngineRunner(
        load_model_side(args.model), workflow, EngineClient(args.base_url), args.method,
        namespace=args.namespace,
    )
    for result in runner.run_stream(requests):
        if args.json:
            print(json.dumps(result.to_json()), flush=True)
        else:
            print_engine_table(result)
    return 0
