"""The comparison table: every figure comes from the one run summary, TTFT sits beside
latency and compute, and each figure is given for all hops and for hops 2+."""

from __future__ import annotations

import pytest

from kvcmas.eval.summary import add_ratios, run_summary
from kvcmas.experiments.compare import markdown_table
from tests.fake_runs import fake_run

SETUP = {"workflow": "roster", "requests": 2, "model": "m", "dtype": "fp32",
         "reference_dtype": "none (timing run)", "machine": "x"}  # fmt: skip


def report() -> dict:
    summaries = {
        "nonshared": run_summary(fake_run(1.0, latency=10.0, cpu=20.0, served=0, requests=2)),
        # Faster to the first token on hops 2+, slower end to end: the table must show both.
        "kvcmas": run_summary(fake_run(0.5, latency=12.0, cpu=26.0, served=80, requests=2)),
    }
    add_ratios(summaries)
    return {"setup": SETUP, "summary": summaries}


def row(table: str, label: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_row_gives_all_hops_and_hops_two_plus_with_costs_beside_ttft():
    table = markdown_table(report())
    header = row(table, "method")
    cells = dict(zip(header, row(table, "kvcmas"), strict=True))
    # 4 hops per request: hop 1 dense (100 tokens), hops 2-4 serve 80 of 100 each.
    assert cells["rho"] == f"{240 / 400:.2f} / 0.80"
    assert cells["recompute"] == f"{(400 + 3 * 80) / 1600:.2f} / 0.20"
    assert cells["TTFT s"] == f"{(1 + 3 * 0.5) / 4:.3f} / 0.500"
    assert cells["TTFT / NS"] == f"{(1 + 1.5) / 4:.2f} / 0.50"
    assert cells["latency s (/NS)"] == "12.000 (1.20)"  # slower end to end, shown beside
    assert cells["compute s (/NS)"] == "52.0 (1.30)"
    assert cells["KV err"] == "- / -"  # a timing run has no fidelity figures


def test_nonshared_row_is_its_own_baseline():
    cells = row(markdown_table(report()), "nonshared")
    assert cells[1] == "0.00 / 0.00" and cells[2] == "1.00 / 1.00"
    assert "1.00 / 1.00" in cells and "10.000 (1.00)" in cells


def test_ratio_needs_the_baseline():
    summaries = {"kvcmas": run_summary(fake_run(0.5, latency=1.0, cpu=1.0, served=80))}
    add_ratios(summaries)  # no nonshared run: no ratio is invented
    assert "ttft_later_ratio" not in summaries["kvcmas"]
    assert summaries["kvcmas"]["rho_later"] == pytest.approx(0.8)


def test_segment_error_sections_only_with_fidelity():
    timing = markdown_table(report())
    assert "by slot kind" not in timing and "by segment length" not in timing
    with_fidelity = report()
    with_fidelity["summary"]["kvcmas"].update(
        by_slot_kind={"query": {"segments": 3, "reused": 2, "error_reused_mean": 0.1,
                                "error_all_mean": 0.05}},
        by_segment_length={"0-31": {"reused": 2, "error_reused_mean": 0.1}},
    )  # fmt: skip
    table = markdown_table(with_fidelity)
    assert "| kvcmas | query | 3 | 2 | 0.1000 | 0.0500 |" in table
    assert "0.1000 (n=2)" in table


def test_kept_corrections_are_counted_on_later_hops_only():
    run = fake_run(0.5, latency=1.0, cpu=1.0, served=80)
    hops = run[0].hops
    checked = {"kind": "input", "decision": "partial"}
    hops[0].segments = [{**checked, "details": {"correction_kept": True}}]  # hop 1: not counted
    hops[1].segments = [{**checked, "details": {"correction_kept": True}}]
    hops[2].segments = [{**checked, "details": {"correction_kept": False}},
                        {"kind": "private", "decision": "dense"}]  # fmt: skip
    hops[3].segments = [{**checked, "details": {"correction_kept": False}}]
    s = run_summary(run)
    assert s["corrections_checked_later"] == 3
    assert s["corrections_kept_later"] == pytest.approx(1 / 3)
    assert "corrections_kept_later" not in run_summary(fake_run(0.5, 1.0, 1.0, 80))
