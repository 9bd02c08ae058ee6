#!/usr/bin/env python3
"""The multi-agent example (`multi_agent.py`) as a LangGraph graph, against `pbkv serve`.

Nodes: a router and four specialists; each specialist returns to the router, the router picks the
next specialist or END (a loop). Every node calls the server with the real `openai` client and
the workflow hints, exactly as `multi_agent.py` does. Needs `pip install langgraph` (optional,
not a pbkv dependency).

    pbkv serve --model tiny &
    python examples/langgraph_agents.py --base-url http://127.0.0.1:8000/v1 --workflows 10
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path
from typing import TypedDict

import httpx
import openai
from langgraph.graph import END, START, StateGraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_agent import (SPECIALISTS, SYSTEM, TASKS, Interrupted, Parser, Stopped, at_least,  # noqa: E402
                         planned_route, run_pool, server_error)


class State(TypedDict):
    wid: str
    kind: str
    task: str
    plan: list[str]
    step: int
    transcript: list[tuple[str, str]]
    next: str


def build_graph(client: openai.OpenAI, model: str, max_tokens: int, stop: threading.Event | None = None):
    """The graph; `stop` set (Ctrl-C): a workflow raises `Stopped` before its next call."""
    def chat(state: State, agent: str, last: bool) -> str:
        if stop is not None and stop.is_set():
            raise Stopped(state["wid"])
        work = "".join(f"\n[{who}] {text}" for who, text in state["transcript"]) or "\n(nothing yet)"
        r = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "system", "content": SYSTEM[agent]},
                      {"role": "user", "content": f"Task ({state['kind']}): {state['task']}\nWork so far:{work}"}],
            extra_body={"workflow_id": state["wid"], "agent": agent, "workflow_done": last})
        return (r.choices[0].message.content or "").strip()

    def router(state: State) -> dict:
        last = state["step"] >= len(state["plan"])
        answer = chat(state, "router", last).lower()
        named = next((s for s in SPECIALISTS if answer.startswith(s)), None)
        if last or answer.startswith("done"):
            if not last:   # the model ended early, without workflow_done: say so, as multi_agent.py does
                httpx.post(f"{str(client.base_url).rstrip('/')}/workflows/{state['wid']}/end",
                           headers={"Authorization": f"Bearer {client.api_key}"})
            return {"next": "DONE"}
        return {"next": named or state["plan"][state["step"]]}

    def specialist(agent: str):
        def node(state: State) -> dict:
            return {"transcript": state["transcript"] + [(agent, chat(state, agent, False))],
                    "step": state["step"] + 1}
        return node

    g = StateGraph(State)
    g.add_node("router", router)
    for s in SPECIALISTS:
        g.add_node(s, specialist(s))
        g.add_edge(s, "router")
    g.add_edge(START, "router")
    g.add_conditional_edges("router", lambda st: END if st["next"] == "DONE" else st["next"],
                            [*SPECIALISTS, END])
    return g.compile()


def run_one(graph, index: int, seed: int) -> int:
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choice(sorted(TASKS))
    task = rng.choice(TASKS[kind])
    state = graph.invoke({"wid": f"lg-{seed}-{index}", "kind": kind, "task": task, "plan": planned_route(kind, rng),
                          "step": 0, "transcript": [], "next": ""}, {"recursion_limit": 64})
    return 2 * len(state["transcript"]) + 1  # calls made: router around every specialist


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--workflows", type=at_least(1), default=10)
    ap.add_argument("--concurrency", type=at_least(1), default=4)
    ap.add_argument("--max-tokens", type=at_least(1), default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default="none")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    stop = threading.Event()
    graph = build_graph(client, args.model, args.max_tokens, stop)
    start = time.perf_counter()
    try:   # (run_pool's own stop is not the graph's: each handler below sets the graph's)
        counts = run_pool(lambda i, _: run_one(graph, i, args.seed), args.workflows, args.concurrency)
    except Interrupted as e:   # Ctrl-C: the queued workflows were cancelled; report what completed
        stop.set()
        counts = e.results
        print(f"interrupted: {e.completed} of {args.workflows} workflows completed", file=sys.stderr)
    except Exception as e:
        stop.set()
        line = server_error(e, args.base_url)
        if line is None:
            raise
        ap.exit(1, f"{ap.prog}: {line}\n")
    wall = time.perf_counter() - start
    calls = sum(counts)
    print(f"{len(counts)} LangGraph workflows, {calls} calls in {wall:.1f} s ({calls / wall:.1f} calls/s)")
    if len(counts) < args.workflows:
        sys.exit(130)


if __name__ == "__main__":
    main()
