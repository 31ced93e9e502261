"""One pareto report from runs made separately (``kvcmas bench pareto --merge DIR...``).

A run over every method does not fit one session here, so methods are run as parts (each with
its own NonShared) and committed one by one; merging them draws every method's frontier on one
plot per size. The parts must share the workload (:data:`SAME_WORKLOAD`: the same documents,
trace and fidelity reference), so fidelity figures compare across parts; a speedup is a ratio
to its own part's NonShared, so it compares across parts only as far as the parts' machines
and code agree, which is why every row names its part. NonShared and the noise floor are
taken from the first part that has them (the fidelity pass is deterministic); any other point
in two parts is an error, not an overwrite, unless one part measured only its fidelity
(``--no-timing``) and the other only its timing (``--no-fidelity``): the two halves are joined
into one row, named ``F+T`` after its fidelity part and its timing part. That lets the long
fp32 fidelity pass run on any host and the short timing pass where the timing dtype is fast.

``--timing-from DIR`` re-times every point on one machine: DIR is a ``--no-fidelity`` part of
the points, the other parts give only their fidelity (their own timings are dropped), so every
speedup of the report is a ratio measured on one host in one dtype.
"""

from __future__ import annotations

from typing import Any

from kvcmas.errors import UsageError
from kvcmas.experiments import common
from kvcmas.experiments.pareto.report import REFERENCES

SAME_WORKLOAD = (
    "model", "agents", "output_tokens", "warmup_requests", "measured_requests", "source", "split",
)  # fmt: skip
# Kept per part: where and in what dtype it was timed (fidelity is always fp32; a part run
# with --no-timing adds fidelity rows only).
PER_PART = ("machine", "dtype", "timing_order")


def read_parts(dirs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each folder's results.json, checked to be a pareto run (not a serving run's cells)."""
    return common.read_parts(dirs, {"setup", "sizes"}, "kvcmas bench pareto", frozenset({"cells"}))


def merge_runs(
    parts: list[tuple[str, dict[str, Any]]], timing: tuple[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The merged results, shaped as one run's, each row with its ``part`` (1-based);
    ``timing``: a timing-only part that gives every point's timing (it is the last part)."""
    if timing is not None:
        parts = [*(_fidelity_only(d, r) for d, r in parts), _timing_only(*timing)]
    common.check_same_setup(parts, SAME_WORKLOAD)
    first = parts[0][1]
    by_size: dict[int, list[dict[str, Any]]] = {}
    seen: dict[tuple[int, str], tuple[str, int]] = {}  # (size, label): (folder, row index)
    for i, (d, r) in enumerate(parts, start=1):
        for size in r["sizes"]:
            rows = by_size.setdefault(size["size"], [])
            for row in size["points"]:
                key = (size["size"], row["label"])
                if key in seen:
                    earlier, at = seen[key]
                    joined = join_halves(rows[at], {**row, "part": i})
                    if joined is not None:
                        rows[at] = joined
                    elif row["method"] not in REFERENCES:
                        raise UsageError(
                            f"{row['label']} at N={size['size']} is in both {earlier} and {d}: "
                            "merge one of them"
                        )
                    continue
                seen[key] = (d, len(rows))
                rows.append({**row, "part": i})
    setup = {**first["setup"], "sizes": sorted(by_size)}
    setup.update({key: v for key in PER_PART if (v := _common(parts, key)) is not None})
    setup["parts"] = [
        {"part": i, "dir": d, "wall_s": r.get("wall_s"), "partial": bool(r.get("partial")),
         **{key: r["setup"].get(key) for key in PER_PART},
         "labels": sorted({p["label"] for s in r["sizes"] for p in s["points"]})}
        for i, (d, r) in enumerate(parts, start=1)
    ]  # fmt: skip
    if timing is not None:  # one timing for all: the report names its machine and dtype
        t = timing[1]["setup"]
        setup.update(machine=t["machine"], dtype=f"fidelity fp32, {_timing_dtype(t)}",
                     timing_part=len(parts))  # fmt: skip
        setup.pop("timing_order", None)  # the order of the timing used, none other
        if "timing_order" in t:
            setup["timing_order"] = t["timing_order"]
    wall = [r.get("wall_s") for _, r in parts]
    return {
        "setup": setup,
        "capped": {k: v for _, r in parts for k, v in (r.get("capped") or {}).items()},
        "sizes": [{"size": s, "points": rows} for s, rows in sorted(by_size.items())],
        "wall_s": sum(wall) if all(w is not None for w in wall) else None,
    }


# A row's timing figures; the rest of a joined row comes from its fidelity half.
TIMING_FIELDS = ("ttft_speedup_later", "e2e_speedup", "compute_ratio", "timing")


def join_halves(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """One row from a fidelity-only and a timing-only row of the same point, or None when the
    two rows are not such halves (both measured fidelity, or both timing)."""
    halves = {_only_pass(a): a, _only_pass(b): b}
    if set(halves) != {"fidelity", "timing"}:
        return None
    fid, tim = halves["fidelity"], halves["timing"]
    return {
        **fid,
        **{k: tim[k] for k in TIMING_FIELDS},
        "params": fid.get("params") or tim.get("params"),
        "part": f"{fid['part']}+{tim['part']}",
    }


def _only_pass(row: dict[str, Any]) -> str | None:
    """'fidelity' or 'timing' for a row with only that pass's figures, else None."""
    if row.get("timing") is None and row.get("fidelity") is not None:
        return "fidelity"
    if row.get("fidelity") is None and row.get("timing") is not None:
        return "timing"
    return None


def _fidelity_only(d: str, results: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A part with its timing figures dropped, and its rows with no fidelity left out."""
    sizes = [
        {**size, "points": [{**row, **dict.fromkeys(TIMING_FIELDS)}
                            for row in size["points"] if row.get("fidelity") is not None]}
        for size in results["sizes"]
    ]  # fmt: skip
    return d, {**results, "sizes": sizes}


def _timing_only(d: str, results: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``--timing-from`` part, checked to be a ``--no-fidelity`` run."""
    if any(row.get("fidelity") is not None for s in results["sizes"] for row in s["points"]):
        raise UsageError(f"--timing-from {d}: not a timing-only run (run it with --no-fidelity)")
    return d, results


def _timing_dtype(setup: dict[str, Any]) -> str:
    """'timing bf16' from a run's dtype field ('fidelity none, timing bf16')."""
    return setup["dtype"].rsplit(", ", 1)[-1]


def _common(parts: list[tuple[str, dict[str, Any]]], key: str) -> Any:
    values = [r["setup"].get(key) for _, r in parts]
    return values[0] if all(v == values[0] for v in values) else "differs per part (see parts)"
