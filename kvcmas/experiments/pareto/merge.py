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
PER_PART = ("machine", "dtype")


def read_parts(dirs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each folder's results.json, checked to be a pareto run (not a serving run's cells)."""
    return common.read_parts(dirs, {"setup", "sizes"}, "kvcmas bench pareto", frozenset({"cells"}))


def merge_runs(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The merged results, shaped as one run's, each row with its ``part`` (1-based)."""
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
    setup.update({key: _common(parts, key) for key in PER_PART})
    setup["parts"] = [
        {"part": i, "dir": d, "wall_s": r.get("wall_s"), "partial": bool(r.get("partial")),
         **{key: r["setup"].get(key) for key in PER_PART},
         "labels": sorted({p["label"] for s in r["sizes"] for p in s["points"]})}
        for i, (d, r) in enumerate(parts, start=1)
    ]  # fmt: skip
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


def _common(parts: list[tuple[str, dict[str, Any]]], key: str) -> Any:
    values = [r["setup"].get(key) for _, r in parts]
    return values[0] if all(v == values[0] for v in values) else "differs per part (see parts)"
