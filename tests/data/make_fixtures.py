"""Write the small trace fixtures of `tests/data/` (run from anywhere; deterministic, stdlib only).

    python tests/data/make_fixtures.py

Each fixture has the shape of one kind of real agent trace, made small enough that its
statistics can be counted by hand (the tests in `tests/test_trace_stats.py` do so):
- `chatdev-mini.jsonl`: a multi-agent software team (ChatDev-like): three workflows of 7, 7 and 4
  calls by five roles; a prompt is the role's system message (2 blocks), the task (1 block) and
  the latest message (1 partial block); arrival times `t`, a `context` text, and an extra field
  (`logged_prompt_tokens`) that readers must keep.
- `bfcl-mini.jsonl`: tool calls (BFCL-like): one agent per API class plus `responder`; a prompt is
  a system prompt shared by every workflow (3 blocks), the task (1 block) and one block per
  earlier call of the workflow; no timestamps.
- `dialogue-mini.jsonl`: a one-agent dialogue (tau-bench-like): agent `assistant`; a prompt is the
  system prompt (2 blocks) and one block per user turn so far; `tool_wait` = the user's time.
Hash ids are chained the way the format requires: a block's id names the whole prefix up to and
including that block (ids numbered in order of first appearance).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = 16


class Prefixes:
    """Chained ids: one id per distinct prefix of block contents."""

    def __init__(self):
        self.ids: dict[tuple, int] = {}

    def hash_ids(self, blocks: list) -> list[int]:
        return [self.ids.setdefault(tuple(blocks[: i + 1]), len(self.ids)) for i in range(len(blocks))]


def meta(workload: str, notes: str) -> dict:
    return {"pbkv_trace": 1, "block_size": BLOCK, "source": "hand-made for pbkv's tests "
            "(tests/data/make_fixtures.py)", "license": "Apache-2.0", "workload": workload, "notes": notes}


CHATDEV = {  # workflow -> roles in step order
    "chatdev-a": ["Chief Product Officer", "Chief Executive Officer", "Programmer", "Code Reviewer",
                  "Programmer", "Code Reviewer", "Programmer"],
    "chatdev-b": ["Chief Product Officer", "Chief Executive Officer", "Programmer", "Code Reviewer",
                  "Programmer", "Software Test Engineer", "Programmer"],
    "chatdev-c": ["Chief Product Officer", "Programmer", "Code Reviewer", "Programmer"],
}


def chatdev() -> list[dict]:
    ids, out = Prefixes(), []
    for w, (wf, roles) in enumerate(CHATDEV.items()):
        t = 0.0
        for step, agent in enumerate(roles):
            tail = 1 + (7 * step + 3 * w) % BLOCK  # tokens of the latest message: 1..16
            blocks = [("system", agent, 0), ("system", agent, 1), ("task", wf), ("message", wf, step)]
            output = 20 + 37 * ((step + w) % 5)
            out.append({"workflow_id": wf, "step": step, "agent": agent, "workload": "chatdev",
                        "t": t, "input_length": 3 * BLOCK + tail, "output_length": output,
                        "hash_ids": ids.hash_ids(blocks), "context": f"task: app {wf[-1]}; turn {step}",
                        "done": step == len(roles) - 1, "logged_prompt_tokens": 3 * BLOCK + tail + 2})
            t = round(t + 1.5 + 0.25 * step, 2)
    return out


BFCL = {
    "bfcl-1": ["GorillaFileSystem", "GorillaFileSystem", "responder", "TravelAPI", "responder"],
    "bfcl-2": ["VehicleControlAPI", "responder", "VehicleControlAPI", "VehicleControlAPI", "responder"],
    "bfcl-3": ["TradingBot", "responder", "GorillaFileSystem", "responder"],
}


def bfcl() -> list[dict]:
    ids, out = Prefixes(), []
    for wf, agents in BFCL.items():
        history: list = []
        for step, agent in enumerate(agents):
            blocks = [("system", 0), ("system", 1), ("system", 2), ("task", wf)] + history
            out.append({"workflow_id": wf, "step": step, "agent": agent, "workload": "bfcl",
                        "input_length": BLOCK * len(blocks), "output_length": 40 if agent == "responder" else 12,
                        "hash_ids": ids.hash_ids(blocks), "context": f"user turn of {wf}",
                        "done": step == len(agents) - 1})
            history.append(("result", wf, step))
    return out


DIALOGUE = {"dlg-1": 4, "dlg-2": 3, "dlg-3": 2}  # workflow -> calls


def dialogue() -> list[dict]:
    ids, out = Prefixes(), []
    for wf, n in DIALOGUE.items():
        for step in range(n):
            blocks = [("system", 0), ("system", 1)] + [("turn", wf, k) for k in range(step + 1)]
            out.append({"workflow_id": wf, "step": step, "agent": "assistant", "workload": "dialogue",
                        "tool_wait": 0.0 if step == 0 else 2.0 + step, "input_length": BLOCK * len(blocks),
                        "output_length": 30 + 5 * step, "hash_ids": ids.hash_ids(blocks),
                        "context": f"user message {step} of {wf}", "done": step == n - 1})
    return out


FIXTURES = {
    "chatdev-mini.jsonl": (meta("chatdev", "ChatDev-like multi-agent runs"), chatdev),
    "bfcl-mini.jsonl": (meta("bfcl", "BFCL-like tool calls, one agent per API class"), bfcl),
    "dialogue-mini.jsonl": (meta("dialogue", "tau-bench-like one-agent dialogues"), dialogue),
}


def render(name: str) -> str:
    """The exact text of fixture `name`."""
    head, calls = FIXTURES[name]
    return "".join(json.dumps(obj) + "\n" for obj in [head] + calls())


if __name__ == "__main__":
    for name in FIXTURES:
        (HERE / name).write_text(render(name), encoding="utf-8")
        print(HERE / name)
