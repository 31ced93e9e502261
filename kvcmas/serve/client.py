"""A client of a ``kvcmas serve`` server (or any vLLM OpenAI server): prompts go as token ids.

Prompts are sent as token ids (``prompt=[ids]`` on the completions endpoint) so the server
sees exactly the tokens kvcmas rendered, and replies come back as token ids
(``return_token_ids``), so a later agent can read an earlier one's reply token for token. A
request is streamed: its TTFT is the arrival of the first chunk that carries a token.
:class:`EngineClient` (sequential runs) and :class:`AsyncEngineClient` (many sessions at once,
for load generation) share the request's arguments and the parsing of its stream.

Which prompt tokens the server did not compute comes from two places: the streamed usage
(``prompt_tokens_details.cached_tokens``: vLLM's own prefix cache plus the connector's claim)
and the connector's logs in ``GET /kvcmas/stats`` (the claim alone, and per shared span what
the method did with it), found by the ``X-Request-Id`` the client sets, which vLLM keeps inside
its internal request id. A streamed response carries no ``kv_transfer_params``, hence the logs.

Every kvcmas request names its session in a header (``X-Session-ID``, which vllm-router's
``consistent_hash`` policy reads, and ``X-Kvcmas-Session`` for other proxies), so a router in
front of several instances keeps a session on the instance holding its spans. There the
connector's logs are per instance: ``stats_roots`` names every instance, and their logs are
read together (request ids are unique).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcmas.errors import KvcmasError
from kvcmas.model import loader
from kvcmas.model.config import ModelConfig

SESSION_HEADERS = ("X-Session-ID", "X-Kvcmas-Session")  # value: "namespace/session"


def session_key(kvcmas: dict[str, str]) -> str:
    """The routing key of a request's session: sessions of one namespace stay together."""
    return f"{kvcmas.get('namespace') or ''}/{kvcmas['session']}"


class EngineError(KvcmasError, RuntimeError):
    """The server could not be reached or answered something unusable."""


@dataclass(frozen=True)
class ModelSide:
    """What a client needs of the served model, without its weights: the tokenizer (chat
    rendering), the config (context length, EOS ids) and the folder (generation config).
    Has the attributes :func:`kvcmas.model.generate.stop_ids` reads."""

    name: str
    folder: Path
    tokenizer: Any
    config: ModelConfig


def load_model_side(spec: str) -> ModelSide:
    from transformers import AutoTokenizer

    name, folder = loader.resolve(spec)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return ModelSide(name, folder, AutoTokenizer.from_pretrained(folder), config)


@dataclass
class Completion:
    token_ids: list[int]  # generated ids, stop token excluded (as the local runner's decode)
    hit_stop: bool
    ttft_s: float  # request sent -> first token received
    latency_s: float  # request sent -> stream closed
    prompt_tokens: int
    cached_tokens: int | None  # prompt tokens not computed: vLLM's prefix cache + connector
    claimed_tokens: int | None  # of those, supplied by the kvcmas connector (None: unknown)
    build: dict[str, Any] | None = None  # the worker's record of the spans a method built
    # Seconds between consecutive streamed chunks that carried tokens (inter-token latency:
    # a build in the engine step shows up here for every request decoding at that time).
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        n = len(self.token_ids) + self.hit_stop
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


def api_root(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p`` (where /health and /kvcmas/stats live)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def served_by_connector(stats: dict[str, Any] | None, request_id: str) -> dict[str, Any]:
    """Tokens the connector injected for a request and the record of what its method built,
    from the worker's logs (written before the forward that produced the first token)."""
    if stats is None or "injections" not in stats:
        return {"claimed_tokens": None}
    claimed = sum(e["length"] for e in stats["injections"] if request_id in e["request_id"])
    builds = [b for b in stats.get("builds", []) if request_id in b["request_id"]]
    return {"claimed_tokens": claimed, "build": builds[-1] if builds else None}


@contextmanager
def engine_errors(base_url: str) -> Iterator[None]:
    """The openai client's connection and status errors as :class:`EngineError`."""
    import openai

    try:
        yield
    except openai.APIConnectionError as err:
        raise EngineError(f"no server answers at {base_url}: {err}") from None
    except openai.APIStatusError as err:
        raise EngineError(f"the server refused the request ({err.status_code}): "
                          f"{err.message}") from None


class _Stream:
    """One streamed completion as it arrives: token ids, first-token time, usage."""

    def __init__(self, prompt_ids: list[int], stop_ids: set[int]):
        self.prompt_ids, self.stop_ids = prompt_ids, stop_ids
        self.request_id = f"kvcmas-{uuid.uuid4().hex}"
        self.ids: list[int] = []
        self.ttft: float | None = None
        self.usage = self.finish = None
        self.start = time.perf_counter()
        self.chunk_times: list[float] = []  # arrivals of the chunks that carried tokens

    def request(
        self, model: str, max_tokens: int, kvcmas: dict[str, str] | None, ignore_eos: bool
    ) -> dict[str, Any]:
        """The keyword arguments of ``completions.create`` (sync and async alike)."""
        extra: dict[str, Any] = {"return_token_ids": True,
                                 "stop_token_ids": sorted(self.stop_ids)}
        headers = {"X-Request-Id": self.request_id}
        if ignore_eos:
            extra["ignore_eos"] = True
        if kvcmas is not None:
            extra["kv_transfer_params"] = {"kvcmas": kvcmas}
            headers.update(dict.fromkeys(SESSION_HEADERS, session_key(kvcmas)))
        return dict(
            model=model, prompt=[self.prompt_ids], max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
            extra_headers=headers,
        )

    def add(self, chunk: Any) -> bool:
        """Take one chunk; True when it carried the first token."""
        first = False
        for choice in chunk.choices:
            new = (choice.model_extra or {}).get("token_ids") or []
            if new:
                now = time.perf_counter()
                self.chunk_times.append(now)
                if self.ttft is None:
                    self.ttft, first = now - self.start, True
            self.ids.extend(new)
            self.finish = choice.finish_reason or self.finish
        self.usage = chunk.usage or self.usage
        return first

    def completion(self, served: dict[str, Any]) -> Completion:
        latency = time.perf_counter() - self.start
        ids = self.ids
        hit_stop = self.finish == "stop" and bool(ids) and ids[-1] in self.stop_ids
        if hit_stop:
            ids.pop()  # the local runner's decode leaves the stop token out of the reply
        usage = self.usage
        details = getattr(usage, "prompt_tokens_details", None)
        return Completion(
            token_ids=ids,
            hit_stop=hit_stop,
            ttft_s=latency if self.ttft is None else self.ttft,
            latency_s=latency,
            prompt_tokens=usage.prompt_tokens if usage is not None else len(self.prompt_ids),
            cached_tokens=(details.cached_tokens or 0) if details is not None else None,
            itl_s=[b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)],
            **served,
        )


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several instances' stats as one: counters summed, logs concatenated, anchor-pool
    reports merged per (namespace, method)."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            old = out.get(key)
            if key == "pools":
                out[key] = merge_pool_reports(old or {}, value)
            elif isinstance(value, list):
                out[key] = [*(old or []), *value]
            elif isinstance(value, int | float) and isinstance(old, int | float):
                out[key] = old + value
            elif key not in out:
                out[key] = value
    return out


# Per-pool figures that do not add up over instances: V, and the largest single pool.
_POOL_MAXIMA = ("pool_size", "largest_pool")


def merge_pool_reports(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    """Two instances' ``pools`` (report per namespace and method): bytes and counts summed."""
    out = {key: dict(report) for key, report in a.items()}
    for key, report in b.items():
        mine = out.setdefault(key, {})
        for name, value in report.items():
            if name not in mine:
                mine[name] = value
            elif name in _POOL_MAXIMA:
                mine[name] = max(mine[name], value)
            else:
                mine[name] += value
    return out


def read_stats(root: str) -> dict[str, Any] | None:
    """One server's ``/kvcmas/stats``, or None where it has none."""
    try:
        with urllib.request.urlopen(f"{root}/kvcmas/stats", timeout=10) as r:
            return json.load(r)
    except (OSError, ValueError):  # HTTPError and URLError are OSErrors
        return None  # plain vLLM (404), no stats file configured, or no answer


class _ClientBase:
    def __init__(self, base_url: str, timeout_s: float, stats_roots: list[str] | None = None):
        self.base_url = base_url
        self.root = api_root(base_url)
        self.timeout_s = timeout_s
        # Where the connector's logs are: the server itself, or each instance behind a router.
        self.stats_roots = [api_root(u) for u in stats_roots] if stats_roots else [self.root]

    def _openai_options(self) -> dict[str, Any]:
        return dict(base_url=self.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                    timeout=self.timeout_s, max_retries=0)

    def stats(self) -> dict[str, Any] | None:
        """The connector's counters (summed over instances), or None where a server has no
        kvcmas stats."""
        parts = [read_stats(root) for root in self.stats_roots]
        if any(p is None for p in parts):
            return None
        return parts[0] if len(parts) == 1 else merge_stats(parts)


class EngineClient(_ClientBase):
    def __init__(
        self, base_url: str, timeout_s: float = 600.0, stats_roots: list[str] | None = None
    ):
        import openai

        super().__init__(base_url, timeout_s, stats_roots)
        self.openai = openai.OpenAI(**self._openai_options())

    def served_models(self) -> list[str]:
        with engine_errors(self.base_url):
            return [m.id for m in self.openai.models.list().data]

    def complete(
        self,
        model: str,
        prompt_ids: list[int],
        max_tokens: int,
        stop_ids: set[int],
        kvcmas: dict[str, str] | None = None,
        ignore_eos: bool = False,
    ) -> Completion:
        """Greedy completion of ``prompt_ids``; ``kvcmas`` is the request's kvcmas params
        (session, agent, namespace) or None for a plain vLLM request; ``ignore_eos`` runs to
        ``max_tokens`` (vLLM's option)."""
        stream = _Stream(prompt_ids, stop_ids)
        with engine_errors(self.base_url):
            for chunk in self.openai.completions.create(
                **stream.request(model, max_tokens, kvcmas, ignore_eos)
            ):
                stream.add(chunk)
        served = {"claimed_tokens": 0} if kvcmas is None else served_by_connector(
            self.stats(), stream.request_id)
        return stream.completion(served)


class AsyncEngineClient(_ClientBase):
    """:class:`EngineClient` on ``openai.AsyncOpenAI``, for many sessions in one event loop.
    The connector's logs are read as the first token arrives (they are complete then), while
    the rest streams, so a busy server's short log window still holds the request."""

    def __init__(
        self, base_url: str, timeout_s: float = 600.0, stats_roots: list[str] | None = None
    ):
        import openai

        super().__init__(base_url, timeout_s, stats_roots)
        self.openai = openai.AsyncOpenAI(**self._openai_options())

    async def served_models(self) -> list[str]:
        with engine_errors(self.base_url):
            return [m.id async for m in self.openai.models.list()]

    async def stats_async(self) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.stats)

    async def complete(
        self,
        model: str,
        prompt_ids: list[int],
        max_tokens: int,
        stop_ids: set[int],
        kvcmas: dict[str, str] | None = None,
        ignore_eos: bool = False,
    ) -> Completion:
        """As :meth:`EngineClient.complete`; cancelling it closes the stream (vLLM aborts)."""
        stream = _Stream(prompt_ids, stop_ids)
        logs = None
        try:
            with engine_errors(self.base_url):
                response = await self.openai.completions.create(
                    **stream.request(model, max_tokens, kvcmas, ignore_eos))
                async with response:
                    async for chunk in response:
                        if stream.add(chunk) and kvcmas is not None:
                            logs = asyncio.create_task(self.stats_async())
            if kvcmas is None:
                served: dict[str, Any] = {"claimed_tokens": 0}
            else:
                stats = await (logs if logs is not None else self.stats_async())
                served = served_by_connector(stats, stream.request_id)
        finally:
            if logs is not None and not logs.done():
                logs.cancel()
        return stream.completion(served)

    async def close(self) -> None:
        await self.openai.close()
