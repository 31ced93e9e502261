"""Workflow definitions: loading from YAML / JSON / Python, validation errors, built-ins, DAG order.

No model is needed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvcmas.errors import WorkflowError
from kvcmas.workflow.builtin import BUILTIN_WORKFLOWS, chain4, load_workflow, roster
from kvcmas.workflow.spec import (
    DEFAULT_MAX_NEW_TOKENS,
    AgentSpec,
    Workflow,
    workflow_from_dict,
)

EXAMPLE_YAML = """\
name: review-chain
final: judge
agents:
  - name: solver
    system: You are a careful problem solver.
    prompt: "Question: {query}\\nSolve it step by step."
    max_new_tokens: 96
  - name: judge
    system: You are the final decision maker.
    prompt: "Question: {query}\\nThe solver wrote: {solver}\\nGive the final answer."
"""

SOLVER_PROMPT = "Question: {query}\nSolve it step by step."
JUDGE_PROMPT = "Question: {query}\nThe solver wrote: {solver}\nGive the final answer."


def example_dict() -> dict:
    return {
        "name": "review-chain",
        "final": "judge",
        "agents": [
            {
                "name": "solver",
                "system": "You are a careful problem solver.",
                "prompt": SOLVER_PROMPT,
                "max_new_tokens": 96,
            },
            {
                "name": "judge",
                "system": "You are the final decision maker.",
                "prompt": JUDGE_PROMPT,
            },
        ],
    }


def agent(name: str, prompt: str, **kw) -> dict:
    return {"name": name, "system": f"You are {name}.", "prompt": prompt, **kw}


def wf(agents: list[dict], final: str, **extra) -> dict:
    return {"name": "t", "final": final, "agents": agents, **extra}


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- loading


def check_example(w: Workflow) -> None:
    assert w.name == "review-chain"
    assert w.final == "judge"
    assert w.order == ("solver", "judge")
    solver, judge = w.agent("solver"), w.agent("judge")
    assert solver.system == "You are a careful problem solver."
    assert solver.prompt == SOLVER_PROMPT  # the YAML "\n" escape is a real newline
    assert solver.max_new_tokens == 96
    assert judge.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert solver.slots == ["query"]
    assert judge.slots == ["query", "solver"]
    assert w.inputs() == ["query"]
    assert w.slot_kind("query") == "query"
    assert w.slot_kind("solver") == "agent"


def test_example_loads_from_yaml_json_and_python_identically(tmp_path):
    from_yaml = load_workflow(write(tmp_path, "wf.yaml", EXAMPLE_YAML))
    from_json = load_workflow(write(tmp_path, "wf.json", json.dumps(example_dict())))
    from_dict = workflow_from_dict(example_dict())
    from_python = Workflow(
        name="review-chain",
        agents=(
            AgentSpec("solver", "You are a careful problem solver.", SOLVER_PROMPT, 96),
            AgentSpec("judge", "You are the final decision maker.", JUDGE_PROMPT),
        ),
        final="judge",
    )
    for w in (from_yaml, from_json, from_dict, from_python):
        check_example(w)
    assert from_yaml == from_json == from_dict == from_python
    assert yaml.safe_load(EXAMPLE_YAML) == example_dict()


def test_yml_suffix_is_yaml_and_name_defaults_to_source(tmp_path):
    data = example_dict()
    del data["name"]
    path = write(tmp_path, "wf.yml", yaml.safe_dump(data))
    assert load_workflow(path).name == path
    assert workflow_from_dict(data, source="mine").name == "mine"


# ---------------------------------------------------------------- validation errors


def test_unknown_top_level_key_is_named():
    data = example_dict()
    data["agnets"] = []
    with pytest.raises(WorkflowError, match="unknown key.*agnets"):
        workflow_from_dict(data)


def test_unknown_agent_key_is_named():
    data = example_dict()
    data["agents"][1]["max_tokens"] = 5
    with pytest.raises(WorkflowError, match=r"agent #2.*unknown key.*max_tokens"):
        workflow_from_dict(data)


def test_missing_agent_field_is_named():
    data = example_dict()
    del data["agents"][0]["prompt"]
    with pytest.raises(WorkflowError, match=r"agent #1 lacks 'prompt'"):
        workflow_from_dict(data)


def test_not_a_mapping_is_refused():
    with pytest.raises(WorkflowError, match="mapping"):
        workflow_from_dict(["not", "a", "mapping"])
    with pytest.raises(WorkflowError, match="agent #1 is not a mapping"):
        workflow_from_dict(wf(["solver"], "solver"))


def test_unknown_slot_is_a_missing_request_input_named_by_check_request():
    w = workflow_from_dict(
        wf([agent("solver", "Question:\n{query}\nContext:\n{contxt}\nSolve it.")], "solver")
    )
    assert w.inputs() == ["query", "contxt"]
    assert w.slot_kind("contxt") == "input"
    w.check_request({"query": "q", "contxt": "c"})  # supplied: fine
    with pytest.raises(WorkflowError, match="contxt") as info:
        w.check_request({"query": "q"})
    assert "query" not in str(info.value).split("required")[0]  # only the missing one


def test_cycle_between_two_agents_is_named():
    data = wf([agent("a", "{query}\n{b}"), agent("b", "{query}\n{a}")], "b")
    with pytest.raises(WorkflowError, match="cycle") as info:
        workflow_from_dict(data)
    assert "a" in str(info.value).split(":")[-1] and "b" in str(info.value).split(":")[-1]


def test_cycle_is_named_even_with_an_innocent_agent_before_it():
    data = wf(
        [agent("start", "{query}"), agent("x", "{start}\n{y}"), agent("y", "{x}")],
        "y",
    )
    with pytest.raises(WorkflowError, match=r"cycle among agents: x, y"):
        workflow_from_dict(data)


def test_self_reference_is_a_named_cycle():
    with pytest.raises(WorkflowError, match=r"cycle.*'echo'"):
        workflow_from_dict(wf([agent("echo", "{query}\nYou said:\n{echo}")], "echo"))


def test_missing_final_agent_is_named():
    with pytest.raises(WorkflowError, match=r"final agent 'nobody'"):
        workflow_from_dict(wf([agent("solver", "{query}")], "nobody"))
    data = example_dict()
    del data["final"]
    with pytest.raises(WorkflowError, match="missing key 'final'"):
        workflow_from_dict(data)


def test_duplicate_agent_names_are_named():
    data = wf([agent("solver", "{query}"), agent("solver", "{query}")], "solver")
    with pytest.raises(WorkflowError, match="duplicate agent names: solver"):
        workflow_from_dict(data)


def test_agent_named_query_is_refused():
    with pytest.raises(WorkflowError, match="query"):
        workflow_from_dict(wf([agent("query", "Say hi.")], "query"))


def test_invalid_agent_name_is_refused():
    with pytest.raises(WorkflowError, match="not a valid slot name"):
        workflow_from_dict(wf([agent("two words", "{query}")], "two words"))


@pytest.mark.parametrize("budget", [0, -3])
def test_max_new_tokens_below_one_is_refused(budget):
    with pytest.raises(WorkflowError, match=r"'solver'.*max_new_tokens"):
        workflow_from_dict(wf([agent("solver", "{query}", max_new_tokens=budget)], "solver"))
    with pytest.raises(WorkflowError, match="max_new_tokens"):
        Workflow("t", (AgentSpec("solver", "s", "{query}", budget),), "solver")


@pytest.mark.parametrize("budget", ["many", 12.5, True, None])
def test_non_integer_max_new_tokens_is_a_workflow_error(budget):
    with pytest.raises(WorkflowError, match="max_new_tokens"):
        workflow_from_dict(wf([agent("solver", "{query}", max_new_tokens=budget)], "solver"))


@pytest.mark.parametrize("agents", [[], 5, "solver", None])
def test_agents_must_be_a_non_empty_list(agents):
    with pytest.raises(WorkflowError, match="'agents' must be a non-empty list"):
        workflow_from_dict({"name": "x", "final": "solver", "agents": agents})


@pytest.mark.parametrize("field", ["system", "prompt", "name"])
@pytest.mark.parametrize("value", [None, "", "  ", 7])
def test_empty_or_non_string_agent_text_is_named(field, value):
    a = agent("solver", "{query}")
    a[field] = value
    with pytest.raises(WorkflowError, match=f"agent #1: '{field}' must be a non-empty string"):
        workflow_from_dict(wf([a], "solver"))


@pytest.mark.parametrize("query", [7, None, "", ["a"], {"q": 1}])
def test_request_input_must_be_a_non_empty_string(query):
    w = workflow_from_dict(wf([agent("solver", "{query}")], "solver"))
    with pytest.raises(WorkflowError, match="input 'query' must be a non-empty string"):
        w.check_request({"query": query})


def test_request_that_is_not_an_object_is_refused():
    w = workflow_from_dict(wf([agent("solver", "{query}")], "solver"))
    with pytest.raises(WorkflowError, match="expected a JSON object"):
        w.check_request(["query"])


def test_misspelt_agent_slot_is_reported_as_such():
    agents = [agent("solver", "{query}"), agent("judge", "{query}\n{solvr}")]
    w = workflow_from_dict(wf(agents, "judge"))
    with pytest.raises(WorkflowError, match="did agent 'judge' mean agent 'solver'"):
        w.check_request({"query": "q"})


def test_invalid_yaml_is_a_one_line_workflow_error(tmp_path):
    path = write(tmp_path, "bad.yaml", "name: x\nagents: [1, 2\nfinal: y\n")
    with pytest.raises(WorkflowError, match="not valid YAML") as info:
        load_workflow(path)
    assert path in str(info.value)
    assert "\n" not in str(info.value)  # the CLI prints it as one line


def test_invalid_json_is_a_workflow_error(tmp_path):
    path = write(tmp_path, "bad.json", '{"name": "x", "final": ')
    with pytest.raises(WorkflowError, match="not valid JSON") as info:
        load_workflow(path)
    assert path in str(info.value)


def test_yaml_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(WorkflowError, match="expected a mapping"):
        load_workflow(write(tmp_path, "list.yaml", "- a\n- b\n"))
    with pytest.raises(WorkflowError, match="expected a mapping"):
        load_workflow(write(tmp_path, "empty.yaml", ""))


def test_missing_file_is_named_with_the_builtins(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(WorkflowError, match="nope.yaml") as info:
        load_workflow(path)
    assert "roster" in str(info.value) and "chain4" in str(info.value)


# ---------------------------------------------------------------- built-ins and order


def test_builtins_load_by_name():
    assert set(BUILTIN_WORKFLOWS) == {"roster", "chain4"}  # task rosters: kvcmas.eval.tasks
    assert load_workflow("roster") == roster()
    assert load_workflow("chain4") == chain4()


def test_roster_is_three_task_agents_and_a_decider_reading_all():
    w = roster()
    assert len(w.agents) == 4
    tasks = [a.name for a in w.agents[:3]]
    assert w.final == "decider" and w.agents[3].name == "decider"
    assert w.order == (*tasks, "decider")
    for i, a in enumerate(w.agents[:3]):
        assert a.slots == ["query", *tasks[:i]]  # query and every earlier task agent
        assert a.max_new_tokens == 48
    assert w.agent("decider").slots == ["query", *tasks]
    assert w.agent("decider").max_new_tokens == 64
    assert w.inputs() == ["query"]
    assert len({a.system for a in w.agents}) == 4  # distinct roles


def test_roster_slots_start_a_line():
    """Slots at line starts keep per-segment tokenization equal to joint tokenization."""
    for w in (roster(), chain4()):
        for a in w.agents:
            for slot in a.slots:
                at = a.prompt.index("{" + slot + "}")
                assert at == 0 or a.prompt[at - 1] == "\n", (a.name, slot)


def test_roster_accepts_custom_roles():
    roles = (("x", "sx", "ix"), ("y", "sy", "iy"))
    w = roster(roles=roles, decider=("z", "sz", "iz"), task_tokens=5, final_tokens=7)
    assert w.order == ("x", "y", "z")
    assert w.agent("y").slots == ["query", "x"]
    assert w.agent("z").slots == ["query", "x", "y"]
    assert [a.max_new_tokens for a in w.agents] == [5, 5, 7]


def test_chain4_is_a_chain():
    w = chain4()
    names = [a.name for a in w.agents]
    assert len(names) == 4
    assert w.order == tuple(names)
    assert w.final == names[-1]
    assert w.agents[0].slots == ["query"]
    for prev, a in zip(names, w.agents[1:], strict=False):
        assert a.slots == ["query", prev]  # exactly the previous agent, no skip links
    assert w.inputs() == ["query"]


def test_order_puts_producers_before_consumers_listed_earlier():
    data = wf(
        [
            agent("judge", "{query}\n{solver}\n{critic}"),
            agent("critic", "{query}\n{solver}"),
            agent("solver", "{query}"),
        ],
        "judge",
    )
    w = workflow_from_dict(data)
    assert w.order == ("solver", "critic", "judge")
    assert [a.name for a in w.agents] == ["judge", "critic", "solver"]  # file order kept


def test_order_is_a_valid_topological_order_and_keeps_file_order_where_free():
    data = wf(
        [
            agent("d", "{b}\n{c}"),
            agent("c", "{a}"),
            agent("b", "{a}"),
            agent("a", "{query}"),
            agent("e", "{query}"),
        ],
        "d",
    )
    w = workflow_from_dict(data)
    pos = {n: i for i, n in enumerate(w.order)}
    assert sorted(w.order) == ["a", "b", "c", "d", "e"]
    for a in w.agents:
        for s in a.slots:
            if s in pos:
                assert pos[s] < pos[a.name], (s, a.name)
    assert w.order == ("a", "c", "b", "d", "e")  # earliest-listed ready agent first


def test_reply_prefix_is_read_and_may_not_hold_a_slot():
    data = {
        "final": "a",
        "agents": [{"name": "a", "system": "s", "prompt": "{query}", "reply_prefix": "Answer:"}],
    }
    assert workflow_from_dict(data).agent("a").reply_prefix == "Answer:"
    data["agents"][0]["reply_prefix"] = "Answer: {query}"
    with pytest.raises(WorkflowError, match="reply_prefix must not hold a slot"):
        workflow_from_dict(data)
