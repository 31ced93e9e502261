"""The per-request protocol: ``kv_transfer_params={"kvcmas": {...}}`` on a vLLM request.

Checked twice: in the HTTP server (a malformed request gets 400 naming the field) and again in
the engine's scheduler, which never raises on it (an exception there would stop the engine) but
serves such a request as plain vLLM. No vllm import here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from kvcmas.errors import KvcmasError

# Test-only knobs are refused unless the server was started with this variable set to 1.
TEST_HOOKS_ENV = "KVCMAS_TEST_HOOKS"
# Where the worker writes its counters as JSON, which GET /kvcmas/stats serves.
STATS_FILE_ENV = "KVCMAS_STATS_FILE"
# Where the worker writes the saved KV of requests sent with the ``test_dump`` hook.
DUMP_DIR_ENV = "KVCMAS_DUMP_DIR"
_TEST_FIELDS = ("test_noise_std", "test_dump")

# Method objects (one per namespace and method, holding its anchor pools) a connector keeps.
DEFAULT_NAMESPACES = 64
# Bounds of the connector's span store and of each method object's per-session state.
DEFAULT_STORE_BYTES = 512 << 20
DEFAULT_SESSION_STATE_BYTES = 1 << 30
# The fixed cost rule's default, where one is used: on an `exact` server (which loads no
# runtime to measure) for per-request methods, or pinned by the operator (min_gain). A span is
# built only if it serves at least this many tokens per token its build always recomputes (the
# method's recomputed_tokens: a repaired head). Measured on the 2-core AMX host with
# SmolLM2-135M in bf16 (RESULTS.md, "A cost rule for short spans"): the hops of a 512-token
# document served 3.1-5.2 tokens per head token and were slower than plain vLLM's, 2K and 4K
# documents (15-31) were 2.5-3x faster. Every other server measures its costs instead
# (kvcmas.serve.costs).
DEFAULT_MIN_GAIN = 8.0

# Methods the connector builds KV with (``kv_connector_extra_config["method"]``). "exact"
# re-injects only the KV vLLM computed for an identical earlier prefix of the session; the
# others are `kvcmas run`'s method objects, building every shared span of the session.
# DroidSpeak and RelayCaching need hidden states, which a KV connector never sees.
# "dense" prefills every span densely with kvcmas's runtime inside the claim (the NonShared
# method): the exact counterpart of the others, measuring what the connector itself costs.
# (Plain vLLM, with no kvcmas params, is what `kvcmas run --engine vllm` calls "nonshared".)
CONNECTOR_METHODS = (
    "exact", "dense", "fullshared", "kvcmas", "kvcomm", "cacheblend", "headrecompute",
    "graphflow",
)  # fmt: skip


def method_for(connector_method: str) -> str:
    """The `kvcmas run` method that builds a connector method's spans."""
    return "nonshared" if connector_method == "dense" else connector_method


class KvcmasParamsError(KvcmasError, ValueError):
    """Malformed ``kvcmas`` request parameters; the message names the field."""


@dataclass(frozen=True)
class KvcmasParams:
    session: str  # sources are shared only within one session
    agent: str  # who produced the request's prompt and output
    namespace: str | None = None  # tenant: anchor pools are per namespace, never shared
    method: str | None = None  # overrides the server's method for this request (its defaults)
    test_noise_std: float = 0.0  # test hook: noise added to injected KV, proving it is read
    test_dump: bool = False  # test hook: the worker writes the saved KV to $KVCMAS_DUMP_DIR


_FIELDS = {"session": str, "agent": str, "namespace": str, "method": str}
_OPTIONAL = ("namespace", "method")


def test_hooks_enabled() -> bool:
    return os.environ.get(TEST_HOOKS_ENV) == "1"


def parse_kvcmas_params(kv_transfer_params: Any) -> KvcmasParams | None:
    """The request's kvcmas parameters, or None for a plain vLLM request."""
    if kv_transfer_params is None:
        return None
    if not isinstance(kv_transfer_params, dict):
        raise KvcmasParamsError(
            f"kv_transfer_params must be an object, got {type(kv_transfer_params).__name__}"
        )
    raw = kv_transfer_params.get("kvcmas")
    if raw is None:
        return None  # other connectors' keys are not ours to judge
    if not isinstance(raw, dict):
        raise KvcmasParamsError(
            f"kv_transfer_params.kvcmas must be an object, got {type(raw).__name__}"
        )
    allowed = set(_FIELDS) | (set(_TEST_FIELDS) if test_hooks_enabled() else set())
    for key in raw:
        if key not in allowed:
            raise KvcmasParamsError(
                f"kv_transfer_params.kvcmas.{key}: unknown field "
                f"(allowed: {', '.join(sorted(allowed))})"
            )
    values: dict[str, Any] = {}
    for key, kind in _FIELDS.items():
        if key not in raw or (key in _OPTIONAL and raw[key] is None):
            if key not in _OPTIONAL:
                raise KvcmasParamsError(f"kv_transfer_params.kvcmas.{key} is required")
            continue
        value = raw[key]
        if not isinstance(value, kind) or not value:
            raise KvcmasParamsError(
                f"kv_transfer_params.kvcmas.{key} must be a non-empty string, "
                f"got {type(value).__name__} {value!r}"
            )
        values[key] = value
    if values.get("method", CONNECTOR_METHODS[0]) not in CONNECTOR_METHODS:
        raise KvcmasParamsError(
            f"kv_transfer_params.kvcmas.method: unknown method {values['method']!r} "
            f"(served: {', '.join(CONNECTOR_METHODS)})"
        )
    if "test_noise_std" in raw:
        noise = raw["test_noise_std"]
        if isinstance(noise, bool) or not isinstance(noise, int | float) or not (
            math.isfinite(noise) and noise >= 0
        ):
            raise KvcmasParamsError(
                f"kv_transfer_params.kvcmas.test_noise_std must be a number >= 0, got {noise!r}"
            )
        values["test_noise_std"] = float(noise)
    if "test_dump" in raw:
        if not isinstance(raw["test_dump"], bool):
            raise KvcmasParamsError(
                f"kv_transfer_params.kvcmas.test_dump must be true or false, "
                f"got {raw['test_dump']!r}"
            )
        values["test_dump"] = raw["test_dump"]
    return KvcmasParams(**values)


# A cache_salt starting with this is kvcmas's own: the middleware refuses it from clients.
SALT_PREFIX = "kvcmas:"


def session_key(params: KvcmasParams) -> str:
    """Sessions are scoped by namespace: two tenants using one session id never mix."""
    return json.dumps([params.namespace, params.session])


def session_cache_salt(namespace: str | None, session: str, client_salt: str | None) -> str:
    """The salt of a kvcmas request: its (namespace, session), so KV a connector loaded
    reaches no other session or tenant; a client's own salt partitions further, and can never
    join another session's blocks."""
    return SALT_PREFIX + json.dumps([namespace, session, client_salt])


def salt_belongs_to(salt: str | None, params: KvcmasParams) -> bool:
    """Whether ``salt`` is the one the middleware gives a request of ``params``'s (namespace,
    session), whatever client salt it holds inside."""
    if not salt or not salt.startswith(SALT_PREFIX):
        return False
    try:
        parts = json.loads(salt[len(SALT_PREFIX) :])
    except ValueError:
        return False
    return (isinstance(parts, list) and len(parts) == 3
            and parts[:2] == [params.namespace, params.session])  # fmt: skip
