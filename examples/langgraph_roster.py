"""The paper's roster as a plain LangGraph app, with `kvcmas serve` as its OpenAI endpoint.

Three task agents (analyst, solver, checker; each reads the question and the notes of the
agents before it) and a decider that reads all three notes, built with LangGraph's
``StateGraph`` and langchain-openai's ``ChatOpenAI``. Nothing here knows about KV caches: the
app sends ordinary chat requests to the server's base URL and tags each with the session (one
per question) and the agent that sends it, in ``kv_transfer_params``. The server renders the
chat template, finds in each prompt the token spans that earlier requests of the session held
(the question, the notes quoted verbatim) and reuses their KV; no slots are declared.

    pip install -e ".[examples]"
    kvcmas serve --method kvcmas --port 8000
    python examples/langgraph_roster.py --base-url http://127.0.0.1:8000/v1 \\
        --question "Why is the sky blue?"

Without ``kv_transfer_params`` (``--plain``) the same app runs against any OpenAI-compatible
server.
"""

from __future__ import annotations

import argparse
import json
import operator
import urllib.request
import uuid
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

# (name, system prompt, instruction): the built-in roster's roles (kvcmas.workflow.builtin).
TASK_AGENTS = (
    ("analyst", "You are a precise analyst. You identify what a question is really asking.",
     "State the key facts needed to answer it, in two sentences."),
    ("solver", "You are a careful problem solver who reasons step by step.",
     "Answer the question, building on the notes above."),
    ("checker", "You are a skeptical reviewer who looks for mistakes.",
     "Point out any error in the notes above and give the corrected answer."),
)
DECIDER = ("decider", "You are the final decision maker. You weigh the team's notes and answer.",
           "Give the final answer in one or two sentences.")


class RosterState(TypedDict):
    question: str
    session: str
    notes: Annotated[dict[str, str], operator.or_]  # agent -> its reply, merged per step


def served_model(base_url: str) -> str:
    """The first model the server lists (``GET /models``): the base URL is all we take."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def user_message(question: str, notes: dict[str, str], reads: list[str], instruction: str) -> str:
    """The question, then the earlier agents' replies quoted verbatim, then the task."""
    quoted = "".join(f"\n\nNotes from the {name}:\n{notes[name]}" for name in reads)
    return f"Question:\n{question}{quoted}\n\n{instruction}"


def agent_node(llm: ChatOpenAI, name: str, system: str, instruction: str, reads: list[str],
               plain: bool):
    def node(state: RosterState) -> dict:
        user = user_message(state["question"], state["notes"], reads, instruction)
        model = llm if plain else llm.bind(extra_body={
            "kv_transfer_params": {"kvcmas": {"session": state["session"], "agent": name}}})
        reply = model.invoke([SystemMessage(system), HumanMessage(user)])
        return {"notes": {name: reply.content}}

    return node


def build_roster(base_url: str, model: str | None = None, task_tokens: int = 48,
                 final_tokens: int = 64, plain: bool = False):
    """The compiled graph: analyst -> solver -> checker -> decider, greedy, short replies."""
    model = model or served_model(base_url)
    graph = StateGraph(RosterState)
    earlier: list[str] = []
    for name, system, instruction in (*TASK_AGENTS, DECIDER):
        budget = final_tokens if name == DECIDER[0] else task_tokens
        llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0,
                         max_tokens=budget, timeout=600, max_retries=0)
        graph.add_node(name, agent_node(llm, name, system, instruction, list(earlier), plain))
        graph.add_edge(earlier[-1] if earlier else START, name)
        earlier.append(name)
    graph.add_edge(DECIDER[0], END)
    return graph.compile()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--question", action="append", required=True,
                        help="a question (repeat for more; each is its own session)")
    parser.add_argument("--model", help="served model name (default: the server's first)")
    parser.add_argument("--task-tokens", type=int, default=48)
    parser.add_argument("--final-tokens", type=int, default=64)
    parser.add_argument("--plain", action="store_true", help="send no kv_transfer_params")
    parser.add_argument("--json", action="store_true", help="one JSON line per question")
    args = parser.parse_args(argv)
    roster = build_roster(args.base_url, args.model, args.task_tokens, args.final_tokens,
                          args.plain)
    for question in args.question:
        session = f"langgraph-{uuid.uuid4().hex[:12]}"
        state = roster.invoke({"question": question, "session": session, "notes": {}})
        if args.json:
            print(json.dumps({"session": session, "question": question,
                              "answers": state["notes"]}), flush=True)
            continue
        print(f"# {question}  (session {session})")
        for name, answer in state["notes"].items():
            print(f"\n[{name}]\n{answer.strip()}")
        print(flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
