"""Work kept off a hop's critical path (anchor construction), as a server would schedule it.

Jobs are grouped by key (one anchor pool). A hop that is about to read a pool first calls
:meth:`BackgroundWork.wait_for` with that pool's key, so it sees every anchor recorded before
it, and pays only for that pool's pending jobs. Everything else runs later:

* ``"idle"``: deferred until :meth:`flush`, which the runner calls when a request is done
  (idle time between requests in a single-stream loop);
* ``"thread"``: one worker thread runs jobs as they come, competing with the critical path
  for the CPU;
* ``"inline"``: run at once where submitted (the round-1 behaviour; for measurement only).

Jobs of one key always run in submission order, so results are deterministic after a flush.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

import torch

MODES = ("idle", "thread", "inline")


def start_torch_thread(target: Callable[[], None], name: str, threads: int) -> threading.Thread:
    """Start a daemon thread running ``target`` with ``threads`` torch intra-op threads.

    ``torch.set_num_threads`` on a new thread also changes the count that later threads start
    with; the caller's global count is given back once the thread has fixed its own.
    """
    caller_threads = torch.get_num_threads()
    started = threading.Event()

    def run() -> None:
        torch.set_num_threads(threads)
        torch.get_num_threads()  # fixes this thread's count before the global one is restored
        started.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    started.wait()
    torch.set_num_threads(caller_threads)
    return thread


class BackgroundWork:
    def __init__(self, mode: str = "idle"):
        if mode not in MODES:
            raise ValueError(f"background mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.seconds = 0.0  # total time spent running jobs, wherever they ran
        self._jobs: deque[tuple[Hashable, Callable[[], None]]] = deque()
        self._lock = threading.Condition()
        self._running: Hashable | None = None
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None

    def __deepcopy__(self, memo: dict) -> BackgroundWork:
        """A copy of a method (to replay one state two ways) gets an idle queue of its own."""
        if self.pending():
            raise RuntimeError("flush() before copying: background jobs are pending")
        copy = BackgroundWork(self.mode)
        copy.seconds = self.seconds
        return copy

    def submit(self, key: Hashable, job: Callable[[], None]) -> None:
        if self.mode == "inline":
            self._run(job)
            return
        with self._lock:
            self._jobs.append((key, job))
            self._lock.notify_all()
        if self.mode == "thread" and self._worker is None:
            # The worker uses the submitter's torch thread count: a new thread's OpenMP team
            # may default to another size, which changes the SVD's rounding.
            self._worker = start_torch_thread(
                self._serve, "kvcmas-anchors", torch.get_num_threads()
            )

    def pending(self, key: Hashable | None = None) -> int:
        with self._lock:
            jobs = sum(1 for k, _ in self._jobs if key is None or k == key)
            return jobs + (self._running is not None and (key is None or self._running == key))

    def wait_for(self, key: Hashable) -> float:
        """Finish every pending job of ``key``; the seconds this caller waited."""
        start = time.perf_counter()
        if self.mode == "thread":
            with self._lock:
                while any(k == key for k, _ in self._jobs) or self._running == key:
                    self._lock.wait()
        else:
            while job := self._take(key):
                self._run(job)
        self._raise_error()
        return time.perf_counter() - start

    def flush(self) -> float:
        """Finish every pending job; the seconds this caller spent or waited."""
        start = time.perf_counter()
        if self.mode == "thread":
            with self._lock:
                while self._jobs or self._running is not None:
                    self._lock.wait()
        else:
            while job := self._take(None):
                self._run(job)
        self._raise_error()
        return time.perf_counter() - start

    def _take(self, key: Hashable | None) -> Callable[[], None] | None:
        with self._lock:
            for i, (k, job) in enumerate(self._jobs):
                if key is None or k == key:
                    del self._jobs[i]
                    return job
        return None

    def _run(self, job: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            job()
        finally:
            self.seconds += time.perf_counter() - start

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._lock.wait()
                key, job = self._jobs.popleft()
                self._running = key
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - re-raised in the waiting caller
                self._error = e
            with self._lock:
                self._running = None
                self._lock.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("background anchor construction failed") from error
