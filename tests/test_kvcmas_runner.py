"""KVCMAS through the real Runner on the real default model, and the run summary on a real
run: the places where the headline method and its headline figures could go wrong unseen."""

from __future__ import annotations

import pytest
import torch

from kvcmas.chat import tokenize
from kvcmas.eval.fidelity import FidelityObserver
from kvcmas.eval.summary import add_ratios, agreement, run_summary
from kvcmas.methods import make_method
from kvcmas.workflow.runner import Runner
from kvcmas.workflow.spec import AgentSpec, Workflow

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "Which gas do plants absorb from the air?",
    "What is the boiling point of water at sea level in Celsius?",
    "How many legs does a spider have?",
]
PREFIX = "Answer:"


def chain() -> Workflow:
    """Three hops: the scout's reply opens with a reply prefix and is read by both later
    agents; the query is read by all three."""
    return Workflow(
        "chain3",
        (
            AgentSpec(
                "scout", "You are a scout.", "Question:\n{query}\n\nReply briefly.", 6, PREFIX
            ),
            AgentSpec(
                "critic",
                "You are a strict critic.",
                "Question:\n{query}\n\nThe scout wrote:\n{scout}\n\nCheck it.",
                6,
            ),
            AgentSpec(
                "judge",
                "You decide.",
                "Question:\n{query}\n\nScout:\n{scout}\n\nCritic:\n{critic}\n\nDecide.",
                6,
            ),
        ),
        final="judge",
    )


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def slots(hop) -> dict[str, dict]:
    return {s["slot"]: s for s in hop.segments if s.get("slot")}


def test_kvcmas_chains_agent_outputs_from_the_decode_cache(real_model):
    kv = make_method("kvcmas", tau=2.0, min_anchors=1)  # reuse once a pool has an anchor
    runner = Runner(real_model, chain(), kv, observer=FidelityObserver(real_model))
    first, second = (runner.run({"query": q}) for q in QUESTIONS[:2])

    # Request 1: every pool is empty, so every shared segment is prefilled densely and
    # recorded; the runner's flush built the anchors after the request.
    assert {s["decision"] for h in first.hops for s in slots(h).values()} == {"dense"}
    assert kv.background.pending() == 0
    assert set(kv.pools) == {
        ("query", "critic"),
        ("query", "judge"),
        ("scout", "critic"),
        ("scout", "judge"),
        ("critic", "judge"),
    }
    assert all(len(p.anchors) == 1 for p in kv.pools.values())
    assert first.background_s > 0 and first.cpu_s > 0

    # Request 2: the query is dense at its first consumer (exact), then chained; the scout's
    # reply (reply prefix included) comes from the scout's own decode cache at the critic,
    # and from the critic's corrected cache at the judge.
    scout, critic, judge = second.hops
    assert slots(scout)["query"]["decision"] == "dense"
    assert scout.fidelity["kv_rel_error"] < 1e-5  # the first hop is exact
    prefix_len = len(tokenize(real_model.tokenizer, PREFIX))
    assert slots(critic)["scout"]["length"] == prefix_len + scout.output_tokens
    assert slots(critic)["scout"]["details"]["source"] == "scout"
    assert slots(critic)["query"]["details"]["source"] == "scout"
    assert slots(judge)["scout"]["details"]["source"] == "critic"
    assert slots(judge)["query"]["details"]["source"] == "critic"
    assert slots(judge)["critic"]["details"]["source"] == "critic"
    for hop in (critic, judge):
        assert {s["decision"] for s in slots(hop).values()} == {"reuse"}
        assert hop.rho == 1.0 and hop.recompute_fraction == 0.0
        assert 0 < hop.fidelity["kv_rel_error"] < 0.5  # corrected, not exact, not garbage


def test_kvcmas_at_tau_zero_is_nonshared_through_the_runner(real_model):
    observer = FidelityObserver(real_model)
    kv = Runner(real_model, chain(), make_method("kvcmas", tau=0.0), observer=observer)
    ns = Runner(real_model, chain(), make_method("nonshared"))
    for q in QUESTIONS[:2]:
        a, b = kv.run({"query": q}), ns.run({"query": q})
        assert [h.output_ids for h in a.hops] == [h.output_ids for h in b.hops]
        assert all(h.fidelity["kv_rel_error"] < 1e-5 for h in a.hops)
        assert all(h.rho == 0.0 and h.recompute_fraction == 1.0 for h in a.hops)


def test_run_summary_figures_on_a_real_run(real_model):
    """Every headline ratio from run_summary/add_ratios equals the same figure computed by
    hand from the hop records of a real run."""
    requests = [{"query": q} for q in QUESTIONS]
    runs = {
        name: list(Runner(real_model, chain(), make_method(name)).run_stream(requests))
        for name in ("nonshared", "fullshared")
    }
    summaries = {name: run_summary(results) for name, results in runs.items()}
    add_ratios(summaries)
    ns, fs = summaries["nonshared"], summaries["fullshared"]

    later = {n: [h for r in res for h in r.hops[1:]] for n, res in runs.items()}
    every = {n: [h for r in res for h in r.hops] for n, res in runs.items()}

    def avg(xs):
        return sum(xs) / len(xs)

    assert fs["ttft_later_ratio"] == pytest.approx(
        avg([h.ttft_s for h in later["fullshared"]]) / avg([h.ttft_s for h in later["nonshared"]])
    )
    assert fs["ttft_all_ratio"] == pytest.approx(
        avg([h.ttft_s for h in every["fullshared"]]) / avg([h.ttft_s for h in every["nonshared"]])
    )
    assert fs["latency_ratio"] == pytest.approx(
        avg([r.latency_s for r in runs["fullshared"]])
        / avg([r.latency_s for r in runs["nonshared"]])
    )
    assert fs["compute_s"] == pytest.approx(sum(r.cpu_s for r in runs["fullshared"]))
    assert ns["ttft_later_ratio"] == 1.0

    # rho: NonShared serves nothing; FullShared serves every shared token after its first
    # consumer, so over all hops it is exactly the share of shared tokens not read first.
    assert ns["rho_all"] == 0.0 and ns["recompute_all"] == 1.0
    assert fs["rho_later"] == 1.0 and fs["recompute_later"] == 0.0
    shared = [s for h in every["fullshared"] for s in h.segments if s.get("slot")]
    served = sum(s["length"] for s in shared if s["decision"] == "reuse")
    assert fs["rho_all"] == pytest.approx(served / sum(s["length"] for s in shared))
    assert 0 < fs["rho_all"] < 1  # hop 1's dense query is counted
    for r in runs["fullshared"]:  # a request's latency holds all its hops' TTFT
        assert r.latency_s >= sum(h.ttft_s for h in r.hops)
    same = sum(a.final_answer == b.final_answer for a, b in zip(*runs.values(), strict=True))
    assert agreement(runs["fullshared"], runs["nonshared"]) == same / len(requests)
