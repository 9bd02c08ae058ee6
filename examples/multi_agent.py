#!/usr/bin/env python3
"""A small multi-agent workflow against `pbkv serve`, with the real `openai` client.

A router reads the task and the work so far and picks the next specialist (coder, researcher,
reviewer, writer) or DONE; the specialist works; back to the router: a loop. Every call tells the
server which workflow and agent it belongs to (`extra_body`), so the cache policy knows which
workflows are running and can predict who comes next; the last call says `workflow_done`.

    pbkv serve --model tiny --policy pbkv &
    python examples/multi_agent.py --base-url http://127.0.0.1:8000/v1 --workflows 20

The router's answer decides when it names a specialist (a real model, e.g. `--model smollm2`).
The built-in `tiny` model is random, so its answers name nobody; then a seeded rule stands in
(each kind of task has its usual route, with a review loop), so runs are reproducible.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai

SYSTEM = {
    "router": "You are the router of a small software team. Read the task and the work so far. Answer "
              "with one word: the specialist who should act next (coder, researcher, reviewer, writer), "
              "or DONE when the task is complete. Prefer research before code, review after code, and "
              "a writer for the final answer.",
    "coder": "You are the coder. You write small, correct, well-tested Python functions with type hints "
             "and docstrings. Reply with code only, then one line on how you tested it. Keep to the "
             "standard library unless the task says otherwise; never invent APIs.",
    "researcher": "You are the researcher. You find the facts a task needs: definitions, formulas, edge "
                  "cases, known pitfalls. Reply with short bullet points and name what is uncertain.",
    "reviewer": "You are the reviewer. Check the latest code or answer for bugs, missing edge cases and "
                "unclear names. Reply APPROVE, or list the problems to fix, most important first.",
    "writer": "You are the writer. Turn the work so far into the final answer for the user: a short "
              "summary, then the result, in plain language.",
}
SPECIALISTS = ("coder", "researcher", "reviewer", "writer")
TASKS = {
    "code": ["Write a function that merges overlapping intervals.", "Write a function that parses ISO dates.",
             "Write an LRU cache class with get and put.", "Write a function that validates IBAN numbers."],
    "research": ["Explain how HTTP/2 flow control works.", "Summarise the trade-offs of B-trees versus LSM trees.",
                 "What limits the speed of a KV cache on a GPU?", "How does TCP congestion control recover?"],
    "mixed": ["Find the formula for compound interest and implement it.",
              "Research the Luhn check and write a validator.", "Look up the haversine formula and code it."],
}


@dataclass
class CallResult:
    workflow: str
    agent: str
    seconds: float
    prompt_tokens: int
    completion_tokens: int


class Stopped(Exception):
    """A workflow stopped between two calls: the run was interrupted (Ctrl-C)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `run_pool`: queued workflows were cancelled; `results` holds what the
    workflows that completed returned (in order), `completed` of `total`."""

    def __init__(self, results: list, completed: int, total: int):
        super().__init__(f"interrupted: {completed} of {total} workflows completed")
        self.results, self.completed, self.total = results, completed, total


def run_pool(work, workflows: int, concurrency: int) -> list:
    """`work(i, stop)` for i in range(workflows) on `concurrency` threads; their results in
    order. On Ctrl-C (or the first failure) the queued workflows are cancelled and the running
    ones stop before their next call (`stop` is set): `Interrupted` carries the completed ones,
    a failure is raised as it is."""
    if concurrency < 1:
        raise ValueError(f"--concurrency {concurrency}: must be at least 1")
    stop = threading.Event()
    pool = ThreadPoolExecutor(concurrency)
    futures = [pool.submit(work, i, stop) for i in range(workflows)]
    try:
        out = [f.result() for f in futures]
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)   # first: no queued workflow starts after stop
        stop.set()
        done = [f.result() for f in futures if f.done() and not f.cancelled() and f.exception() is None]
        raise Interrupted(done, len(done), workflows) from None
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        stop.set()
        raise
    pool.shutdown()
    return out


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line naming the option (no usage block), exit 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def at_least(least: int):
    """argparse type: a whole number >= `least`."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {least}")
        return value
    return check


def server_error(e: Exception, base_url: str) -> str | None:
    """One line for an error of the openai client talking to `base_url`, or None for another."""
    if isinstance(e, openai.APIConnectionError):
        return f"cannot reach the server at {base_url}: {e}"
    if isinstance(e, openai.APIStatusError):
        return f"the server at {base_url} answered {e.status_code}: {e.message}"
    if isinstance(e, httpx.HTTPError):
        return f"{base_url}: {e}"
    return None


def planned_route(kind: str, rng: random.Random) -> list[str]:
    """The seeded stand-in for the router: the specialists in order (the router runs between)."""
    if kind == "code":
        route = ["coder"] + ["reviewer", "coder"] * rng.randint(0, 2) + ["reviewer"]
    elif kind == "research":
        route = ["researcher"] * rng.randint(1, 2)
    else:
        route = ["researcher", "coder"] + ["reviewer", "coder"] * rng.randint(0, 1) + ["reviewer"]
    return route + ["writer"]


def run_workflow(client: openai.OpenAI, model: str, index: int, seed: int = 0, hints: bool = True,
                 max_tokens: int = 16, base_url: str | None = None,
                 stop: threading.Event | None = None) -> list[CallResult]:
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choice(sorted(TASKS))
    task = rng.choice(TASKS[kind])
    wid = f"demo-{seed}-{index}"
    plan, transcript, results = planned_route(kind, rng), [], []
    done_sent = False

    def call(agent: str, last: bool) -> str:
        if stop is not None and stop.is_set():
            raise Stopped(wid)
        work = "".join(f"\n[{who}] {text}" for who, text in transcript) or "\n(nothing yet)"
        messages = [{"role": "system", "content": SYSTEM[agent]},
                    {"role": "user", "content": f"Task ({kind}): {task}\nWork so far:{work}"}]
        extra = {"workflow_id": wid, "agent": agent, "workflow_done": last} if hints else {}
        start = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                           temperature=0, extra_body=extra)
        results.append(CallResult(wid, agent, time.perf_counter() - start, r.usage.prompt_tokens,
                                  r.usage.completion_tokens))
        return r.choices[0].message.content or ""

    for step in range(len(plan) + 1):  # router, specialist, router, ..., router (the last call)
        last_planned = step == len(plan)
        answer = call("router", last_planned).strip().lower()
        done_sent = last_planned
        named = next((s for s in SPECIALISTS if answer.startswith(s)), None)
        if answer.startswith("done") or last_planned:
            break
        agent = named or plan[step]
        transcript.append((agent, call(agent, False)))
    if hints and not done_sent and base_url:  # the model ended early: say so explicitly
        httpx.post(f"{base_url}/workflows/{wid}/end", headers={"Authorization": f"Bearer {client.api_key}"})
    return results


def run_many(base_url: str, model: str, workflows: int, concurrency: int = 4, seed: int = 0, hints: bool = True,
             max_tokens: int = 16, api_key: str = "none", first: int = 0) -> list[CallResult]:
    """The calls of `workflows` workflows on `concurrency` threads. Ctrl-C: `Interrupted`, its
    `results` the calls of the workflows that completed (`run_pool`)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    try:
        done = run_pool(lambda i, stop: run_workflow(client, model, first + i, seed, hints, max_tokens, base_url,
                                                     stop), workflows, concurrency)
    except Interrupted as e:
        e.results = [r for calls in e.results for r in calls]
        raise
    return [r for calls in done for r in calls]


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="tiny", help="the id the server serves (GET /v1/models)")
    ap.add_argument("--workflows", type=at_least(1), default=10)
    ap.add_argument("--concurrency", type=at_least(1), default=4)
    ap.add_argument("--max-tokens", type=at_least(1), default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hints", action="store_true", help="send plain OpenAI calls (no workflow hints)")
    ap.add_argument("--api-key", default="none")
    args = ap.parse_args()
    start = time.perf_counter()
    try:
        results = run_many(args.base_url, args.model, args.workflows, args.concurrency, args.seed,
                           not args.no_hints, args.max_tokens, args.api_key)
        completed = args.workflows
    except Interrupted as e:   # Ctrl-C: the queued workflows were cancelled; report what completed
        results, completed = e.results, e.completed
        print(f"interrupted: {completed} of {args.workflows} workflows completed", file=sys.stderr)
    except Exception as e:
        line = server_error(e, args.base_url)
        if line is None:
            raise
        ap.exit(1, f"{ap.prog}: {line}\n")
    wall = time.perf_counter() - start
    agents = {}
    for r in results:
        agents[r.agent] = agents.get(r.agent, 0) + 1
    print(f"{completed} workflows, {len(results)} calls in {wall:.1f} s ({len(results) / wall:.1f} calls/s); "
          f"calls by agent: {dict(sorted(agents.items()))}")
    if completed < args.workflows:
        sys.exit(130)


if __name__ == "__main__":
    main()
