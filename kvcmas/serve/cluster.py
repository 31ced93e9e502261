"""``kvcmas serve --instances N``: N vLLM+connector instances behind a session-affine router.

A session's spans live in the span store of the instance that served its first hop, so every
later hop must reach the same instance. The router is vLLM's own (``vllm-router``, a Rust
binary from PyPI) with its ``consistent_hash`` policy, which hashes the ``X-Session-ID`` header
the kvcmas client sends with every kvcmas request (``namespace/session``): a session always
reaches one instance, sessions spread over all, and adding an instance moves only ~1/N of them.

Each instance is a :class:`~kvcmas.serve.launch.ServerProcess` on a free loopback port, its
OpenMP threads pinned to its own cores; the router starts once all answer ``/health`` and
listens on the configured port. ``/kvcmas/stats`` is per instance (the connector's logs of the
instance that served a request): read each instance's URL, as the clients and the serving
benchmark do. Ctrl-C stops the router and every instance.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from kvcmas.errors import UsageError
from kvcmas.serve.launch import (
    ServeConfig,
    ServerProcess,
    check_method,
    check_port,
    check_vllm_installed,
)

ROUTER_POLICY = "consistent_hash"


def router_binary() -> str:
    """The ``vllm-router`` console script beside this Python, else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise UsageError("vllm-router is not installed (the router of --instances): "
                         "pip install vllm-router==0.1.17 (in the vllm extra)")
    return found


def instance_cores(instances: int) -> list[list[int]]:
    """The cores of each instance: the cores this process may use, split into ``instances``
    equal contiguous groups (one core each on a 2-core machine with 2 instances)."""
    if instances < 1:
        raise UsageError(f"--instances must be at least 1, got {instances}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < instances:
        raise UsageError(f"--instances {instances} needs a core per instance; this process may "
                         f"run on {len(cores)} ({','.join(map(str, cores))})")
    per = len(cores) // instances
    return [cores[i * per : (i + 1) * per] for i in range(instances)]


def instance_configs(cfg: ServeConfig, instances: int) -> list[ServeConfig]:
    """One config per instance, each on its own free port (distinct from the router's)."""
    ports: list[int] = []
    while len(ports) < instances:
        port = check_port(0, cfg.host)
        if port != cfg.port and port not in ports:
            ports.append(port)
    return [replace(cfg, port=p) for p in ports]


def router_command(cfg: ServeConfig, instance_urls: list[str]) -> list[str]:
    return [
        router_binary(), "--host", cfg.host, "--port", str(cfg.port),
        "--worker-urls", *instance_urls, "--policy", ROUTER_POLICY,
        # Streams of long prompts under load: no router-side deadline shorter than vLLM's own.
        "--request-timeout-secs", "3600", "--log-level", "warning",
    ]  # fmt: skip


class RouterProcess(ServerProcess):
    """The router's process group (stopped like a server's); ``/health`` answers when ready."""

    def __init__(self, cfg: ServeConfig, instance_urls: list[str]):
        self.cfg = cfg
        self.proc = self._start(router_command(cfg, instance_urls), dict(os.environ))


class Cluster:
    """N instances, then the router in front of them: start, wait, stop everything."""

    def __init__(self, cfg: ServeConfig, instances: int, stats_dir: Path):
        cores = instance_cores(instances)
        self.cfg = cfg  # the router's address; the instances take free ports
        self.servers = [
            ServerProcess(c, stats_dir / f"stats-{i}.json", cpus=cores[i])
            for i, c in enumerate(instance_configs(cfg, instances))
        ]
        self.router: RouterProcess | None = None

    @property
    def instance_urls(self) -> list[str]:
        return [s.cfg.url for s in self.servers]

    @property
    def url(self) -> str:
        return self.cfg.url

    def processes(self) -> list[ServerProcess]:
        return [*self.servers, *([self.router] if self.router is not None else [])]

    def exited(self) -> bool:
        return any(p.proc.poll() is not None for p in self.processes())

    def wait_healthy(self, timeout_s: float, stopping: Callable[[], bool]) -> bool:
        """Every instance answers /health, then the router is started and answers too."""
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        for server in self.servers:  # they start concurrently: the first wait covers most
            if not server.wait_healthy(left(), lambda: stopping() or self.exited()):
                return False
        self.router = RouterProcess(self.cfg, self.instance_urls)
        return self.router.wait_healthy(left(), stopping)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(grace_s=5.0)
        for server in self.servers:
            server.stop()


@contextlib.contextmanager
def running_cluster(
    cfg: ServeConfig, instances: int, timeout_s: float, stopping: Callable[[], bool] = lambda: False
) -> Iterator[Cluster | None]:
    """A started cluster (None if it did not come up: exited, stopped or timed out); stopped
    on leaving, whatever happens."""
    with tempfile.TemporaryDirectory(prefix="kvcmas-cluster-") as tmp:
        cluster = Cluster(cfg, instances, Path(tmp))
        try:
            yield cluster if cluster.wait_healthy(timeout_s, stopping) else None
        finally:
            cluster.stop()


def serve_cluster(cfg: ServeConfig, instances: int, startup_timeout_s: float = 600.0) -> int:
    """``kvcmas serve --instances N``: run until Ctrl-C / SIGTERM or until a process exits."""
    check_method(cfg.method, cfg.method_options)
    check_vllm_installed()
    router_binary()
    cores = instance_cores(instances)
    stop_asked: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: stop_asked.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    start = time.monotonic()
    try:
        with running_cluster(cfg, instances, startup_timeout_s, lambda: bool(stop_asked)) as c:
            if c is None:
                outcome = "stopped" if stop_asked else "failed"
            else:
                print(f"kvcmas serve: listening on {c.url}/v1 (router: vllm-router, "
                      f"{ROUTER_POLICY} on the X-Session-ID header; {instances} instances, "
                      f"model {cfg.model_name}, method {cfg.method}, {cfg.dtype}; ready in "
                      f"{time.monotonic() - start:.0f} s; Ctrl-C stops)", flush=True)
                for i, url in enumerate(c.instance_urls):
                    print(f"kvcmas serve: instance {i} on {url}/v1 (cores "
                          f"{','.join(map(str, cores[i]))}; "
                          f"stats at {url}/kvcmas/stats)", flush=True)
                while not c.exited() and not stop_asked:
                    time.sleep(0.2)
                outcome = "stopped" if stop_asked else "exited"
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if outcome == "stopped":
        print("kvcmas serve: stopped", flush=True)
        return 0
    print("kvcmas serve: error: an instance or the router exited or did not answer /health "
          f"within {startup_timeout_s:.0f} s (their logs are above)", file=sys.stderr, flush=True)
    return 1

