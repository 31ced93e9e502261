"""Built-in workflows, and loading a workflow by built-in name or from a YAML / JSON file.

Slots start a line in the built-ins so that per-segment tokenization equals joint."""

from __future__ import annotations

import json
from pathlib import Path

from kvcmas.errors import WorkflowError
from kvcmas.workflow.spec import AgentSpec, Workflow, workflow_from_dict


def roster(
    name: str = "roster",
    roles: tuple[tuple[str, str, str], ...] | None = None,
    decider: tuple[str, str, str] | None = None,
    task_tokens: int = 48,
    final_tokens: int = 64,
    final_reply_prefix: str = "",
) -> Workflow:
    """The paper's shape: three task agents, then a reflection agent that reads all three.

    Each task agent reads the query and the outputs of the task agents before it, so agent
    outputs are shared segments consumed by every later agent. ``roles`` gives
    ``(name, system prompt, instruction)`` per task agent.
    """
    roles = roles or (
        (
            "analyst",
            "You are a precise analyst. You identify what a question is really asking.",
            "State the key facts needed to answer it, in two sentences.",
        ),
        (
            "solver",
            "You are a careful problem solver who reasons step by step.",
            "Answer the question, building on the notes above.",
        ),
        (
            "checker",
            "You are a skeptical reviewer who looks for mistakes.",
            "Point out any error in the notes above and give the corrected answer.",
        ),
    )
    decider = decider or (
        "decider",
        "You are the final decision maker. You weigh the team's notes and answer.",
        "Give the final answer in one or two sentences.",
    )
    agents, earlier = [], []
    for agent_name, system, instruction in (*roles, decider):
        notes = "".join(f"\n\nNotes from the {e}:\n{{{e}}}" for e in earlier)
        is_decider = agent_name == decider[0]
        prompt = f"Question:\n{{query}}{notes}\n\n{instruction}"
        budget = final_tokens if is_decider else task_tokens
        prefix = final_reply_prefix if is_decider else ""
        agents.append(AgentSpec(agent_name, system, prompt, budget, prefix))
        earlier.append(agent_name)
    return Workflow(name=name, agents=tuple(agents), final=decider[0])


def chain4() -> Workflow:
    """Four agents in a chain: each reads the question and the previous agent's output."""
    steps = (
        (
            "planner",
            "You are a planner. You outline how to approach a question.",
            "Write a short plan for answering it.",
        ),
        (
            "researcher",
            "You are a researcher. You recall the facts a plan needs.",
            "Carry out the plan and list the relevant facts.",
        ),
        (
            "writer",
            "You are a writer. You turn notes into a clear answer.",
            "Write the answer from these notes.",
        ),
        (
            "editor",
            "You are an editor. You make answers correct and concise.",
            "Give the final, corrected answer in one or two sentences.",
        ),
    )
    agents, previous = [], None
    for name, system, instruction in steps:
        context = f"\n\nThe {previous} wrote:\n{{{previous}}}" if previous else ""
        agents.append(
            AgentSpec(name, system, f"Question:\n{{query}}{context}\n\n{instruction}", 48)
        )
        previous = name
    return Workflow(name="chain4", agents=tuple(agents), final="editor")


BUILTIN_WORKFLOWS = {"roster": roster, "chain4": chain4}


def load_workflow(name_or_path: str, also_known: tuple[str, ...] = ()) -> Workflow:
    """A built-in workflow by name, or a YAML / JSON file. ``also_known`` names built-ins of
    higher layers (the task rosters of :mod:`kvcmas.eval.tasks`) for the error message."""
    if name_or_path in BUILTIN_WORKFLOWS:
        return BUILTIN_WORKFLOWS[name_or_path]()
    path = Path(name_or_path)
    if not path.exists():
        known = ", ".join(sorted([*BUILTIN_WORKFLOWS, *also_known]))
        raise WorkflowError(
            f"no built-in workflow or file named {name_or_path!r} (built-in: {known})"
        )
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkflowError(f"{path}: not valid JSON: {e}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            detail = " ".join(str(e).split())  # one line: the CLI prints errors as one line
            raise WorkflowError(f"{path}: not valid YAML: {detail}") from None
    return workflow_from_dict(data, source=str(path))
