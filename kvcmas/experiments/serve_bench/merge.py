"""One report from serving runs made separately (``kvcmas bench serve --merge DIR...``).

A full grid does not fit one session here, so sizes, loads and methods are run as parts and
committed one by one; merging them draws TTFT and memory against S across parts. The parts
must share the trace (:data:`SAME_TRACE`); a method must have the same server options in
every part that runs it; parts at one S must agree on plain vLLM's capacity there (a part is
given the capacity another part searched); a (method, S, load) cell in two parts is an error,
not an overwrite. What a part may set for itself (:data:`PER_PART`: sessions, bounds, the
machine) is kept per part, and every cell, pool and server record names its part, so a
method's ratio to plain vLLM is only taken within one part (runs differ from run to run).
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.experiments import common

SAME_TRACE = (
    "model", "dtype", "engine", "instances", "workflow", "agents", "output_tokens", "source",
)  # fmt: skip
PER_PART = (
    "sessions", "warmup", "seed", "cell_time_s", "drain_s", "kv_cache_bytes", "store_bytes",
    "session_state_bytes", "machine",
)  # fmt: skip
# A capacity given on the command line is the searched one rounded (``--capacity 2048=0.0437``).
CAPACITY_RTOL = 0.01


def read_parts(dirs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each folder's results.json, checked to be a serving run."""
    return common.read_parts(dirs, {"setup", "capacity", "cells"}, "kvcmas bench serve")


def _methods(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, dict]:
    """Each method's server and options, the same in every part (values compared as text:
    options given on the command line arrive as strings)."""
    out: dict[str, dict] = {}
    seen: dict[str, str] = {}
    for d, r in parts:
        for name, m in r["setup"].get("methods", {}).items():
            options = {k: str(v) for k, v in sorted(m["options"].items())}
            key = json.dumps({"server_method": m["server_method"], "options": options})
            if name in seen and seen[name] != key:
                raise UsageError(f"{name} has other server options in {d} than in an earlier part")
            seen[name] = key
            out.setdefault(name, m)
    return out


def _capacity(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, dict]:
    """Per S, the searched capacity record if a part has one (else the given one); every part
    at that S must name the same rate."""
    out: dict[str, dict] = {}
    for d, r in parts:
        for size, c in r["capacity"].items():
            known = out.get(size)
            if known is None:
                out[size] = c
                continue
            if not math.isclose(c["capacity_per_s"], known["capacity_per_s"],
                                rel_tol=CAPACITY_RTOL):  # fmt: skip
                raise UsageError(
                    f"{d} ran S={size} at a capacity of {c['capacity_per_s']:.4g} sessions/s, an "
                    f"earlier part at {known['capacity_per_s']:.4g}: loads would mean other rates"
                )
            if known["given"] and not c["given"]:
                out[size] = c
    return out


def _setting(parts: list[tuple[str, dict[str, Any]]], key: str) -> Any:
    """The parts' common value of ``key``, or None where they differ."""
    values = [r["setup"].get(key) for _, r in parts]
    return values[0] if all(v == values[0] for v in values) else None


def merge_runs(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The merged results, shaped as one run's (see the module docstring)."""
    common.check_same_setup(parts, SAME_TRACE)
    methods = _methods(parts)
    capacity = _capacity(parts)
    cells, pools, server, seen = [], [], [], {}
    for i, (d, r) in enumerate(parts, start=1):
        for c in r["cells"]:
            key = (c["method"], c["size"], c["load"])
            if key in seen:
                raise UsageError(
                    f"the cell {c['method']} at S={c['size']}, load {c['load']:g} is in both "
                    f"{seen[key]} and {d}: merge one of them"
                )
            seen[key] = d
            cells.append({**c, "part": i})
        pools += [{**p, "part": i} for p in r.get("pools") or []]
        server.append({"part": i, **(r.get("server") or {})})
    setup = {key: parts[0][1]["setup"].get(key) for key in SAME_TRACE}
    setup.update({key: _setting(parts, key) for key in PER_PART})
    setup["sizes"] = sorted({c["size"] for c in cells} | {int(s) for s in capacity})
    setup["loads"] = sorted({c["load"] for c in cells})
    setup["methods"] = methods
    setup["parts"] = [
        {"part": i, "dir": d, "wall_s": r.get("wall_s"),
         **{key: r["setup"].get(key) for key in PER_PART},
         **{key: sorted({c[field] for c in r["cells"]})
            for key, field in (("sizes", "size"), ("loads", "load"), ("methods", "method"))}}
        for i, (d, r) in enumerate(parts, start=1)
    ]  # fmt: skip
    wall = [r.get("wall_s") for _, r in parts]
    return {
        "setup": setup,
        "capacity": capacity,
        "cells": cells,
        "pools": pools,
        "server": server,
        "wall_s": sum(wall) if all(w is not None for w in wall) else None,
    }
