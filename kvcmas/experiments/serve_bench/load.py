"""The load generator: sessions arriving by a Poisson process, each an asyncio task that runs
its hops in order through the async client, bounded in sessions and in time.

A cell sends at most its sessions and stops sending at its time limit: no session starts after
it and no running session starts another hop; requests still running get ``drain_s`` more,
then are cancelled (closing the stream, which makes vLLM abort them). Only local servers are
targeted. While a cell runs, a poller reads the server's memory: vLLM's KV-cache usage (its
Prometheus ``/metrics``) and the connector's span store and method state (``/kvcmas/stats``);
of several instances behind a router, each one's, the KV-cache usage averaged, the rest summed.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from kvcmas.errors import UsageError
from kvcmas.experiments.engine_run import AsyncEngineRunner
from kvcmas.experiments.serve_bench.metrics import SessionRecord, prometheus_value
from kvcmas.experiments.serve_bench.workload import arrivals_within
from kvcmas.serve.client import EngineError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Gauges whose peak a cell reports, and the counter whose increase it reports.
PEAK_GAUGES = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",  # fraction of the KV blocks in use
    "requests_running": "vllm:num_requests_running",
    "requests_waiting": "vllm:num_requests_waiting",
}
PREEMPTIONS = "vllm:num_preemptions_total"
PEAK_STATS = ("store_bytes", "method_state_bytes")


def check_local_url(base_url: str) -> None:
    """The load generator only targets this machine: refuse any other host by name."""
    host = urlparse(base_url).hostname
    if host not in LOCAL_HOSTS:
        raise UsageError(
            f"the load generator only targets a local server (127.0.0.1 or localhost), "
            f"not {host or base_url!r}"
        )


class MemoryPoller:
    """Peaks of the server's memory gauges while a cell runs (read every ``interval_s``)."""

    def __init__(self, root: str | list[str], interval_s: float = 0.5):
        self.roots = [root] if isinstance(root, str) else list(root)
        self.interval_s = interval_s
        self.peaks: dict[str, float | None] = dict.fromkeys([*PEAK_GAUGES, *PEAK_STATS])
        self._preemptions: list[float] = []

    @staticmethod
    def _read(url: str) -> bytes | None:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read()
        except OSError:
            return None

    def _read_one(self, root: str) -> tuple[dict[str, float | None], float | None]:
        import json

        metrics = (self._read(f"{root}/metrics") or b"").decode(errors="replace")
        values: dict[str, float | None] = {
            key: prometheus_value(metrics, name) for key, name in PEAK_GAUGES.items()
        }
        try:
            stats = json.loads(self._read(f"{root}/kvcmas/stats") or b"{}")
        except ValueError:
            stats = {}
        values.update({key: stats.get(key) for key in PEAK_STATS})
        return values, prometheus_value(metrics, PREEMPTIONS)

    def poll(self) -> None:
        readings = [self._read_one(root) for root in self.roots]
        values: dict[str, float | None] = {}
        for key in self.peaks:
            got = [v[key] for v, _ in readings if v[key] is not None]
            total = sum(got) if got else None
            if total is not None and key == "kv_cache_usage":
                total /= len(got)  # a fraction of each instance's blocks: their mean
            values[key] = total
        preempted = [p for _, p in readings if p is not None]
        if preempted:
            self._preemptions.append(sum(preempted))
        for key, value in values.items():
            if value is not None:
                old = self.peaks[key]
                self.peaks[key] = value if old is None else max(old, value)

    async def run(self, stop: asyncio.Event) -> None:
        while True:
            await asyncio.to_thread(self.poll)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
                await asyncio.to_thread(self.poll)  # the last reading, after the cell
                return
            except TimeoutError:
                pass

    def report(self) -> dict[str, Any]:
        p = self._preemptions
        return {**self.peaks, "preemptions": p[-1] - p[0] if len(p) >= 2 else None}


async def run_cell(
    runner: AsyncEngineRunner,
    requests: list[dict],
    arrivals: list[float] | None,
    time_limit_s: float,
    drain_s: float,
    on_session: Callable[[SessionRecord, int], None] | None = None,
    poller: MemoryPoller | None = None,
) -> tuple[list[SessionRecord], float]:
    """Send ``requests[i]`` as a session at ``arrivals[i]`` (s from now) until the time limit,
    or (``arrivals`` None) one at a time, each as the one before ends; returns the sessions
    (launched ones only) and the cell's wall time (first arrival to the last session's end)."""
    check_local_url(runner.client.base_url)
    if arrivals is not None and len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    sent = len(requests) if arrivals is None else arrivals_within(arrivals, time_limit_s)
    n_hops = len(runner.workflow.order)
    start = time.perf_counter()
    deadline = start + time_limit_s
    records: list[SessionRecord] = []
    finished = 0

    def now() -> float:
        return time.perf_counter() - start

    async def session(record: SessionRecord, request: dict) -> None:
        nonlocal finished
        record.start_s = now()
        try:
            async for hop in runner.hops(request):
                record.hops.append(hop)
                if time.perf_counter() > deadline and len(record.hops) < n_hops:
                    break  # past the time limit: no new hop
        except EngineError as err:
            record.error = str(err)
        finally:
            record.end_s = now()
            record.complete = len(record.hops) == n_hops
            finished += 1
            if on_session is not None:
                on_session(record, finished)

    stop = asyncio.Event()
    polling = asyncio.create_task(poller.run(stop)) if poller is not None else None
    tasks = []
    try:
        for i, request in enumerate(requests[:sent]):
            if arrivals is None:  # one at a time: the next arrives as this one ends
                if tasks:
                    await tasks[-1]
                if time.perf_counter() > deadline:
                    break
                at = now()
            else:
                at = arrivals[i]
                await asyncio.sleep(max(0.0, at - now()))
            record = SessionRecord(i, at)
            records.append(record)
            tasks.append(asyncio.create_task(session(record, request)))
        if tasks:
            left = max(0.0, deadline - time.perf_counter()) + drain_s
            _, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()  # closes the stream: vLLM aborts the request
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()
        stop.set()
        if polling is not None:
            await polling
    ends = [r.end_s for r in records if r.end_s is not None]
    wall = max(ends) if ends else now()
    if records and all(r.error for r in records):
        raise EngineError(f"every session of the cell failed: {records[0].error}")
    return records, wall
