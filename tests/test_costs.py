"""The connector's cost rule (kvcmas.serve.costs): which spans a claim builds, from measured
times. Pure Python: the times are given, as the worker would report them."""

from __future__ import annotations

import pytest

from kvcmas.serve.costs import (
    BuildSample,
    Calibration,
    CostModel,
    EdgeRecord,
    Feedback,
    SpanCost,
    fit_line,
)

MS = 1e-3


def measured(engine_ms: float = 0.3, runtime_ms: float = 0.5, fixed_ms: float = 20.0,
             place_ms: float = 0.01) -> CostModel:  # fmt: skip
    """A model that has seen the engine's steps (``engine_ms`` a token on top of 5 ms a
    step) and a calibration of the connector's runtime."""
    model = CostModel()
    steps = [(n, 5 * MS + engine_ms * MS * n) for n in (1, 1, 64, 512, 1, 2048)]
    model.learn(Feedback(Calibration(runtime_ms * MS, fixed_ms * MS, place_ms * MS), steps))
    return model


def test_fit_line_recovers_slope_and_intercept_and_refuses_one_point():
    a, b = fit_line([(0, 1.0), (10, 21.0), (20, 41.0)])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    assert fit_line([(5, 1.0), (5, 2.0)]) is None and fit_line([(1, 1.0)]) is None


def test_the_engine_cost_is_the_slope_of_its_step_times():
    model = measured(engine_ms=0.3)
    assert model.engine_per_token() == pytest.approx(0.3 * MS)
    assert model.ready and not CostModel().ready


def test_a_long_decode_does_not_crowd_the_prefill_steps_out_of_the_fit():
    model = measured(engine_ms=0.3)
    model.learn(Feedback(steps=[(1, 0.03)] * 200))  # 200 decode steps of 30 ms
    assert model.engine_per_token() == pytest.approx(0.3 * MS, rel=0.05)
    decode_only = CostModel()
    decode_only.learn(Feedback(Calibration(0.5 * MS, 20 * MS, 0.0), [(1, 0.03)] * 10))
    assert decode_only.engine_per_token() is None and not decode_only.ready


def test_nothing_is_built_before_the_costs_are_measured():
    unmeasured = CostModel()
    assert unmeasured.best_span_count(0, 10, [SpanCost(10, 2000, 128)]) == 0
    calibrated_only = CostModel()
    calibrated_only.learn(Feedback(Calibration(0.5 * MS, 20 * MS, 0.01 * MS)))
    assert calibrated_only.best_span_count(0, 10, [SpanCost(10, 2000, 128)]) == 0


def test_a_long_span_with_a_head_is_built_and_a_short_reply_behind_it_is_not():
    model = measured()
    doc, reply = SpanCost(20, 2000, 128), SpanCost(2030, 40, 40)  # reply: all head
    assert model.best_span_count(0, 20, [doc]) == 1
    assert model.best_span_count(0, 20, [doc, reply]) == 1  # the claim ends after the doc


def test_a_span_too_short_to_pay_for_the_build_is_left_to_the_engine():
    model = measured(fixed_ms=20.0)
    # 60 tokens served save 18 ms of the engine's; the build's fixed part is 20 ms
    assert model.best_span_count(0, 0, [SpanCost(0, 188, 128)]) == 0
    assert model.best_span_count(0, 0, [SpanCost(0, 600, 128)]) == 1


def test_a_document_sent_dense_is_left_to_vllm_even_with_a_reply_reusable_behind_it():
    """The gate sent the analyst's document dense on this edge last time: built by the
    connector it would cost more than in vLLM's batch, so the claim ends before it, and the
    short reply behind it is not worth building the document for."""
    model = measured(engine_ms=0.3, runtime_ms=0.5)
    edge = (None, "in:analyst", "critic")
    assert model.predicted_recompute(edge, 1400, 128) == 128  # not reported: the default
    model.learn(Feedback(edges=[EdgeRecord(edge, 1400, 1400)]))
    doc = SpanCost(20, 1400, model.predicted_recompute(edge, 1400, 128))
    assert doc.recomputed == 1400
    reply = SpanCost(1430, 200, 0)  # even served whole
    assert model.best_span_count(0, 20, [doc, reply]) == 0
    # ... even where the engine looks slower than the runtime (a cold first prefill step)
    assert measured(engine_ms=2.0, runtime_ms=0.5).best_span_count(0, 20, [doc, reply]) == 0
    # The worker reports the pool learned: the head rule again, scaled to the length.
    model.learn(Feedback(edges=[EdgeRecord(edge, 1000, 128)]))
    assert model.predicted_recompute(edge, 2000, 0) == 256


def test_private_text_between_spans_counts_as_recomputed():
    model = measured(engine_ms=0.3, runtime_ms=0.5, fixed_ms=0.0)
    near = [SpanCost(10, 300, 0), SpanCost(320, 300, 0)]
    far = [SpanCost(10, 300, 0), SpanCost(2000, 300, 0)]  # 1690 private tokens between
    assert model.best_span_count(0, 10, near) == 2
    assert model.best_span_count(0, 10, far) == 1


def test_builds_slower_than_calibrated_make_the_rule_build_less():
    model = measured(engine_ms=0.3, runtime_ms=0.2, fixed_ms=0.0, place_ms=0.0)
    span = [SpanCost(0, 1000, 900)]  # 100 served: 0.3 s in the engine, 0.18 s calibrated
    assert model.best_span_count(0, 0, span) == 1
    model.learn(Feedback(builds=[BuildSample(900, 1000, 0, 0.54)]))  # 3x the calibration
    assert model.runtime_scale() == pytest.approx(3.0)
    assert model.best_span_count(0, 0, span) == 0


def test_feedback_merges_across_workers_and_snapshot_reports_the_estimates():
    a = Feedback(Calibration(1.0, 2.0, 3.0), [(10, 1.0)])
    b = Feedback(None, [(20, 2.0)], [BuildSample(1, 2, 3, 4.0)])
    merged = a.merge(b)
    assert merged.calibration == a.calibration and len(merged.steps) == 2 and merged.builds
    assert not Feedback() and merged
    snap = measured().snapshot()
    assert snap["ready"] and snap["engine_s_per_token"] == pytest.approx(0.3 * MS)
