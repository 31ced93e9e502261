"""CPU seconds the servers spend while a cell runs, so that a TTFT saving cannot hide compute
moved elsewhere (the connector's builds run inside the engine's step, but a method could also
cost more work per session than it saves in latency).

Every ``kvcmas serve`` (and the router in front of several) runs in its own process group:
the API server, vLLM's engine core and their helpers. Their user + system time is read from
``/proc`` (Linux), including what exited children left in their parents' counters.
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
    their reaped children's; None where ``/proc`` is absent (not Linux)."""
    wanted = set(groups)
    if not proc.is_dir() or not wanted:
        return None
    ticks = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields((entry / "stat").read_text())
        except (OSError, ValueError):
            continue  # exited while we looked
        if int(fields[2]) in wanted:  # field 5: the process group
            # fields 14-17: utime, stime, and the reaped children's cutime, cstime
            ticks += sum(int(v) for v in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")
