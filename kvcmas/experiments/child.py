"""Run one function in a fresh child process, so that its peak RSS is the run's own."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def in_child(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a fresh child process, so that its peak RSS is the run's own high-water
    mark; ``fn`` must be a module-level function and the arguments and result picklable.

    The child is spawned, not forked: a fork taken while torch's OpenMP threads exist can
    deadlock in the child (seen: a context-sweep child asleep on a futex for minutes).
    """
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, fn, args))
    child.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:
        ok, value = False, "the child process died without an answer (out of memory?)"
    child.join()
    if not ok:
        raise RuntimeError(f"experiment run failed in its child process:\n{value}")
    return value


def _child_main(send, fn: Callable[..., Any], args: tuple) -> None:
    import traceback

    try:
        result = (True, fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        result = (False, traceback.format_exc())
    send.send(result)
    send.close()

