"""The comparison table renders with and without per-hop fidelity figures."""

from __future__ import annotations

from kvcmas.bench.compare import markdown_table


def report(with_fidelity: bool) -> dict:
    m = {
        "reuse_ratio_tokens": 0.5,
        "reuse_ratio_calls": 0.6,
        "recompute_fraction_mean": 0.2,
        "ttft_nonfirst_mean_s": 0.25,
        "ttft_ratio_vs_nonshared": 0.5,
        "peak_state_bytes": 2**20,
        "method_state_bytes": 2048,
        "final_agreement": 0.75,
    }
    if with_fidelity:
        m.update(
            {
                "kv_error_mean": 0.1,
                "kv_error_reused_segments_mean": 0.12,
                "first_token_kl_mean": 0.02,
                "first_token_kl_median": 0.01,
                "continuation_kl_mean": 0.03,
                "same_hop_output_rate": 0.5,
                "by_slot_kind": {
                    "query": {
                        "segments": 3,
                        "reused": 2,
                        "error_reused_mean": 0.1,
                        "error_all_mean": 0.05,
                    }
                },
                "by_segment_length": {"0-31": {"reused": 2, "error_reused_mean": 0.1}},
            }
        )
    setup = {
        "workflow": "roster",
        "requests": 4,
        "model": "m",
        "dtype": "fp32",
        "reference_dtype": "fp32",
        "machine": "x",
        "torch_threads": 2,
    }
    return {"setup": setup, "summary": {"kvcmas": m}}


def test_timing_only_table_leaves_fidelity_cells_empty():
    row = next(
        line for line in markdown_table(report(False)).splitlines() if line.startswith("| kvcmas")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "-" and cells[10] == "0.250" and cells[11] == "0.50"


def test_full_table_has_kind_and_length_rows():
    table = markdown_table(report(True))
    assert "| kvcmas | query | 3 | 2 | 0.1000 | 0.0500 |" in table
    assert "0.1000 (n=2)" in table
