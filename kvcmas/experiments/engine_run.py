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
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field

from kvcmas.chat import Segment, render_segments, tokenize
from kvcmas.errors import UsageError, WorkflowError
from kvcmas.methods.base import ReuseCounts, SegmentRecord
from kvcmas.model.generate import stop_ids
from kvcmas.serve.client import (
    AsyncEngineClient,
    Completion,
    EngineClient,
    EngineError,
    ModelSide,
)
from kvcmas.serve.params import CONNECTOR_METHODS
from kvcmas.workflow.runner import HopResult, RequestResult
from kvcmas.workflow.spec import AgentSpec, Workflow

PLAIN = "nonshared"  # no kvcmas params: plain vLLM
ENGINE_METHODS = (PLAIN, *CONNECTOR_METHODS)


@dataclass
class EngineHopResult(HopResult):
    cached_tokens: int | None = None  # prompt tokens the server did not compute
    claimed_tokens: int | None = None  # of those, supplied by the kvcmas connector
    itl_s: list[float] = field(default_factory=list, repr=False)  # inter-token gaps, streamed
    tpot_s: float | None = None  # time per output token after the first


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


@dataclass(frozen=True)
class HopRequest:
    """One hop as sent: its rendered segments, the prompt ids and the kvcmas params."""

    agent: AgentSpec
    segments: list[Segment]
    prompt: list[int]
    reply_prefix: tuple[int, ...]
    params: dict[str, str] | None  # None: plain vLLM


class _HopBuilder:
    """What the sync and async runners share: a hop's prompt from the workflow and the
    replies so far, and its result from the server's answer. A session is one request;
    its hops run in workflow order."""

    def __init__(
        self,
        side: ModelSide,
        workflow: Workflow,
        method: str,
        namespace: str | None = None,
        ignore_eos: bool = False,
    ):
        check_engine_method(method)
        self.side, self.workflow = side, workflow
        self.method, self.namespace = method, namespace
        # With ignore_eos every agent writes exactly its max_new_tokens (controlled traces):
        # an end-of-turn token the model picks stays in the reply as an ordinary token.
        self.ignore_eos = ignore_eos
        self.stop = set() if ignore_eos else stop_ids(side)
        tok = side.tokenizer
        self._reply_prefixes = {a.name: tokenize(tok, a.reply_prefix) for a in workflow.agents}

    def _check_server(self, base_url: str, served: list[str], stats: dict | None) -> None:
        if self.side.name not in served:
            raise EngineError(
                f"the server at {base_url} serves {', '.join(served)}, not "
                f"{self.side.name}: pass the --model it was started with"
            )
        if self.method != PLAIN and stats is None:
            raise EngineError(
                f"the server at {base_url} has no kvcmas connector "
                "(GET /kvcmas/stats failed): start it with `kvcmas serve`"
            )

    def _session(self, request: dict) -> tuple[str, dict[str, tuple[int, ...]]]:
        """The request's session id and its input slots as token ids (checked first)."""
        self.workflow.check_request(request)
        session = str(request.get("session") or uuid.uuid4().hex)
        tok = self.side.tokenizer
        return session, {s: tokenize(tok, request[s].strip()) for s in self.workflow.inputs()}

    def _hop_request(self, name: str, slot_tokens: dict, session: str) -> HopRequest:
        agent = self.workflow.agent(name)
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
        return HopRequest(agent, segments, prompt, reply_prefix, params)

    def _send_args(self, hop: HopRequest) -> tuple:
        return self.side.name, hop.prompt, hop.agent.max_new_tokens, self.stop, hop.params

    def _hop_done(self, hop: HopRequest, done: Completion, slot_tokens: dict) -> EngineHopResult:
        reply = hop.reply_prefix + tuple(done.token_ids)
        slot_tokens[hop.agent.name] = reply  # later agents read the reply as its token ids
        n_layers = self.side.config.n_layers
        served = done.cached_tokens or 0
        records = served_records(hop.segments, served, self.workflow, n_layers)
        if done.build is not None:  # a method built spans: its own account of each
            records = built_records(done.build)
        return EngineHopResult(
            agent=hop.agent.name,
            method=self.method,
            ttft_s=done.ttft_s,
            latency_s=done.latency_s,
            prompt_tokens=done.prompt_tokens,
            prefix_tokens=min(served, len(hop.segments[0])),
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
            itl_s=done.itl_s,
            tpot_s=done.tpot_s,
        )

    def _request_result(
        self, request: dict, session: str, hops: list[EngineHopResult], latency_s: float
    ) -> RequestResult:
        final = next(h for h in hops if h.agent == self.workflow.final).output
        return RequestResult(
            str(request.get("id", session)), self.method, final, hops, latency_s=latency_s,
            background_s=None, cpu_s=None,  # spent in the server process
        )


class EngineRunner(_HopBuilder):
    """Runs requests through a server, one at a time (checks the server first)."""

    def __init__(
        self,
        side: ModelSide,
        workflow: Workflow,
        client: EngineClient,
        method: str,
        namespace: str | None = None,
        ignore_eos: bool = False,
    ):
        super().__init__(side, workflow, method, namespace, ignore_eos)
        self.client = client
        stats = None if method == PLAIN else client.stats()
        self._check_server(client.base_url, client.served_models(), stats)

    def run(self, request: dict) -> RequestResult:
        session, slot_tokens = self._session(request)
        start = time.perf_counter()
        hops = []
        for name in self.workflow.order:
            hop = self._hop_request(name, slot_tokens, session)
            done = self.client.complete(*self._send_args(hop), ignore_eos=self.ignore_eos)
            hops.append(self._hop_done(hop, done, slot_tokens))
        return self._request_result(request, session, hops, time.perf_counter() - start)

    def run_stream(self, requests: Iterable[dict]) -> Iterator[RequestResult]:
        for i, request in enumerate(requests):
            yield self.run({"id": str(i), **request})


class AsyncEngineRunner(_HopBuilder):
    """Runs sessions concurrently in one event loop (``await check_server()`` once first).
    :meth:`hops` yields each hop as it completes, so a load generator can stop a session
    between hops and keep what it measured."""

    def __init__(
        self,
        side: ModelSide,
        workflow: Workflow,
        client: AsyncEngineClient,
        method: str,
        namespace: str | None = None,
        ignore_eos: bool = False,
    ):
        super().__init__(side, workflow, method, namespace, ignore_eos)
        self.client = client

    async def check_server(self) -> None:
        stats = None if self.method == PLAIN else await self.client.stats_async()
        self._check_server(self.client.base_url, await self.client.served_models(), stats)

    async def hops(self, request: dict) -> AsyncIterator[EngineHopResult]:
        session, slot_tokens = self._session(request)
        for name in self.workflow.order:
            hop = self._hop_request(name, slot_tokens, session)
            done = await self.client.complete(*self._send_args(hop), ignore_eos=self.ignore_eos)
            yield self._hop_done(hop, done, slot_tokens)

    async def run(self, request: dict) -> RequestResult:
        request = {"session": uuid.uuid4().hex, **request}
        start = time.perf_counter()
        hops = [hop async for hop in self.hops(request)]
        return self._request_result(
            request, request["session"], hops, time.perf_counter() - start)


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
