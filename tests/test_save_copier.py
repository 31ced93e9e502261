"""Saves copied on a background thread, and the span store waiting for them.

No vLLM, no model: the copies fill plain tensors, held back by events where a test needs a
copy still running.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvcmas.serve.save_copier import SaveCopier
from kvcmas.serve.span_store import SpanStore

SHAPE = (2, 2, 1, 4, 3)  # [layers, K/V, heads, tokens, head_dim]


@pytest.fixture
def copier():
    c = SaveCopier()
    yield c
    c.close()


def held_copy(kv: torch.Tensor, go: threading.Event, value: float = 1.0):
    """A copy that fills ``kv`` only after ``go`` is set."""

    def copy() -> None:
        assert go.wait(10), "the test never released the copy"
        kv.fill_(value)

    return copy


def release_later(go: threading.Event, seconds: float = 0.05) -> threading.Timer:
    timer = threading.Timer(seconds, go.set)
    timer.start()
    return timer


def test_copies_run_in_order_on_one_thread_with_one_torch_thread(copier):
    seen = []
    caller_threads = torch.get_num_threads()
    jobs = [copier.submit(f"r{i}", 1, lambda i=i: seen.append(
        (i, threading.current_thread().name, torch.get_num_threads()))) for i in range(3)]
    for job in jobs:
        assert job.wait() is None
    assert [i for i, _, _ in seen] == [0, 1, 2]
    assert {name for _, name, _ in seen} == {"kvcmas-save"}
    assert {n for _, _, n in seen} == {1}
    # Neither this thread's torch threads nor those a new thread starts with are changed.
    assert torch.get_num_threads() == caller_threads
    new_thread = []
    t = threading.Thread(target=lambda: new_thread.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert new_thread == [caller_threads]


def test_reap_reports_each_finished_job_once_and_not_a_running_one(copier):
    go = threading.Event()
    done = copier.submit("ra", 4, lambda: None)
    done.wait()
    running = copier.submit("rb", 4, held_copy(torch.zeros(SHAPE), go))
    assert [j.request_id for j in copier.reap()] == ["ra"]
    assert copier.reap() == []
    go.set()
    running.wait()
    assert [j.request_id for j in copier.reap()] == ["rb"]


def test_a_read_waits_for_the_copy_still_filling_the_entry(copier):
    store = SpanStore()
    kv, go = torch.zeros(SHAPE), threading.Event()
    store.put("a", kv, filling=copier.submit("ra", 4, held_copy(kv, go)))
    release_later(go)
    k, v = store.read("a", 0, 4)  # returns only once the copy has filled it
    assert bool((k == 1).all()) and bool((v == 1).all())


def test_a_drop_waits_for_the_copy_and_its_memory_serves_the_next_save(copier):
    store = SpanStore(max_bytes=1 << 20)
    kv, go = torch.zeros(SHAPE), threading.Event()
    job = copier.submit("ra", 4, held_copy(kv, go))
    store.put("a", kv, filling=job)
    del kv
    release_later(go)
    store.drop("a")
    assert job.done
    # The finished copy holds no reference to the tensor: its memory is a spare, reused.
    reused = store.new(SHAPE, torch.float32, "cpu")
    assert store.reused_saves == 1 and bool((reused == 1).all())


def test_a_copy_writes_tensors_made_in_the_callers_inference_mode(copier):
    with torch.inference_mode():  # as vLLM's worker runs: its tensors are inference tensors
        kv = torch.zeros(SHAPE)
        job = copier.submit("ra", 4, lambda: kv.fill_(1))
    assert job.wait() is None and bool((kv == 1).all())


def test_a_failed_copy_is_reported_and_its_entry_cannot_be_read(copier):
    store = SpanStore()

    def broken() -> None:
        raise RuntimeError("blocks unreadable")

    job = copier.submit("ra", 4, broken)
    store.put("a", torch.zeros(SHAPE), filling=job)
    job.wait()
    [reaped] = copier.reap()
    assert isinstance(reaped.error, RuntimeError)
    with pytest.raises(KeyError, match="saving request 'a' failed.*blocks unreadable"):
        store.get("a")
    assert len(store) == 0 and store.num_bytes == 0


def test_without_background_the_copy_runs_inside_submit():
    copier = SaveCopier(background=False)
    seen = []
    job = copier.submit("ra", 4, lambda: seen.append(threading.current_thread()))
    assert job.done and seen == [threading.current_thread()]
    assert [j.request_id for j in copier.reap()] == ["ra"]
