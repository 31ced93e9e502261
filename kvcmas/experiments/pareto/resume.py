"""``--resume``: go on with the fidelity pass an earlier run left in ``--out``.

Qwen's fp32 fidelity pass at 128-token outputs takes longer than a session here, and a run
stopped early keeps every point it finished (the partial results.json). Resuming takes those
points as they are and runs the rest: the pass is deterministic (the same documents, knobs
and fp32 reference give the same figures), and final-answer agreement needs only NonShared's
answers, which every fidelity row keeps (with the machine it ran on). What the earlier run
holds must be a fidelity-only run of this workload on the same device, with a subset of this
run's points, so the file this run rewrites loses nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcmas.errors import UsageError
from kvcmas.experiments import common
from kvcmas.experiments.pareto.merge import SAME_WORKLOAD, read_parts
from kvcmas.experiments.pareto.plan import NOISE_FLOOR, Point
from kvcmas.methods import make_method


def finished_points(
    out: Path,
    setup: dict[str, Any],
    points: list[Point],
    n_layers: int,
    floor: bool,
    floor_gemm: str | None,
) -> dict[int, dict[str, dict[str, Any]]]:
    """Per size, label -> fidelity summary of each point the run in ``out`` finished; empty
    when ``out`` holds no run yet. ``floor``: this run has the noise floor, its GEMMs in
    ``floor_gemm`` where wider than bf16. Refuses, naming the difference, a run this one
    would not reproduce or would partly overwrite."""
    if not (out / "results.json").is_file():
        return {}
    (_, earlier), = read_parts([str(out)])  # fmt: skip
    try:
        this_run = ("this run", {"setup": setup})
        common.check_same_setup([(str(out), earlier), this_run], (*SAME_WORKLOAD, "device"))
    except UsageError as e:
        message = f"--resume: {out} holds another workload ({e}); give another --out"
        raise UsageError(message) from None
    if any(row.get("timing") is not None for s in earlier["sizes"] for row in s["points"]):
        raise UsageError(
            f"--resume: {out} holds timing figures, which a fidelity pass would drop; "
            "give another --out"
        )
    planned = {p.label: p for p in points}
    if floor:
        planned[NOISE_FLOOR] = Point("nonshared", dtype="bf16")
    done: dict[int, dict[str, dict[str, Any]]] = {}
    for size in earlier["sizes"]:
        extra = [r["label"] for r in size["points"] if r["label"] not in planned]
        if size["size"] not in setup["sizes"] or extra:
            what = ", ".join(extra) or f"size {size['size']}"
            raise UsageError(
                f"--resume: {out} has {what}, which this run does not plan and would drop; "
                "plan it too or give another --out"
            )
        done[size["size"]] = {
            r["label"]: _checked(r, planned[r["label"]], n_layers, floor_gemm)
            for r in size["points"]
        }  # fmt: skip
    return done


def _checked(row: dict[str, Any], point: Point, n_layers: int, floor_gemm: str | None) -> dict:
    """A finished row's fidelity, if this run would have computed the same."""
    fid = row["fidelity"]
    if "final_answers" not in fid:
        raise UsageError(
            f"--resume: {row['label']} was run by a version that kept no final answers; "
            "give another --out"
        )
    method = make_method(point.method, point.options)
    if hasattr(method, "resolve"):  # a layer block given as "default" until the model is known
        method.resolve(n_layers)
    params = _json(method.params())
    if _json(fid.get("params")) != params:
        raise UsageError(
            f"--resume: {row['label']} ran with {fid.get('params')}, this version's point has "
            f"{params}; give another --out"
        )
    if row["label"] == NOISE_FLOOR and fid.get("gemm_dtype") != floor_gemm:
        raise UsageError(
            f"--resume: the noise floor ran with GEMMs in {fid.get('gemm_dtype') or 'bf16'}, "
            f"this run's in {floor_gemm or 'bf16'}; match --floor-gemm"
        )
    return fid


def _json(value: Any) -> Any:
    """``value`` as it reads back from a results.json (tuples as lists)."""
    return json.loads(json.dumps(value, default=str))
