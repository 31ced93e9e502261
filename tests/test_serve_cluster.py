"""``kvcmas serve --instances N``: instances behind vllm-router, sessions kept on one instance.

Without vLLM: the pieces (cores per instance, ports, the router's command, the session header
every kvcmas request carries, stats merged over instances), and the real router over two fake
backends: the same session always reaches the same backend, sessions spread over both, and
kvcmas's request fields pass through untouched. With the ``vllm`` marker: two real instances
(one core each) and the router, sessions of a two-agent workflow through the router.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from kvcmas import cli
from kvcmas.errors import UsageError
from kvcmas.serve import cluster
from kvcmas.serve.client import SESSION_HEADERS, _Stream, merge_stats, session_key
from kvcmas.serve.launch import ServeConfig, healthy, server_env
from tests.test_serve_cli import _free_port, alive, descendants, kill_all, start_serve


def _has_router() -> bool:
    try:
        cluster.router_binary()
    except UsageError:
        return False
    return True


needs_router = pytest.mark.skipif(
    not _has_router(), reason="vllm-router is not installed (pip install vllm-router==0.1.17, "
    "in the vllm extra; scripts/setup.sh installs it)")  # fmt: skip


# ----------------------------------------------------------------- pieces


def test_instances_split_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cluster.instance_cores(2) == [[0, 1], [2, 3]]
    assert cluster.instance_cores(4) == [[0], [1], [2], [3]]
    with pytest.raises(UsageError, match="--instances 5 needs a core per instance"):
        cluster.instance_cores(5)
    with pytest.raises(UsageError, match="at least 1"):
        cluster.instance_cores(0)


def test_an_instance_is_pinned_to_its_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-7")  # a caller's setting, overridden
    env = server_env(tmp_path / "s.json", cpus=[1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert server_env(tmp_path / "s.json")["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"


def test_instances_take_distinct_free_ports_and_the_router_its_own():
    cfg = ServeConfig(Path("m"), "m", port=_free_port())
    ports = [c.port for c in cluster.instance_configs(cfg, 3)]
    assert len(set(ports)) == 3 and cfg.port not in ports


@needs_router
def test_router_command_hashes_sessions():
    cfg = ServeConfig(Path("m"), "m", port=9000)
    cmd = cluster.router_command(cfg, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert cmd[cmd.index("--policy") + 1] == "consistent_hash"
    assert cmd[cmd.index("--port") + 1] == "9000"
    i = cmd.index("--worker-urls")
    assert cmd[i + 1 : i + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_kvcmas_requests_name_their_session_in_headers():
    stream = _Stream([1, 2, 3], {0})
    kv = {"session": "s1", "agent": "a", "namespace": "ns"}
    headers = stream.request("m", 4, kv, False)["extra_headers"]
    assert {h: headers[h] for h in SESSION_HEADERS} == dict.fromkeys(SESSION_HEADERS, "ns/s1")
    assert headers["X-Request-Id"] == stream.request_id
    assert session_key({"session": "s1", "agent": "a"}) == "/s1"
    plain = stream.request("m", 4, None, False)["extra_headers"]
    assert not set(SESSION_HEADERS) & set(plain)  # plain vLLM requests: any instance


def test_stats_of_instances_merge():
    a = {"served_tokens": 3, "store_bytes": 10, "injections": [{"request_id": "x"}], "m": "k"}
    b = {"served_tokens": 4, "store_bytes": 5, "injections": [{"request_id": "y"}], "m": "k"}
    merged = merge_stats([a, b])
    assert merged["served_tokens"] == 7 and merged["store_bytes"] == 15 and merged["m"] == "k"
    assert [e["request_id"] for e in merged["injections"]] == ["x", "y"]


def test_pool_reports_of_instances_merge_per_namespace():
    def report(nbytes, anchors, largest):
        return {"pool_bytes": nbytes, "anchors": anchors, "anchor_tokens": 10 * anchors,
                "pools": 2, "largest_pool": largest, "pool_size": 10}  # fmt: skip

    a = {"pools": {'["t1", "kvcmas"]': report(100, 3, 2)}}
    b = {"pools": {'["t1", "kvcmas"]': report(50, 4, 3), '["t2", "kvcmas"]': report(7, 1, 1)}}
    merged = merge_stats([a, b])["pools"]
    assert merged['["t1", "kvcmas"]'] == {"pool_bytes": 150, "anchors": 7, "anchor_tokens": 70,
                                          "pools": 4, "largest_pool": 3, "pool_size": 10}
    assert merged['["t2", "kvcmas"]'] == report(7, 1, 1)
    assert a["pools"]['["t1", "kvcmas"]']["pool_bytes"] == 100  # the parts are not changed


def test_serve_refuses_more_instances_than_cores(monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("kvcmas.model.loader.resolve", lambda *a: pytest.fail("resolved"))
    assert cli.main(["serve", "--method", "exact", "--instances", "3"]) == 2
    assert "--instances 3 needs a core per instance" in capsys.readouterr().err


def test_bench_serve_refuses_more_instances_than_cores(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("kvcmas.serve.launch.ServerProcess", lambda *a, **k: pytest.fail("ran"))
    argv = ["bench", "serve", "--out", str(tmp_path), "--instances", "3"]
    assert cli.main(argv) == 2
    assert "--instances 3 needs a core per instance" in capsys.readouterr().err


# ----------------------------------------------------------------- the router, fake backends

FAKE_BACKEND = textwrap.dedent("""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})
            self._send({"who": sys.argv[2]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            self._send({"who": sys.argv[2], "body": body,
                        "request_id": self.headers.get("X-Request-Id")})

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


@needs_router
def test_router_keeps_each_session_on_one_backend(tmp_path):
    """The real vllm-router (consistent_hash) over two fake backends: 16 sessions x 3 requests
    with the client's headers; each session's requests reach one backend, sessions spread over
    both (all 16 on one backend: probability 2^-15), and the body's kvcmas fields arrive."""
    script = tmp_path / "backend.py"
    script.write_text(FAKE_BACKEND)
    ports = [_free_port(), _free_port()]
    backends = [subprocess.Popen([sys.executable, str(script), str(p), f"b{i}"])
                for i, p in enumerate(ports)]  # fmt: skip
    cfg = ServeConfig(Path("m"), "m", port=_free_port())
    router = None
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        deadline = time.monotonic() + 30
        while not all(healthy(u) for u in urls):
            assert time.monotonic() < deadline, "fake backends did not start"
            time.sleep(0.1)
        router = cluster.RouterProcess(cfg, urls)
        assert router.wait_healthy(60, lambda: False), "vllm-router did not answer /health"
        seen: dict[str, set[str]] = {}
        for s in range(16):
            kv = {"session": f"session-{s}", "agent": "a", "namespace": "ns"}
            for _ in range(3):
                stream = _Stream([1, 2, 3], {0})
                args = stream.request("m", 2, kv, False)
                body = {"model": "m", "prompt": args["prompt"], **args["extra_body"]}
                req = urllib.request.Request(
                    f"{cfg.url}/v1/completions", data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", **args["extra_headers"]},
                )  # fmt: skip
                with urllib.request.urlopen(req, timeout=10) as r:
                    got = json.load(r)
                assert got["body"]["kv_transfer_params"] == {"kvcmas": kv}
                assert got["body"]["prompt"] == [[1, 2, 3]] and got["body"]["return_token_ids"]
                assert got["request_id"] == stream.request_id
                seen.setdefault(kv["session"], set()).add(got["who"])
        assert all(len(who) == 1 for who in seen.values()), seen
        assert set().union(*seen.values()) == {"b0", "b1"}, seen
    finally:
        if router is not None:
            router.stop(grace_s=5)
        for b in backends:
            b.kill()
            b.wait()


# ----------------------------------------------------------------- real instances


def _metric(root: str, name: str) -> float:
    with urllib.request.urlopen(f"{root}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip


@pytest.mark.vllm
@needs_router
def test_two_instances_behind_the_router_keep_sessions_where_their_spans_are(tmp_path):
    """`kvcmas serve --instances 2 --method fullshared`: 12 two-agent sessions through the
    router. Each session's requests all reach one instance (its builds appear on one instance
    only, and each instance served exactly 2 requests per session it holds), the second hop
    reuses the first's spans (served tokens > 0), and sessions spread over both instances
    (all 12 on one: probability 2^-11). SIGINT leaves no process behind."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two instances need two cores")
    from kvcmas.experiments.engine_run import EngineRunner
    from kvcmas.serve.client import EngineClient, load_model_side
    from kvcmas.workflow.spec import workflow_from_dict

    proc, port, log = start_serve(tmp_path, "cluster.log", [
        "--instances", "2", "--method", "fullshared", "--max-model-len", "1024",
        # Every span built (pinned rule): on prompts this short the measured costs may leave
        # them to vLLM, and the test checks where the claims are made.
        "--kv-cache-bytes", str(256 << 20), "--min-span", "16", "--min-gain", "0"])  # fmt: skip
    tree: set[int] = set()
    try:
        # Printed right after it (and maybe already buffered: no select on the pipe here).
        lines = [proc.stdout.readline() for _ in range(2)]
        roots = [ln.split(" on ", 1)[1].split("/v1", 1)[0] for ln in lines]
        assert len(set(roots)) == 2 and all("cores" in ln for ln in lines), lines
        tree = descendants(proc.pid)

        workflow = workflow_from_dict({
            "name": "pair", "final": "judge",
            "agents": [
                {"name": "solver", "system": "You are careful.", "max_new_tokens": 20,
                 "prompt": "Question:\n{query}\nSolve it step by step."},
                {"name": "judge", "system": "You are careful.", "max_new_tokens": 4,
                 "prompt": "The solver wrote:\n{solver}\nto the question:\n{query}\nRight?"},
            ],
        })  # fmt: skip
        question = ("A farmer has {n} rows of apple trees with seven trees in each row, and "
                    "every tree gives twelve apples in a good year. How many apples does the "
                    "farmer pick in a good year, and how many in a year half as good?")
        requests = [{"query": question.format(n=n + 3), "session": f"cluster-{n}"}
                    for n in range(12)]  # fmt: skip
        side = load_model_side("smollm2-135m")
        client = EngineClient(f"http://127.0.0.1:{port}/v1", stats_roots=roots)
        # ignore_eos: the solver writes 20 tokens, a span of the judge's prompt (as the query).
        runner = EngineRunner(side, workflow, client, "fullshared", "cluster", ignore_eos=True)
        results = list(runner.run_stream(requests))
        # The second hop's spans were claimed (the client reads every instance's logs).
        assert all(r.hops[1].claimed_tokens > 0 for r in results), [
            [h.claimed_tokens for h in r.hops] for r in results]  # fmt: skip

        per_instance = [json.load(urllib.request.urlopen(f"{r}/kvcmas/stats")) for r in roots]
        # A build names its session as the connector keys it: [namespace, session] in JSON.
        sessions = [{json.loads(b["session"])[1] for b in s["builds"]} for s in per_instance]
        builds = [s["builds"][:1] for s in per_instance]
        assert sessions[0] | sessions[1] == {r["session"] for r in requests}, builds
        assert not sessions[0] & sessions[1], sessions  # a session's spans on one instance
        assert sessions[0] and sessions[1], sessions  # spread over both
        for root, held, stats in zip(roots, sessions, per_instance, strict=True):
            assert stats["served_tokens"] > 0  # later hops reused spans on each instance
            # Every request of a session (first hops too) reached the instance holding it.
            assert _metric(root, "vllm:request_success_total") == 2 * len(held)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        assert "kvcmas serve: stopped" in proc.stdout.read()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in tree if alive(p)], "processes outlived the cluster"
    finally:
        kill_all(proc, tree)


def test_memory_of_instances_is_read_from_each(monkeypatch):
    """The bench's poller over two instances: KV-cache usage averaged (a fraction of each
    instance's blocks), the connector's bytes and the request gauges summed."""
    from kvcmas.experiments.serve_bench.load import MemoryPoller

    pages = {
        "http://a/metrics": b'vllm:kv_cache_usage_perc{m="x"} 0.25\n'
                            b'vllm:num_requests_running{m="x"} 2\n',
        "http://b/metrics": b'vllm:kv_cache_usage_perc{m="x"} 0.75\n'
                            b'vllm:num_requests_running{m="x"} 1\n',
        "http://a/kvcmas/stats": json.dumps({"store_bytes": 100}).encode(),
        "http://b/kvcmas/stats": json.dumps({"store_bytes": 50}).encode(),
    }  # fmt: skip
    monkeypatch.setattr(MemoryPoller, "_read", staticmethod(lambda url: pages.get(url)))
    poller = MemoryPoller(["http://a", "http://b"])
    poller.poll()
    report = poller.report()
    assert report["kv_cache_usage"] == 0.5 and report["requests_running"] == 3
    assert report["store_bytes"] == 150 and report["method_state_bytes"] is None
