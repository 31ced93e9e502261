"""Saves off the engine step: a finished request's KV is copied out of vLLM's blocks on one
background thread while the engine runs its next forwards.

vLLM lets a connector keep a finished request's blocks (``request_finished`` returns True) and
report later that it is done with them (``get_finished``); the connector submits the copy
here, puts the (still filling) tensor in the span store at once with its :class:`SaveJob` as
the pending fill, and reports the request when :meth:`SaveCopier.reap` returns its job. Any
reader of the entry, and its drop, waits for the job first (the span store does), so a load
never reads, and a later save never reuses, memory a copy still writes.

With ``background=False`` a job runs inside :meth:`SaveCopier.submit` (the step waits for it):
the same path, synchronous.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from kvcmas.methods.background import start_torch_thread


class SaveJob:
    """One copy: ``copy`` runs once; ``error`` holds what it raised."""

    def __init__(self, request_id: str, num_tokens: int, copy: Callable[[], None]):
        self.request_id, self.num_tokens = request_id, num_tokens
        self._copy: Callable[[], None] | None = copy
        # Inference mode is per thread: tensors made under the caller's (vLLM's worker runs
        # in it) may be written only under it.
        self._inference_mode = torch.is_inference_mode_enabled()
        self.error: BaseException | None = None
        self.copy_s = 0.0  # seconds the copy ran (on the copier's thread)
        self.waited_s = 0.0  # seconds callers blocked in wait()
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def run(self) -> None:
        copy, self._copy = self._copy, None
        start = time.perf_counter()
        try:
            with torch.inference_mode(self._inference_mode):
                copy()
        except Exception as err:  # reported by the connector, which releases the blocks
            self.error = err
        self.copy_s = time.perf_counter() - start
        # Drop the copy's references to the store's tensor before saying done: a drop that
        # waited for this job may then reuse the memory (the store checks who else holds it).
        del copy
        self._done.set()

    def wait(self) -> BaseException | None:
        """Block until the copy ran; returns its error, if any."""
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            self.waited_s += time.perf_counter() - start
        return self.error


class SaveCopier:
    """Runs :class:`SaveJob` copies in submission order on one thread (or inline)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._jobs: list[SaveJob] = []  # submitted, not yet reaped
        self._queue: queue.SimpleQueue[SaveJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, request_id: str, num_tokens: int, copy: Callable[[], None]) -> SaveJob:
        job = SaveJob(request_id, num_tokens, copy)
        self._jobs.append(job)
        if not self.background:
            job.run()
        else:
            self._start()
            self._queue.put(job)
        return job

    def reap(self) -> list[SaveJob]:
        """The jobs that finished since the last call (with or without an error)."""
        done = [job for job in self._jobs if job.done]
        if done:
            self._jobs = [job for job in self._jobs if not job.done]
        return done

    def close(self) -> None:
        """Finish the queued copies and stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _start(self) -> None:
        if self._thread is not None:
            return
        # One thread of torch work: the engine's forward keeps its cores (more would
        # oversubscribe them, and OpenMP threads that spin at barriers slow the forward).
        self._thread = start_torch_thread(self._loop, "kvcmas-save", threads=1)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            job.run()
