"""CPU seconds the servers spend while a cell runs, so that a TTFT saving cannot hide compute
moved elsewhere (a method can shorten the first token's wait and still cost the engine more
work per session).

Each vLLM server the bench starts (:class:`kvcmas.serve.launch.ServerProcess`, and the router
in front of several) leads its own session and process group, which holds the API server,
vLLM's engine core and their helpers. Their user + system time is read from ``/proc``
(Linux), with what their reaped children left in the parents' counters. One scan is not
atomic: a child reaped between reading it and its parent is missed, a tick's worth or so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(stat: str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and
    parentheses, so split after its last ')'): index 0 is field 3 (state)."""
    return stat[stat.rindex(")") + 2 :].split()


def group_cpu_s(groups: Iterable[int], proc: Path = PROC) -> float | None:
    """User + system seconds of every live process in the process groups ``groups``, with
    their reaped children's; None where ``/proc`` is absent (not Linux) or a group has no
    live process left (its server died: its time so far is lost, so no figure is right)."""
    wanted = set(groups)
    if not proc.is_dir() or not wanted:
        return None
    ticks, seen = 0, set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields((entry / "stat").read_text())
            group = int(fields[2])  # field 5: the process group
            if group in wanted:
                # fields 14-17: utime, stime, and the reaped children's cutime, cstime
                ticks += sum(int(v) for v in fields[11:15])
                seen.add(group)
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return ticks / os.sysconf("SC_CLK_TCK") if seen == wanted else None


def cpu_spent(before: float | None, after: float | None) -> float | None:
    """Seconds between two readings; None if either is missing or the counters went back
    (a process of the group exited unreaped between them)."""
    if before is None or after is None or after < before:
        return None
    return after - before
