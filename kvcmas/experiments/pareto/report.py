"""Frontiers, the table and the plots of a pareto run.

A method's frontier is its points that no other point of the same method beats on both axes
(at least as fast and at most as far from NonShared, strictly better on one). Speed is the
TTFT speedup of hops 2+ over NonShared (and, in a second panel, the end-to-end speedup);
distance is the first-token KL against fp32 NonShared. Method A is on or above method B where
every point of B has a point of A at least as fast and at most as far; the report says, per
size and axis, which of each other method's points KVCMAS's points do not cover.

A third axis, reuse (the share of hops 2+'s token-layer pairs not run: 1 - recompute), is
known for every point, a fidelity-only part's included, and compares on any host; it counts no
work outside those pairs (matching, correction, a scoring probe), so only the speed axes weigh
such costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcmas.experiments import common
from kvcmas.experiments.compare import floor_gemm_phrase, fmt
from kvcmas.experiments.pareto.plan import NOISE_FLOOR

REUSE = "reuse_later"  # 1 - recompute_later, derived in add_frontiers
AXES = (
    ("ttft_speedup_later", "TTFT speedup, hops 2+"),
    ("e2e_speedup", "end-to-end speedup"),
    (REUSE, "reuse (pairs not run), hops 2+"),
)
DISTANCE = "first_token_kl"
HEADLINE = "kvcmas"
REFERENCES = ("nonshared", NOISE_FLOOR)  # the exact reference and the noise floor: not methods


def as_good(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Point ``a`` (speed, distance) is at least as fast as ``b`` and at most as far."""
    return a[0] >= b[0] and a[1] <= b[1]


def frontier(points: Sequence[tuple[float | None, float | None]]) -> list[int]:
    """Indices of the points (speed: higher is better, distance: lower is better) that no
    other point dominates, fastest first; points missing a coordinate are never on it."""
    ok = [i for i, (x, y) in enumerate(points) if x is not None and y is not None]
    keep = []
    for i in ok:
        beaten = any(as_good(points[j], points[i]) and points[j] != points[i] for j in ok)
        if not beaten:
            keep.append(i)
    return sorted(keep, key=lambda i: -points[i][0])


def frontiers(rows: list[dict[str, Any]], axis: str) -> dict[str, list[str]]:
    """Per method: labels of its frontier points on ``axis`` against the first-token KL."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        idx = frontier([(r[axis], r[DISTANCE]) for r in mine])
        if idx:
            out[method] = [mine[i]["label"] for i in idx]
    return out


def _methods(rows: list[dict[str, Any]]) -> list[str]:
    """The methods of ``rows`` in order, the references (NonShared, the noise floor) aside."""
    return [m for m in dict.fromkeys(r["method"] for r in rows) if m not in REFERENCES]


def _placed(rows: list[dict[str, Any]], axis: str) -> list[dict[str, Any]]:
    return [r for r in rows if r[axis] is not None and r[DISTANCE] is not None]


def uncovered(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], axis: str) -> list[str]:
    """Labels of ``theirs`` that no point of ``mine`` matches, at least as fast on ``axis`` and
    at most as far; an empty list means ``mine`` is on or above ``theirs``."""
    pts = [(r[axis], r[DISTANCE]) for r in _placed(mine, axis)]
    return [
        r["label"]
        for r in _placed(theirs, axis)
        if not any(as_good(p, (r[axis], r[DISTANCE])) for p in pts)
    ]


def headline_against(rows: list[dict[str, Any]], axis: str) -> dict[str, list[str]]:
    """Per other method (references aside) with points on ``axis``: its points KVCMAS's
    points do not cover. A method with no timed point gets no verdict (not a vacuous one)."""
    mine = [r for r in rows if r["method"] == HEADLINE]
    if not _placed(mine, axis):
        return {}
    others = {m: [r for r in rows if r["method"] == m] for m in _methods(rows) if m != HEADLINE}
    return {m: uncovered(mine, theirs, axis) for m, theirs in others.items()
            if _placed(theirs, axis)}  # fmt: skip


def within_floor(rows: list[dict[str, Any]], axis: str) -> dict[str, str]:
    """Per method: its fastest point on ``axis`` whose first-token KL is at most the noise
    floor's (the rule that picks a default on the calibration split); no entry where no point
    is within it, nothing without a noise floor."""
    floor = next((r for r in rows if r["label"] == NOISE_FLOOR), None)
    if floor is None or floor[DISTANCE] is None:
        return {}
    out = {}
    for method in _methods(rows):
        ok = [
            r for r in _placed(rows, axis)
            if r["method"] == method and r[DISTANCE] <= floor[DISTANCE]
        ]  # fmt: skip
        if ok:
            out[method] = max(ok, key=lambda r: r[axis])["label"]
    return out


def add_frontiers(results: dict[str, Any]) -> None:
    for size in results["sizes"]:
        rows = size["points"]
        for r in rows:  # derived here, so that parts saved before the axis existed get it too
            done = r.get("recompute_later")
            r[REUSE] = None if done is None else 1.0 - done
        size["frontiers"] = {axis: frontiers(rows, axis) for axis, _ in AXES}
        size["kvcmas_against"] = {axis: headline_against(rows, axis) for axis, _ in AXES}
        size["within_floor"] = {axis: within_floor(rows, axis) for axis, _ in AXES}


def _against_lines(size: dict[str, Any]) -> list[str]:
    lines = []
    for axis, name in AXES:
        verdicts = [
            f"{m} {'on or above' if not left else 'not covered: ' + ', '.join(left)}"
            for m, left in size.get("kvcmas_against", {}).get(axis, {}).items()
        ]
        if verdicts:
            lines.append(f"* KVCMAS against each method on {name} and KL: {'; '.join(verdicts)}.")
    chosen = size.get("within_floor", {}).get(AXES[0][0], {})
    if chosen:
        picks = "; ".join(f"{m}: {label}" for m, label in chosen.items())
        lines.append(f"* Fastest point (TTFT 2+) within the noise floor's first-token KL: {picks}.")
    return [""] + lines if lines else []


COLUMNS = (
    "| point | rho 2+ | recompute 2+ | TTFT speedup 2+ | e2e speedup | compute / NS "
    "| KL first 2+ | KL cont. 2+ | final agree | frontier |"
)


def _row(r: dict[str, Any], on: set[str], merged: bool) -> str:
    return (
        f"| {r['label']} | {fmt(r['rho_later'], '.2f')} | {fmt(r['recompute_later'], '.2f')}"
        f" | {fmt(r['ttft_speedup_later'], '.2f')} | {fmt(r['e2e_speedup'], '.2f')}"
        f" | {fmt(r['compute_ratio'], '.2f')} | {fmt(r['first_token_kl'], '.5f')}"
        f" | {fmt(r['continuation_kl'], '.5f')} | {fmt(r['final_agreement'], '.2f')}"
        f" | {'yes' if r['label'] in on else ''} |" + (f" {r['part']} |" if merged else "")
    )


def _parts_lines(setup: dict[str, Any]) -> list[str]:
    """A merged report's parts: where each came from. Speedups are ratios to a part's own
    NonShared; fidelity figures compare across parts (same documents, deterministic)."""
    retimed = (
        f"; every timing is part {setup['timing_part']}'s (`--timing-from`: one machine and "
        "dtype), the other parts' own timings are not used" if "timing_part" in setup else ""
    )
    lines = ["", "Parts merged into this report (`kvcmas bench pareto --merge`); a speedup is "
             "a ratio to its own part's NonShared timing; a row of part F+T joins part F's "
             f"fidelity with part T's timing of the same point{retimed}:", ""]
    for p in setup["parts"]:
        wall = f", {p['wall_s'] / 60:.0f} min" if p.get("wall_s") else ""
        wall += ", stopped early: what it finished" if p.get("partial") else ""
        lines.append(f"* part {p['part']}: `{p['dir']}` ({p['dtype']}; {p['machine']}{wall})")
    return lines


def _floor_gemm_text(results: dict[str, Any]) -> str:
    wide = {
        (r.get("fidelity") or {}).get("gemm_dtype")
        for size in results["sizes"] for r in size["points"] if r["label"] == NOISE_FLOOR
    } - {None}  # fmt: skip
    phrase = floor_gemm_phrase(wide)
    return f", its {phrase}" if phrase else ""


def markdown(results: dict[str, Any]) -> str:
    s = results["setup"]
    lines = [
        f"# Pareto: speed against fidelity, {s['agents']}-agent trace on a shared document",
        "",
        *common.setup_lines(s),
        "",
        f"Workload: every agent reads the shared document of N tokens (cut from {s['source']} "
        "questions) and every earlier agent's output; outputs are exactly "
        f"{s['output_tokens']} tokens (end-of-turn ignored). {s['measured_requests']} measured "
        f"requests per size; methods with state ran {s['warmup_requests']} warm-up requests on "
        "other documents first. Fidelity (KL, agreement, rho, recompute) is measured with the "
        "methods in fp32 against NonShared in fp32, over hops 2+; speedups come from a separate "
        "timing pass and are NonShared's time over the point's (above 1 is faster). The noise "
        f"floor is NonShared in bf16{_floor_gemm_text(results)} (dense work: its speed is the "
        "timing pass's NonShared point). Frontier: not beaten "
        "on both TTFT speedup and first-token KL by another point of the same method. Reuse "
        "(1 - recompute 2+), the third axis, is known for every point and host-independent, "
        "but counts no work outside the recomputed pairs (matching, correction, a scoring "
        "probe): only the speedups weigh those.",
    ]
    if results.get("partial"):
        lines += ["", "**Partial: what is finished so far** (the run is still going, or "
                  "stopped early): the fidelity pass's finished points, the timing pass's "
                  "finished rounds of every point; a figure not measured shows `-`."]  # fmt: skip
    merged = "parts" in s
    if merged:
        lines += _parts_lines(s)
    header = COLUMNS + (" part |" if merged else "")
    for size in results["sizes"]:
        on = {lb for labels in size["frontiers"][AXES[0][0]].values() for lb in labels}
        lines += ["", f"## N = {size['size']} tokens", "", header, "|---" * (10 + merged) + "|"]
        lines += [_row(r, on, merged) for r in size["points"]]
        lines += _against_lines(size)
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> None:
    """``pareto_<size>.png`` per size: each method's frontier (lines) over all its points
    (markers), first-token KL against TTFT speedup (hops 2+), end-to-end speedup and reuse.
    A size with no point placed on any panel (a timing-only run has no KL) gets no plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["setup"]
    for size in results["sizes"]:
        rows = size["points"]
        if not any(_placed(rows, axis) for axis, _ in AXES):
            continue
        # One colour per method in every panel, though a panel draws only its placed methods.
        colour = {m: f"C{i % 10}" for i, m in enumerate(dict.fromkeys(r["method"] for r in rows))}
        fig, axes = plt.subplots(1, len(AXES), figsize=(5.6 * len(AXES), 4.6), squeeze=False)
        for ax, (axis, xlabel) in zip(axes[0], AXES, strict=True):
            drawn = False
            for method, labels in frontiers(rows, axis).items():
                mine = [r for r in rows if r["method"] == method]
                # a point timed but not measured for fidelity (a --timing-from row) has no KL
                pts = [(r[axis], max(r[DISTANCE], 1e-8)) for r in _placed(mine, axis)]
                line = [next(r for r in mine if r["label"] == lb) for lb in labels]
                xy = [(r[axis], max(r[DISTANCE], 1e-8)) for r in line]
                c = colour[method]
                ax.plot(*zip(*xy, strict=True), marker="o", color=c, label=method)
                ax.scatter(*zip(*pts, strict=True), color=c, alpha=0.35, s=14)
                drawn = True
            ax.set_xlabel(xlabel if axis == REUSE else f"{xlabel} over NonShared")
            ax.set_ylabel("first-token KL vs fp32 NonShared (hops 2+)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if drawn:
                ax.legend(fontsize=7)
        fig.suptitle(
            f"{s['model']}, N = {size['size']} tokens, {s['dtype']}, {s['machine']}", fontsize=9
        )
        fig.tight_layout()
        fig.savefig(out / f"pareto_{size['size']}.png", dpi=110)
        plt.close(fig)
