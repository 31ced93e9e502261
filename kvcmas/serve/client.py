"""A client of a ``kvcmas serve`` server (or any vLLM OpenAI server): prompts go as token ids.

Prompts are sent as token ids (``prompt=[ids]`` on the completions endpoint) so the server
sees exactly the tokens kvcmas rendered, and replies come back as token ids
(``return_token_ids``), so a later agent can read an earlier one's reply token for token. A
request is streamed: its TTFT is the arrival of the first chunk that carries a token.

Which prompt tokens the server did not compute comes from two places: the streamed usage
(``prompt_tokens_details.cached_tokens``: vLLM's own prefix cache plus the connector's claim)
and the connector's logs in ``GET /kvcmas/stats`` (the claim alone, and per shared span what
the method did with it), found by the ``X-Request-Id`` the client sets, which vLLM keeps inside
its internal request id. A streamed response carries no ``kv_transfer_params``, hence the logs.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcmas.errors import KvcmasError
from kvcmas.model import loader
from kvcmas.model.config import ModelConfig


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


def api_root(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p`` (where /health and /kvcmas/stats live)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        import openai

        self.base_url = base_url
        self.root = api_root(base_url)
        self.openai = openai.OpenAI(
            base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"),
            timeout=timeout_s, max_retries=0,
        )

    def served_models(self) -> list[str]:
        import openai

        try:
            return [m.id for m in self.openai.models.list().data]
        except openai.APIConnectionError as err:
            raise EngineError(f"no server answers at {self.base_url}: {err}") from None

    def stats(self) -> dict[str, Any] | None:
        """The connector's counters, or None where the server has no kvcmas stats."""
        try:
            with urllib.request.urlopen(f"{self.root}/kvcmas/stats", timeout=10) as r:
                return json.load(r)
        except (OSError, ValueError):  # HTTPError and URLError are OSErrors
            return None  # plain vLLM (404), no stats file configured, or no answer

    def complete(
        self,
        model: str,
        prompt_ids: list[int],
        max_tokens: int,
        stop_ids: set[int],
        kvcmas: dict[str, str] | None = None,
    ) -> Completion:
        """Greedy completion of ``prompt_ids``; ``kvcmas`` is the request's kvcmas params
        (session, agent, namespace) or None for a plain vLLM request."""
        import openai

        try:
            return self._complete(model, prompt_ids, max_tokens, stop_ids, kvcmas)
        except openai.APIConnectionError as err:
            raise EngineError(f"no server answers at {self.base_url}: {err}") from None
        except openai.APIStatusError as err:
            raise EngineError(f"the server refused the request ({err.status_code}): "
                              f"{err.message}") from None

    def _complete(
        self,
        model: str,
        prompt_ids: list[int],
        max_tokens: int,
        stop_ids: set[int],
        kvcmas: dict[str, str] | None,
    ) -> Completion:
        request_id = f"kvcmas-{uuid.uuid4().hex}"
        extra: dict[str, Any] = {"return_token_ids": True, "stop_token_ids": sorted(stop_ids)}
        if kvcmas is not None:
            extra["kv_transfer_params"] = {"kvcmas": kvcmas}
        start = time.perf_counter()
        stream = self.openai.completions.create(
            model=model, prompt=[prompt_ids], max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
            extra_headers={"X-Request-Id": request_id},
        )
        ids: list[int] = []
        ttft = None
        usage = finish = None
        for chunk in stream:
            for choice in chunk.choices:
                new = (choice.model_extra or {}).get("token_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - start
                ids.extend(new)
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        latency = time.perf_counter() - start
        hit_stop = finish == "stop" and bool(ids) and ids[-1] in stop_ids
        if hit_stop:
            ids.pop()  # the local runner's decode leaves the stop token out of the reply
        details = getattr(usage, "prompt_tokens_details", None)
        cached = (details.cached_tokens or 0) if details is not None else None
        return Completion(
            token_ids=ids,
            hit_stop=hit_stop,
            ttft_s=latency if ttft is None else ttft,
            latency_s=latency,
            prompt_tokens=usage.prompt_tokens if usage is not None else len(prompt_ids),
            cached_tokens=cached,
            **(self._served(request_id) if kvcmas is not None else {"claimed_tokens": 0}),
        )

    def _served(self, request_id: str) -> dict[str, Any]:
        """Tokens the connector injected for this request and the record of what its method
        built, from the worker's logs (written before the forward that produced the first
        token, so complete here)."""
        stats = self.stats()
        if stats is None or "injections" not in stats:
            return {"claimed_tokens": None}
        claimed = sum(e["length"] for e in stats["injections"] if request_id in e["request_id"])
        builds = [b for b in stats.get("builds", []) if request_id in b["request_id"]]
        return {"claimed_tokens": claimed, "build": builds[-1] if builds else None}
