"""Workflow definitions: agents with role prompts and slotted templates, forming a DAG.

A template names slots as ``{query}`` (the user's question), ``{<agent name>}`` (that agent's
output) and ``{<anything else>}`` (an input supplied with the request). The references define
the DAG; execution follows a topological order that keeps the file's order where it can.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from kvcmas.chat import slot_names
from kvcmas.errors import WorkflowError

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
QUERY = "query"
DEFAULT_MAX_NEW_TOKENS = 128
_WORKFLOW_KEYS = {"name", "final", "agents"}
_AGENT_KEYS = {"name", "system", "prompt", "max_new_tokens", "reply_prefix"}



@dataclass(frozen=True)
class AgentSpec:
    name: str
    system: str
    prompt: str
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # Text that opens the agent's reply (after the chat template's generation prompt), e.g.
    # "Answer:" to hold a small model to an answer format; it is part of the agent's output.
    reply_prefix: str = ""

    @property
    def slots(self) -> list[str]:
        return list(dict.fromkeys(slot_names(self.prompt)))


@dataclass(frozen=True)
class Workflow:
    name: str
    agents: tuple[AgentSpec, ...]
    final: str
    order: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", self._validate())

    def agent(self, name: str) -> AgentSpec:
        return next(a for a in self.agents if a.name == name)

    @property
    def agent_names(self) -> set[str]:
        return {a.name for a in self.agents}

    def inputs(self) -> list[str]:
        """Slots that the request must supply (everything that is not an agent's output)."""
        names = self.agent_names
        seen = dict.fromkeys(s for a in self.agents for s in a.slots if s not in names)
        return list(seen)

    def slot_kind(self, slot: str) -> str:
        if slot == QUERY:
            return "query"
        return "agent" if slot in self.agent_names else "input"

    def _validate(self) -> tuple[str, ...]:
        if not self.agents:
            raise WorkflowError(f"workflow {self.name!r} has no agents")
        names = [a.name for a in self.agents]
        for a in self.agents:
            if not NAME.match(a.name):
                raise WorkflowError(f"agent name {a.name!r} is not a valid slot name")
            if a.name == QUERY:
                raise WorkflowError("an agent may not be named 'query': that slot is the question")
            if a.max_new_tokens < 1:
                raise WorkflowError(f"agent {a.name!r}: max_new_tokens must be at least 1")
            if a.name in a.slots:
                raise WorkflowError(f"cycle: agent {a.name!r} reads its own output")
            if slot_names(a.reply_prefix):
                raise WorkflowError(f"agent {a.name!r}: reply_prefix must not hold a slot")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise WorkflowError(f"duplicate agent names: {', '.join(dupes)}")
        if self.final not in names:
            raise WorkflowError(f"final agent {self.final!r} is not one of the agents")
        return self._topological_order()

    def _topological_order(self) -> tuple[str, ...]:
        deps = {a.name: [s for s in a.slots if s in self.agent_names] for a in self.agents}
        done: list[str] = []
        while len(done) < len(deps):
            ready = [n for n in deps if n not in done and all(d in done for d in deps[n])]
            if not ready:
                stuck = sorted(n for n in deps if n not in done)
                raise WorkflowError(f"cycle among agents: {', '.join(stuck)}")
            done.append(ready[0])  # earliest in file order: deterministic
        return tuple(done)

    def check_request(self, request: object, where: str = "request") -> None:
        """Every input slot present as a non-empty string; a missing slot that looks like a
        misspelt agent name is reported as such."""
        if not isinstance(request, dict):
            raise WorkflowError(f"{where}: expected a JSON object with {', '.join(self.inputs())}")
        for slot in self.inputs():
            if slot not in request:
                readers = [a.name for a in self.agents if slot in a.slots]
                close = difflib.get_close_matches(slot, sorted(self.agent_names), n=1)
                hint = (
                    f"; did agent {readers[0]!r} mean agent {close[0]!r}?" if close else ""
                )
                raise WorkflowError(
                    f"{where}: lacks input {slot!r}, read by agent(s) {', '.join(readers)} of "
                    f"workflow {self.name!r} (no agent has that name){hint}"
                )
            value = request[slot]
            if not isinstance(value, str) or not value.strip():
                raise WorkflowError(
                    f"{where}: input {slot!r} must be a non-empty string, got {value!r}"
                )


def workflow_from_dict(data: dict, source: str = "workflow") -> Workflow:
    if not isinstance(data, dict):
        raise WorkflowError(f"{source}: expected a mapping with keys name, final, agents")
    unknown = set(data) - _WORKFLOW_KEYS
    if unknown:
        raise WorkflowError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}")
    for key in ("final", "agents"):
        if key not in data:
            raise WorkflowError(f"{source}: missing key {key!r}")
    for key in ("final", "name"):
        if key in data and not isinstance(data[key], str):
            raise WorkflowError(f"{source}: {key!r} must be a string, got {data[key]!r}")
    if not isinstance(data["agents"], list) or not data["agents"]:
        raise WorkflowError(f"{source}: 'agents' must be a non-empty list of agent mappings")
    agents = []
    for i, a in enumerate(data["agents"]):
        if not isinstance(a, dict):
            raise WorkflowError(f"{source}: agent #{i + 1} is not a mapping")
        bad = set(a) - _AGENT_KEYS
        if bad:
            raise WorkflowError(
                f"{source}: agent #{i + 1}: unknown key(s) {', '.join(sorted(bad))}"
            )
        for key in ("name", "system", "prompt"):
            if key not in a:
                raise WorkflowError(f"{source}: agent #{i + 1} lacks {key!r}")
            if not isinstance(a[key], str) or not a[key].strip():
                raise WorkflowError(
                    f"{source}: agent #{i + 1}: {key!r} must be a non-empty string, "
                    f"got {a[key]!r}"
                )
        if not isinstance(a.get("reply_prefix", ""), str):
            raise WorkflowError(f"{source}: agent #{i + 1}: 'reply_prefix' must be a string")
        budget = a.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise WorkflowError(
                f"{source}: agent #{i + 1}: max_new_tokens must be an integer, not {budget!r}"
            )
        agents.append(
            AgentSpec(
                name=str(a["name"]),
                system=str(a["system"]),
                prompt=str(a["prompt"]),
                max_new_tokens=budget,
                reply_prefix=str(a.get("reply_prefix", "")),
            )
        )
    return Workflow(
        name=str(data.get("name", source)), agents=tuple(agents), final=str(data["final"])
    )
