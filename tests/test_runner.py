"""The workflow runner on the real model: NonShared is dense generation, FullShared reuses,
fidelity is measured against the exact reference; request files; the ``kvcmas run`` CLI.

Workflows here are tiny (2-3 agents, a few new tokens) and every model run happens once per
module, in fixtures shared by the tests that inspect it. Torch runs on one thread here: on a
shared, loaded 2-core machine two OpenMP threads make each attention call ~1000x slower.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcmas.chat import render_segments, tokenize
from kvcmas.errors import WorkflowError
from kvcmas.eval.fidelity import MEMO_BYTES, FidelityObserver, ReferenceHop, ReferenceMemo
from kvcmas.methods import make_method
from kvcmas.methods.fullshared import FullShared
from kvcmas.methods.nonshared import NonShared
from kvcmas.model.generate import greedy_decode, stop_ids
from kvcmas.workflow.runner import Runner, read_requests
from kvcmas.workflow.spec import AgentSpec, Workflow

QUESTION = "A farmer has 17 sheep and all but 9 run away. How many sheep does he have left?"
BUDGET = 4


def three_roles() -> Workflow:
    """A chain with distinct role prompts: later hops reuse the query and earlier outputs."""
    return Workflow(
        name="three-roles",
        agents=(
            AgentSpec(
                "analyst",
                "You are a precise analyst.",
                "Question:\n{query}\n\nState the key facts in one sentence.",
                BUDGET,
            ),
            AgentSpec(
                "solver",
                "You are a careful problem solver who reasons step by step.",
                "Question:\n{query}\n\nThe analyst wrote:\n{analyst}\n\nAnswer the question.",
                BUDGET,
            ),
            AgentSpec(
                "judge",
                "You are the final decision maker.",
                "Question:\n{query}\n\nNotes:\n{analyst}\n\nProposed answer:\n{solver}\n\n"
                "Give the final answer.",
                BUDGET,
            ),
        ),
        final="judge",
    )


def same_prefix() -> Workflow:
    """Two agents whose text before the shared query is identical: reuse is exact there."""
    system = "You are a helpful assistant."
    return Workflow(
        name="same-prefix",
        agents=(
            AgentSpec("first", system, "Question:\n{query}\n\nAnswer briefly.", BUDGET),
            AgentSpec("second", system, "Question:\n{query}\n\nExplain your answer.", BUDGET),
        ),
        final="second",
    )


class SpyNonShared(NonShared):
    """NonShared that keeps every hop it was asked to build."""

    def __init__(self) -> None:
        super().__init__()
        self.hops = []

    def build(self, hop, model, cache):
        self.hops.append(hop)
        return super().build(hop, model, cache)


class SpyFullShared(FullShared):
    def __init__(self) -> None:
        super().__init__()
        self.hops = []

    def build(self, hop, model, cache):
        self.hops.append(hop)
        return super().build(hop, model, cache)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(loaded, workflow, method, reference=None, query=QUESTION):
    """One request; with a reference, every hop's fidelity and NonShared's final answer on
    the reference model (what ``kvcmas run --compare`` reports)."""
    observer = FidelityObserver(reference) if reference is not None else None
    result = Runner(loaded, workflow, method, observer=observer).run({"query": query})
    if reference is not None:
        ref = Runner(reference, workflow, NonShared()).run({"query": query})
        result.reference_final_answer = ref.final_answer
    return result


@pytest.fixture(scope="module")
def nonshared_roles(real_model):
    method = SpyNonShared()
    return run(real_model, three_roles(), method, reference=real_model), method.hops


@pytest.fixture(scope="module")
def fullshared_roles(real_model):
    method = SpyFullShared()
    return run(real_model, three_roles(), method, reference=real_model), method.hops


@pytest.fixture(scope="module")
def same_prefix_run(real_model):
    return run(real_model, same_prefix(), FullShared(), reference=real_model)


def slot_tokens(loaded, hops) -> dict[str, tuple[int, ...]]:
    """What each slot holds in a request: the query's tokens and each agent's output ids."""
    tokens = {"query": tokenize(loaded.tokenizer, QUESTION)}
    tokens.update({h.agent: tuple(h.output_ids) for h in hops})
    return tokens


# ---------------------------------------------------------------- NonShared is dense


@pytest.mark.real_model
def test_nonshared_hops_equal_plain_dense_generation(real_model, nonshared_roles):
    result, spied = nonshared_roles
    workflow, model = three_roles(), real_model.model
    slots = slot_tokens(real_model, result.hops)
    assert [h.agent for h in result.hops] == list(workflow.order)
    for hop, built in zip(result.hops, spied, strict=True):
        spec = workflow.agent(hop.agent)
        segments = render_segments(real_model.tokenizer, spec.system, spec.prompt, slots)
        tokens = [t for s in segments for t in s.tokens]
        assert built.tokens == tokens  # the runner's Hop is exactly this token sequence
        assert hop.prompt_tokens == len(tokens)
        cache = model.new_cache(capacity=len(tokens) + BUDGET + 1)
        logits = model.prefill(tokens, cache)  # from scratch, no prefix cache, one shot
        dense = greedy_decode(model, cache, logits, BUDGET, stop_ids(real_model))
        assert hop.output_ids == dense.tokens, hop.agent
        assert hop.output_tokens == len(dense.tokens) > 0
        assert hop.output == real_model.tokenizer.decode(dense.tokens, skip_special_tokens=True)
    assert result.final_answer == result.hops[-1].output


@pytest.mark.real_model
def test_nonshared_reuses_nothing_and_recomputes_everything(nonshared_roles):
    result, _ = nonshared_roles
    for hop in result.hops:
        assert hop.reuse.served_tokens == 0
        assert hop.recompute_fraction == 1.0
        assert hop.prefix_tokens > 0  # the system prompt comes from the prefix cache
        assert hop.prefilled_tokens == hop.prompt_tokens - hop.prefix_tokens
        assert all(s["decision"] == "dense" for s in hop.segments)


@pytest.mark.real_model
def test_nonshared_against_same_fp32_model_is_exact(nonshared_roles):
    result, _ = nonshared_roles
    for hop in result.hops:
        f = hop.fidelity
        assert f["kv_rel_error"] < 1e-6, hop.agent
        assert f["first_token_kl"] < 1e-6, hop.agent
        assert abs(f["continuation_kl"]) < 1e-6, hop.agent
        assert f["same_output"] is True, hop.agent
        assert f["reference_output"] == hop.output_ids
    assert result.reference_final_answer == result.final_answer
    assert result.same_final_answer is True


@pytest.mark.real_model
def test_agent_outputs_fill_successor_slots_as_generated_ids(real_model, nonshared_roles):
    result, spied = nonshared_roles
    query = tokenize(real_model.tokenizer, QUESTION)
    outputs = {h.agent: tuple(h.output_ids) for h in result.hops}
    for hop in spied:
        for seg in hop.segments:
            if seg.slot == "query":
                assert seg.tokens == query
            elif seg.slot is not None:
                assert seg.tokens == outputs[seg.slot], (hop.agent, seg.slot)
    solver_slots = {s.slot: s.tokens for s in spied[1].segments if s.shared}
    assert solver_slots["analyst"] == tuple(result.hops[0].output_ids)
    assert len(solver_slots["analyst"]) == result.hops[0].output_tokens > 0
    judge_slots = [s.slot for s in spied[2].segments if s.shared]
    assert judge_slots == ["query", "analyst", "solver"]
    # the records agree: the solver's analyst segment has the analyst's output length
    rec = next(s for s in result.hops[1].segments if s.get("slot") == "analyst")
    assert rec["length"] == len(result.hops[0].output_ids) and rec["kind"] == "agent"


@pytest.mark.real_model
def test_outputs_are_passed_as_ids_not_retokenized_text(real_model, monkeypatch):
    """An output whose ids do not survive decode + re-encode still reaches the successor as is."""
    from kvcmas.model.generate import Decoded
    from kvcmas.workflow import runner as runner_module

    tok = real_model.tokenizer
    odd = [*tokenize(tok, "sh"), *tokenize(tok, "eep")]  # "sheep", split unusually
    assert list(tokenize(tok, tok.decode(odd))) != odd  # precondition: text would not round-trip

    def fake_decode(model, cache, logits, max_new_tokens, stop, **kwargs):
        return Decoded(tokens=list(odd), hit_stop=True, first_logits=logits)

    monkeypatch.setattr(runner_module, "greedy_decode", fake_decode)
    method = SpyNonShared()
    w = Workflow(
        "pair",
        (
            AgentSpec("a", "You are A.", "Question:\n{query}\n\nAnswer.", BUDGET),
            AgentSpec("b", "You are B.", "Question:\n{query}\n\nA said:\n{a}\n\nCheck.", BUDGET),
        ),
        "b",
    )
    result = run(real_model, w, method)
    assert result.hops[0].output_ids == odd
    b_slot = next(seg for seg in method.hops[1].segments if seg.slot == "a")
    assert list(b_slot.tokens) == odd


@pytest.mark.real_model
def test_reply_prefix_opens_the_output_and_is_shared_with_its_kv(real_model):
    """A reply prefix ends the prompt, opens the output text, and successors read it (tokens
    and source KV) as part of the producer's reply."""
    tok = real_model.tokenizer
    prefix = tokenize(tok, "Answer:")
    method = SpyFullShared()
    w = Workflow(
        "pair",
        (
            AgentSpec("a", "You are A.", "Question:\n{query}\n\nAnswer.", BUDGET, "Answer:"),
            AgentSpec("b", "You are B.", "Question:\n{query}\n\nA said:\n{a}\n\nCheck.", BUDGET),
        ),
        "b",
    )
    result = run(real_model, w, method)
    a_hop, b_hop = method.hops
    assert tuple(a_hop.tokens[-len(prefix) :]) == prefix
    assert result.hops[0].output.startswith("Answer:")
    assert result.hops[0].output_tokens == len(result.hops[0].output_ids)  # generated only
    reply = b_hop.shared["a"]
    assert reply.tokens == prefix + tuple(result.hops[0].output_ids)
    # Layer-0 values depend on the token alone: the source must cover exactly the reply.
    alone = real_model.model.new_cache(len(reply.tokens))
    real_model.model.prefill(list(reply.tokens), alone)
    torch.testing.assert_close(
        reply.origin.v[0], alone.span(0, len(reply.tokens))[1][0], atol=1e-4, rtol=1e-4
    )


@pytest.mark.real_model
def test_reply_prefix_read_by_others_is_refused_by_hidden_state_methods(real_model):

    def pair(prefix_on_read_agent: bool) -> Workflow:
        a_prefix, b_prefix = ("Answer:", "") if prefix_on_read_agent else ("", "Answer:")
        return Workflow(
            "pair",
            (
                AgentSpec("a", "You are A.", "Question:\n{query}\n\nAnswer.", BUDGET, a_prefix),
                AgentSpec("b", "You are B.", "{query}\n\nA said:\n{a}", BUDGET, b_prefix),
            ),
            "b",
        )

    with pytest.raises(WorkflowError, match="droidspeak cannot reuse a reply that opens"):
        Runner(real_model, pair(True), make_method("droidspeak", block="2:4"))
    Runner(
        real_model, pair(False), make_method("droidspeak", block="2:4")
    )  # the final agent's prefix is fine


# ---------------------------------------------------------------- FullShared


@pytest.mark.real_model
def test_fullshared_first_hop_is_exact(nonshared_roles, fullshared_roles):
    dense, _ = nonshared_roles
    shared, _ = fullshared_roles
    first, ref = shared.hops[0], dense.hops[0]
    assert first.output_ids == ref.output_ids
    assert first.reuse.served_tokens == 0 and first.recompute_fraction == 1.0
    assert first.fidelity["kv_rel_error"] == ref.fidelity["kv_rel_error"]  # same dense compute
    # The hop prefills segment by segment, the reference the whole prompt in one call: only
    # float32 rounding may differ (it is bitwise equal on 1 thread, not on 2).
    assert first.fidelity["kv_rel_error"] < 1e-5
    assert first.fidelity["first_token_kl"] < 1e-6
    assert first.fidelity["same_output"] is True


@pytest.mark.real_model
def test_fullshared_reuses_every_shared_segment_after_the_first_hop(fullshared_roles):
    result, spied = fullshared_roles
    for hop, built in zip(result.hops[1:], spied[1:], strict=True):
        shared_len = sum(len(s) for s in built.segments if s.shared)
        assert hop.reuse.served_tokens == shared_len > 0, hop.agent
        assert hop.recompute_fraction == 0.0
        assert hop.prefilled_tokens == hop.prompt_tokens - hop.prefix_tokens - shared_len
        decisions = {s["slot"]: s["decision"] for s in hop.segments if "slot" in s}
        assert set(decisions.values()) == {"reuse"}, decisions


@pytest.mark.real_model
def test_fullshared_with_different_roles_has_bounded_nonzero_error(fullshared_roles):
    result, _ = fullshared_roles
    for hop in result.hops[1:]:
        err = hop.fidelity["kv_rel_error"]
        assert 1e-4 < err < 0.5, (hop.agent, err)  # real deviation, but not garbage
        assert hop.fidelity["first_token_kl"] > 1e-9  # the deviation reaches the logits


@pytest.mark.real_model
def test_fullshared_with_identical_prefixes_reproduces_nonshared(real_model, same_prefix_run):
    # The reference is NonShared on the same model: its dense greedy output of each hop's
    # prompt, and (reference_final_answer) a whole NonShared run of the request.
    shared = same_prefix_run
    query_len = len(tokenize(real_model.tokenizer, QUESTION))
    for hop in shared.hops:
        assert hop.output_ids == hop.fidelity["reference_output"], hop.agent
    assert shared.final_answer == shared.reference_final_answer
    second = shared.hops[1]
    assert second.reuse.served_tokens == query_len  # the query came from the first agent's cache
    assert second.recompute_fraction == 0.0
    for hop in shared.hops:
        assert hop.fidelity["kv_rel_error"] < 1e-5, hop.agent
        assert hop.fidelity["first_token_kl"] < 1e-5
        assert hop.fidelity["same_output"] is True
    assert shared.same_final_answer is True


# ---------------------------------------------------------------- request errors


@pytest.mark.real_model
def test_prompt_longer_than_context_names_the_agent(real_model):
    long_query = "sheep " * real_model.config.max_position
    with pytest.raises(WorkflowError, match=r"agent 'analyst'.*context"):
        run(real_model, three_roles(), NonShared(), query=long_query)


@pytest.mark.real_model
def test_generation_budget_beyond_context_names_the_later_agent(real_model):
    limit = real_model.config.max_position
    w = Workflow(
        "t",
        (
            AgentSpec("short", "You are brief.", "Question:\n{query}\n\nAnswer.", 2),
            AgentSpec("greedy", "You are long.", "Question:\n{query}\n\n{short}\n\nGo.", limit),
        ),
        "greedy",
    )
    with pytest.raises(WorkflowError, match=r"agent 'greedy'.*exceeds the context"):
        run(real_model, w, NonShared())


@pytest.mark.real_model
def test_request_missing_an_input_or_with_an_empty_one_is_rejected(real_model):
    w = Workflow(
        "with-input",
        (AgentSpec("reader", "You read.", "Question:\n{query}\n\nContext:\n{context}\n\nGo.", 2),),
        "reader",
    )
    runner = Runner(real_model, w, NonShared())
    with pytest.raises(WorkflowError, match="context"):
        runner.run({"query": QUESTION})
    for bad in ("", "   \n", 7):
        with pytest.raises(WorkflowError, match=r"'context' must be a non-empty string"):
            runner.run({"query": QUESTION, "context": bad})
    with pytest.raises(WorkflowError, match=r"'query' must be a non-empty string"):
        runner.run({"query": "", "context": "Sheep are animals."})


def test_read_requests_reads_objects_and_skips_blank_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"query": "a", "id": "x"}\n\n   \n{"query": "b"}\n')
    assert read_requests(path) == [{"query": "a", "id": "x"}, {"query": "b"}]


def test_read_requests_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        read_requests(tmp_path / "absent.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a"}\n{"query": oops}\n')
    with pytest.raises(WorkflowError, match="line 2: not valid JSON"):
        read_requests(bad)
    bad.write_text('{"query": "a"}\n\n["query", "b"]\n')
    with pytest.raises(WorkflowError, match="line 3: expected a JSON object"):
        read_requests(bad)
    for text in ("", "\n  \n"):
        bad.write_text(text)
        with pytest.raises(WorkflowError, match="no requests"):
            read_requests(bad)


# ---------------------------------------------------------------- the CLI

CLI_WORKFLOW = """\
name: cli-pair
final: judge
agents:
  - name: solver
    system: You are a careful problem solver.
    prompt: "Question:\\n{query}\\n\\nSolve it."
    max_new_tokens: 4
  - name: judge
    system: You are the final decision maker.
    prompt: "Question:\\n{query}\\n\\nThe solver wrote:\\n{solver}\\n\\nGive the final answer."
    max_new_tokens: 4
"""

HOP_KEYS = {
    "agent",
    "ttft_s",
    "prompt_tokens",
    "prefilled_tokens",
    "reuse",
    "rho",
    "output",
    "kv_rel_error",
    "first_token_kl",
    "continuation_kl",
    "same_output",
    "recompute_fraction",
}


@pytest.fixture
def cli_model(real_model, monkeypatch):
    """The CLI loads the session's model instead of a second copy (same spec and dtype)."""
    from kvcmas.model import loader

    def load(spec, dtype="fp32", device="cpu"):
        assert (spec, dtype, device) == (loader.DEFAULT_MODEL, "fp32", "cpu")
        return real_model

    monkeypatch.setattr(loader, "load_model", load)


@pytest.fixture
def cli_workflow(tmp_path) -> str:
    path = tmp_path / "pair.yaml"
    path.write_text(CLI_WORKFLOW)
    return str(path)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.real_model
def test_cli_run_fullshared_compare_json(cli_model, cli_workflow, capsys):
    from kvcmas.cli import main

    argv = ["run", "--workflow", cli_workflow, "--method", "fullshared"]
    assert main([*argv, "--question", QUESTION, "--compare", "--json"]) == 0
    out = json_lines(capsys.readouterr().out)
    assert len(out) == 1
    result = out[0]
    assert {"request", "method", "final_answer", "hops"} <= set(result)
    assert result["method"] == "fullshared" and result["request"] == "0"
    assert [h["agent"] for h in result["hops"]] == ["solver", "judge"]
    for h in result["hops"]:
        assert HOP_KEYS <= set(h), HOP_KEYS - set(h)
        assert h["ttft_s"] > 0 and h["prompt_tokens"] > 0
        assert "output_ids" not in h and "reference_output" not in h
    first, second = result["hops"]
    assert first["reuse"]["served_tokens"] == 0 and first["kv_rel_error"] < 1e-6
    assert second["reuse"]["served_tokens"] > 0 and second["recompute_fraction"] == 0.0
    assert 0 < second["kv_rel_error"] < 0.5
    assert result["final_answer"] == second["output"]
    assert isinstance(result["same_final_answer"], bool)


@pytest.mark.real_model
def test_cli_run_nonshared_one_json_object_per_request(cli_model, cli_workflow, tmp_path, capsys):
    from kvcmas.cli import main

    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        json.dumps({"id": "sheep", "query": QUESTION})
        + "\n"
        + json.dumps({"query": "What is 2 + 3?"})
        + "\n"
    )
    argv = ["run", "--workflow", cli_workflow, "--method", "nonshared"]
    assert main([*argv, "--requests", str(requests), "--json"]) == 0
    out = json_lines(capsys.readouterr().out)
    assert [r["request"] for r in out] == ["sheep", "1"]
    for r in out:
        assert r["method"] == "nonshared"
        for h in r["hops"]:
            assert h["reuse"]["served_tokens"] == 0 and h["recompute_fraction"] == 1.0
            assert h["prefilled_tokens"] == h["prompt_tokens"] - h["prefix_tokens"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "telepathy"], "unknown method 'telepathy'"),
        (["--method", "nonshared", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(cli_workflow, capsys, args, message):
    from kvcmas.cli import main

    code = main(["run", "--workflow", cli_workflow, "--question", QUESTION, *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvcmas: error:") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("workflow", ["no-such-workflow", "missing.yaml", "bad.yaml", "bad.json"])
def test_cli_bad_workflow_exits_2_with_one_line(tmp_path, capsys, workflow):
    from kvcmas.cli import main

    (tmp_path / "bad.yaml").write_text("name: x\nagents: [1, 2\nfinal: y\n")
    (tmp_path / "bad.json").write_text('{"name": ')
    target = workflow if workflow == "no-such-workflow" else str(tmp_path / workflow)
    code = main(["run", "--workflow", target, "--method", "nonshared", "--question", "q"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvcmas: error:") and Path(workflow).name in err
    assert err.count("\n") == 1


def test_cli_request_missing_input_exits_2_before_loading_a_model(tmp_path, capsys):
    from kvcmas.cli import main

    path = tmp_path / "wf.yaml"
    path.write_text(CLI_WORKFLOW.replace("Solve it.", "Context:\\n{context}\\n\\nSolve it."))
    code = main(["run", "--workflow", str(path), "--method", "nonshared", "--question", "q"])
    err = capsys.readouterr().err
    assert code == 2 and "context" in err and err.count("\n") == 1


# ---------------------------------------------------------------- the reference memo


@pytest.mark.real_model
def test_one_observer_over_several_runs_computes_each_reference_once(
    real_model, nonshared_roles, fullshared_roles
):
    observer = FidelityObserver(real_model, memo_bytes=MEMO_BYTES)
    shared = [
        Runner(real_model, three_roles(), method, observer=observer).run({"query": QUESTION})
        for method in (NonShared(), FullShared())
    ]
    # the same figures as observers of their own (the fixtures' runs) ...
    for fresh, memo in zip((nonshared_roles[0], fullshared_roles[0]), shared, strict=True):
        assert figures(memo) == figures(fresh)
    # ... while FullShared's first hop reads NonShared's first hop's tokens: one reference
    n = len(shared[0].hops)
    assert observer.memo.misses + observer.memo.hits == 2 * n
    assert observer.memo.hits >= 1
    rerun = Runner(real_model, three_roles(), NonShared(), observer=observer)
    again = rerun.run({"query": QUESTION})
    assert observer.memo.hits + observer.memo.misses == 3 * n
    assert observer.memo.hits >= n + 1  # a second NonShared run reads only known prompts
    assert figures(again) == figures(shared[0])


def figures(result) -> list[dict]:
    """Each hop's fidelity figures, without the observer's own time."""
    return [
        {k: v for k, v in h.fidelity.items() if not k.startswith("observer_")} for h in result.hops
    ]


def test_the_reference_memo_stores_within_its_bytes_and_then_keeps_what_it_has():
    def hop(tokens: int) -> ReferenceHop:  # 8 bytes a token in K, V and rows
        t = torch.zeros(1, 1, tokens, 1, dtype=torch.float16)
        return ReferenceHop(0, t, t, [], torch.zeros(tokens, 1, dtype=torch.float16))

    memo = ReferenceMemo(max_bytes=100)
    assert memo.get_or_compute(("a",), lambda: hop(6)).nbytes == 36
    memo.get_or_compute(("b",), lambda: hop(6))
    memo.get_or_compute(("c",), lambda: hop(6))  # 108 bytes: not kept
    assert list(memo.entries) == [("a",), ("b",)] and memo.bytes == 72
    memo.get_or_compute(("a",), lambda: pytest.fail("a is known"))
    assert (memo.hits, memo.misses) == (1, 3)
    assert ReferenceMemo(max_bytes=0).get_or_compute(("a",), lambda: hop(1)) is not None
