"""examples/langgraph_roster.py: a plain LangGraph app as the client of ``kvcmas serve``.

The app knows nothing of KV: it sends chat requests tagged with a session and an agent. With
the ``vllm`` marker (and the ``examples`` extra), a real server with FullShared runs the roster
for one question, and its ``GET /kvcmas/stats`` build log shows that later agents' prompts were
served from spans the server found by itself: the solver's from the analyst's output, and the
decider's over the three notes it quotes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from tests.test_serve_cli import ROOT, descendants, kill_all, start_serve

EXAMPLE = ROOT / "examples" / "langgraph_roster.py"
MIN_SPAN = 16


def import_example():
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import langgraph_roster
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return langgraph_roster


def test_example_builds_the_roster_graph_without_a_server():
    example = import_example()
    graph = example.build_roster("http://127.0.0.1:9/v1", model="m").get_graph()
    order = ["analyst", "solver", "checker", "decider"]
    assert set(order) <= set(graph.nodes)
    edges = {(e.source, e.target) for e in graph.edges}
    assert {("__start__", "analyst"), ("analyst", "solver"), ("solver", "checker"),
            ("checker", "decider"), ("decider", "__end__")} <= edges
    # The decider's message quotes every task agent's reply verbatim, one per line block.
    notes = {"analyst": "A.", "solver": "B.", "checker": "C."}
    text = example.user_message("Q?", notes, ["analyst", "solver", "checker"], "Decide.")
    assert text == ("Question:\nQ?\n\nNotes from the analyst:\nA.\n\nNotes from the solver:\n"
                    "B.\n\nNotes from the checker:\nC.\n\nDecide.")


def covered(spans: list[dict], positions: range) -> int:
    """How many of ``positions`` lie inside a span that served tokens."""
    served = [range(s["start"], s["start"] + s["length"]) for s in spans if s["served_tokens"]]
    return sum(any(p in r for r in served) for p in positions)


def producer(slot: str) -> str:
    """``out:solver#2`` -> ``solver``: the agent whose prompt (in:) or reply (out:) held it."""
    return re.sub(r"#\d+$", "", slot.split(":", 1)[1])


@pytest.mark.vllm
def test_langgraph_roster_reuses_spans_through_kvcmas_serve(tmp_path):
    pytest.importorskip("vllm")
    example = import_example()
    from kvcmas.serve.client import load_model_side

    proc, port, _ = start_serve(tmp_path, "server.log", [
        "--method", "fullshared", "--max-model-len", "2048", "--kv-cache-bytes", str(512 << 20),
        # Every span built (pinned rule): on prompts this short the measured costs may leave
        # them to vLLM, and the test checks what the connector builds.
        "--min-span", str(MIN_SPAN), "--min-gain", "0"])  # fmt: skip
    tree: set[int] = set()
    try:
        tree = descendants(proc.pid)
        url = f"http://127.0.0.1:{port}/v1"
        run = subprocess.run(
            [sys.executable, str(EXAMPLE), "--base-url", url, "--question",
             "Why is the sky blue?", "--task-tokens", "32", "--final-tokens", "8", "--json"],
            capture_output=True, text=True, cwd=ROOT, timeout=600,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        (result,) = [json.loads(line) for line in run.stdout.splitlines()]
        notes = result["answers"]
        assert list(notes) == ["analyst", "solver", "checker", "decider"]
        assert all(answer.strip() for answer in notes.values())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/kvcmas/stats", timeout=30) as r:
            stats = json.load(r)
    finally:
        kill_all(proc, tree)

    assert stats["method"] == "fullshared"
    # The build log keys a session by its (namespace, session) as JSON.
    session = json.dumps([None, result["session"]])
    builds = {b["agent"]: b for b in stats["builds"] if b["session"] == session}
    for agent, build in builds.items():
        print(agent, [(s["slot"], s["start"], s["length"], s["served_tokens"])
                      for s in build["spans"]])
    # The first agent has nothing earlier to read; each later one was built from spans.
    assert set(builds) == {"solver", "checker", "decider"}
    # The solver quotes the analyst's reply: found in that reply's own (decode-time) KV.
    assert any(s["slot"] == "out:analyst" and s["served_tokens"] > 0
               for s in builds["solver"]["spans"])

    # The decider: its spans come from the task agents of this session and serve tokens...
    decider = builds["decider"]["spans"]
    assert decider and sum(s["served_tokens"] for s in decider) > 0
    assert {producer(s["slot"]) for s in decider} <= {"analyst", "solver", "checker"}
    # ...covering the three notes it quotes, located in the prompt as the server tokenized it
    # (the model's chat template, which vLLM applies to chat requests).
    tok = load_model_side("smollm2-135m").tokenizer
    _, system, instruction = example.DECIDER
    tasks = [agent for agent, _, _ in example.TASK_AGENTS]
    user = example.user_message(result["question"], notes, tasks, instruction)
    text = tok.apply_chat_template([{"role": "system", "content": system},
                                    {"role": "user", "content": user}],
                                   tokenize=False, add_generation_prompt=True)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    long_notes = 0
    for agent in tasks:
        begin = text.index(f"Notes from the {agent}:\n") + len(f"Notes from the {agent}:\n")
        end = begin + len(notes[agent])
        inside = [i for i, (a, b) in enumerate(offsets) if begin <= a < b <= end]
        positions = range(inside[0], inside[-1] + 1) if inside else range(0)
        print(agent, "note tokens", len(positions), "covered", covered(decider, positions))
        if len(positions) >= MIN_SPAN:
            long_notes += 1
            assert covered(decider, positions) >= len(positions) // 2
    assert long_notes >= 2
