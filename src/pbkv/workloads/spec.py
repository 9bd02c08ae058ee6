"""Workflow specs: the one language every synthetic workload is written in (a YAML or JSON file).

A spec names the agents (fixed prompt size, output size, an optional tool that runs after the call,
whose outputs each agent sees, which turn variables it re-draws), the task (statement size and hidden
variables drawn once per workflow, revealed only through noisy words), turn variables, and the flow
(start agent, transition lists whose probabilities are numbers or expressions, a step cap).
`generate.py` turns a spec into a trace; the built-ins in `builtin/` are written in this language.

Invariants of a `WorkflowSpec`, however it was built (checked at construction, never at generation):
- every agent named in `flow.start`, `flow.transitions` (keys and `to`) and `sees` exists; a `to`
  may also be END; no agent is called END or START;
- every name in an agent's `draw` is a turn variable; `persist` is set only on turn variables;
- ranges have lo <= hi; token counts (prompt, output, task and tool tokens) are 1..MAX_TOKENS, the
  preamble 0..MAX_TOKENS; waits are 0..MAX_WAIT_SECONDS (a day);
- a variable's values are distinct scalars; its weights match them in number, are numbers >= 0
  and sum to > 0; its noise and persist are numbers from 0 to 1 (never a boolean or a string:
  YAML reads `noise: yes` as True); its `words` (if any) give a non-empty list for every value,
  and no word names two values;
- some `p` of `flow.start` is not the constant 0 (a start list whose expressions all evaluate to 0
  is an error when a workflow is generated: every workflow needs a first agent);
- one workflow holds at most MAX_WORKFLOW_IDS hash ids however its draws fall (`worst_ids`: every
  call at the longest prompt it could have, up to MAX_PROMPT_TOKENS, for flow.max_steps calls);
  a generated trace may hold at most MAX_TRACE_IDS (counted by `generate` as it goes);
- every `p` is a number >= 0, `rest` (at most one per list: 1 - the sum of the others, floored at
  0), or an expression that parses and reads only known names (`task.*`, `turn.*`, `visits.*` with
  existing keys, `step`, `last`, `min`, `max`).
Loading (built-in names, files, error messages "FILE: field.path[i].name: what is wrong (got VALUE)"):
`spec_files.py`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from pbkv.trace.io import is_number
from pbkv.workloads.expr import Expr, ExprError, compile_expr, show

END, START = "END", "START"
REST = "rest"  # p of the remaining probability: max(0, 1 - sum of the list's other p's)
# The most tokens any one count of a spec may ask for. The generator makes a hash id per block of
# every prompt, and outputs and tool results join later prompts, so an unbounded count (a typo such
# as `output: 1000000000000`) would exhaust memory instead of failing with a message.
MAX_TOKENS = 100_000
# The longest prompt a generated call may have. Prompts grow by every output and tool result they
# show, so a spec within every per-count bound can still ask for prompts whose ids (one per block,
# copied per call) outgrow memory; no model serves a prompt this long anyway (checked per call).
MAX_PROMPT_TOKENS = 1_000_000
# The most hash ids the calls of one workflow may hold in all, at worst (`WorkflowSpec.worst_ids`):
# every call keeps its own list, so 100,000 calls of 100,000-token prompts in blocks of 1 would be
# 1.5e10 ids, hundreds of GB. 20 million ids are about 160 MB of lists.
MAX_WORKFLOW_IDS = 20_000_000
# The most hash ids one generated trace may hold: the generator keeps every workflow's calls until
# the trace is written, so 100 workflows each near MAX_WORKFLOW_IDS would need tens of GB. A trace
# takes ~18 bytes per id (400 swe workflows: 1.64 million ids, 29 MB), so 200 million are ~4 GB:
# about 49,000 swe workflows, or bench's 2,000 training workflows of a spec with 100,000-token
# prompts in blocks of 1 (what a spec may ask; 1.4 GB was measured for 60,000-token ones).
MAX_TRACE_IDS = 200_000_000
# The longest tool wait a spec may give, in seconds (a day). Waits add up along a workflow and
# into the simulator's clock: unbounded ones (a unit slip such as `wait: 1e308`) summed to inf and
# bench reported NaN latencies; no agent's tool waits a day between two calls.
MAX_WAIT_SECONDS = 86_400
# ---------------------------------------------------------------- field types

_number = is_number   # an integer too large for a float (10**400: YAML and JSON read it exactly) is not one


def _range(integer: bool, minimum: float, maximum: float = math.inf, unit: str = ""):
    """Validator for `n` or `[lo, hi]` -> (lo, hi), minimum <= lo <= hi <= maximum."""
    kind = "an integer" if integer else "a number"

    def check(v: Any) -> tuple:
        items = list(v) if isinstance(v, (list, tuple)) else [v, v]
        ok = len(items) == 2 and all(_number(x) and (not integer or float(x).is_integer()) for x in items)
        if not ok or items[0] > items[1] or items[0] < minimum:
            raise ValueError(f"expected {kind} >= {minimum:g} or [lo, hi] of such with lo <= hi")
        if items[1] > maximum:
            raise ValueError(f"expected at most {maximum:g}{unit}")
        return tuple(int(x) for x in items) if integer else tuple(float(x) for x in items)
    return BeforeValidator(check)


def _prob(v: Any) -> float | str:
    if _number(v) and v >= 0:
        return float(v)
    if isinstance(v, str) and v.strip():
        return v
    raise ValueError("expected a number >= 0 or an expression string")


def _fraction(v: Any) -> float:
    """A probability field: an int or float from 0 to 1, not a boolean or a string (YAML's `yes`)."""
    if _number(v) and 0 <= v <= 1:
        return float(v)
    raise ValueError("expected a number from 0 to 1")


def _weight(v: Any) -> float:
    """A weight: a finite int or float >= 0, not a boolean or a string."""
    if _number(v) and v >= 0:
        return float(v)
    raise ValueError("expected a number >= 0")


def _all_zero(items: list["Transition"]) -> bool:
    """Whether every p of a transition list is the constant 0 (no expression, no `rest`, which is 1 then)."""
    return all(not isinstance(t.p, str) and t.p == 0 for t in items)


def _start(v: Any) -> Any:
    return [{"to": v}] if isinstance(v, str) else v  # `start: planner` is `start: [{to: planner}]`


Tokens = Annotated[tuple[int, int], _range(True, 1, MAX_TOKENS, " tokens")]
Seconds = Annotated[tuple[float, float], _range(False, 0, MAX_WAIT_SECONDS, " s")]
Prob = Annotated[float | str, BeforeValidator(_prob)]
Fraction = Annotated[float, BeforeValidator(_fraction)]
Weight = Annotated[float, BeforeValidator(_weight)]
PromptTokens = Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)]
Count = Annotated[int, Field(strict=True, ge=1, le=100_000)]


def value_key(v: Any) -> str:
    """How a variable value is matched with the keys of `words` (YAML gives 2, JSON gives "2")."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # a misspelt field is an error, not ignored


# ---------------------------------------------------------------- models

class VarSpec(_Model):
    """A hidden variable: drawn from `values` by `weights`; `words` reveal it, wrong with prob. `noise`."""

    values: list[Any] = Field(min_length=1)
    weights: list[Weight] | None = None  # None: uniform
    words: dict[Any, list[str]] | None = None  # value -> words that reveal it in `context`
    noise: Fraction = 0.0  # prob. the word comes from a (uniformly chosen) wrong value
    persist: Fraction = 0.0  # turn vars: prob. a re-draw keeps the previous value

    @field_validator("values")
    @classmethod
    def _scalars(cls, values: list) -> list:
        for v in values:
            if not (isinstance(v, (str, bool)) or _number(v)):
                raise ValueError(f"values must be strings, numbers or booleans, got {show(v)}")
        keys = [value_key(v) for v in values]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"values must be distinct, repeated: {', '.join(dup)}")
        return values

    @field_validator("weights")
    @classmethod
    def _weights(cls, weights, info):
        values = info.data.get("values")
        if weights is None or values is None:
            return weights
        if len(weights) != len(values):
            raise ValueError(f"has {len(weights)} weights for {len(values)} values")
        if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
            raise ValueError("weights must be >= 0 and sum to more than 0")
        return weights

    @field_validator("words")
    @classmethod
    def _words(cls, words, info):
        values = info.data.get("values")
        if words is None or values is None:
            return words
        known = {value_key(v) for v in values}
        out = {value_key(k): ws for k, ws in words.items()}
        extra = sorted(set(out) - known)
        if extra:
            raise ValueError(f"words for unknown value(s) {', '.join(extra)} (values: {', '.join(sorted(known))})")
        missing = [value_key(v) for v in values if not out.get(value_key(v))]
        if missing:
            raise ValueError(f"no words for value(s) {', '.join(missing)}: every value needs at least one, "
                             f"or a missing word would itself reveal the value")
        owner: dict[str, str] = {}
        for k, ws in out.items():
            for w in ws:
                if owner.setdefault(w, k) != k:
                    raise ValueError(f"word {w!r} is listed for both {owner[w]} and {k}")
        return out

    def words_for(self, value: Any) -> list[str] | None:
        return None if self.words is None else self.words[value_key(value)]


class ToolSpec(_Model):
    """A tool (or user) that runs after the agent's call: its result joins the history."""

    tokens: Tokens
    wait: Seconds = (0.0, 0.0)  # seconds outside the LLM; the `tool_wait` of the next call


class AgentSpec(_Model):
    prompt: PromptTokens  # fixed prompt tokens (role, tools, examples): the same in every workflow
    output: Tokens
    tool: ToolSpec | None = None
    sees: list[str] | None = None  # agents whose outputs/tool results this agent's prompt shows; None: all
    draw: list[str] = []  # turn variables re-drawn just before this agent's call


class TaskSpec(_Model):
    text: str = ""  # a short description of the task, the start of every call's `context`
    tokens: Tokens  # the task statement: first item of every workflow's history
    vars: dict[str, VarSpec] = {}


class Transition(_Model):
    to: str
    p: Prob = 1.0


class FlowSpec(_Model):
    start: Annotated[list[Transition], BeforeValidator(_start), Field(min_length=1)]
    max_steps: Count = 100
    transitions: dict[str, list[Transition]] = {}


class WorkflowSpec(_Model):
    """A whole workload family. Build with `load_spec` / `parse_spec` for file-aware error messages."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    block_size: Annotated[int, Field(strict=True, ge=1, le=4096)] = 16
    preamble: Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)] = 0  # tokens shared by every agent
    agents: dict[str, AgentSpec] = Field(min_length=1)
    task: TaskSpec
    turn_vars: dict[str, VarSpec] = {}
    flow: FlowSpec

    @model_validator(mode="after")
    def _references(self) -> "WorkflowSpec":
        errors = list(self._problems())
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def _problems(self):
        agents = list(self.agents)
        known = ", ".join(agents)
        turn_vars = ", ".join(self.turn_vars) or "none"
        for a, spec in self.agents.items():
            if a in (END, START) or not a:
                yield f"agents.{a}: '{a}' cannot be an agent name"
            for i, s in enumerate(spec.sees or []):
                if s not in self.agents:
                    yield f"agents.{a}.sees[{i}]: unknown agent {s!r} (known: {known})"
            for i, d in enumerate(spec.draw):
                if d not in self.turn_vars:
                    yield f"agents.{a}.draw[{i}]: unknown turn variable {d!r} (known: {turn_vars})"
        for v, var in self.task.vars.items():
            if var.persist:
                yield f"task.vars.{v}.persist: only turn_vars persist (task vars are drawn once), got {var.persist}"
        lists = [("flow.start", self.flow.start, False)]
        for a, items in self.flow.transitions.items():
            if a not in self.agents:
                yield f"flow.transitions.{a}: unknown agent {a!r} (known: {known})"
            lists.append((f"flow.transitions.{a}", items, True))
        if _all_zero(self.flow.start):
            yield "flow.start: every p is 0 (a workflow needs a first agent)"
        for path, items, end_ok in lists:
            for i, t in enumerate(items):
                if t.to == END and not end_ok:
                    yield f"{path}[{i}].to: a workflow cannot start with END (it needs at least one call)"
                elif t.to not in self.agents and not (end_ok and t.to == END):
                    yield f"{path}[{i}].to: unknown agent {t.to!r} (known: {known}{', or END' if end_ok else ''})"
                if t.p == REST:
                    if sum(u.p == REST for u in items) > 1:
                        yield f"{path}[{i}].p: only one transition of a list can be {REST!r}"
                elif isinstance(t.p, str):
                    try:
                        self.compile_p(t.p)
                    except ExprError as e:
                        yield f"{path}[{i}].p: {e} in {show(t.p)}"
        yield from self._size_problems()

    def _size_problems(self):
        total = self.worst_ids()
        if total > MAX_WORKFLOW_IDS:
            steps = self.flow.max_steps
            peak = min(self._worst_prompt(steps - 1), MAX_PROMPT_TOKENS)
            yield (f"flow.max_steps: one workflow could hold {total:,} hash ids ({steps:,} calls of prompts up to "
                   f"{peak:,} tokens, in blocks of {self.block_size} token{'s' * (self.block_size > 1)}), more "
                   f"than {MAX_WORKFLOW_IDS:,}; lower flow.max_steps or the token counts (preamble, agents' "
                   f"prompt, output and tool tokens, task.tokens), or raise block_size")

    def _worst_prompt(self, step: int) -> int:
        """The most tokens the prompt of call `step` could hold: the longest fixed part, then at
        most the largest output and tool result for every call before it."""
        fixed, grow = self._prompt_growth()
        return fixed + step * grow

    def _prompt_growth(self) -> tuple[int, int]:
        """(the longest [preamble][agent prompt][task] part, the most tokens one call adds to the history)."""
        fixed = self.preamble + max(a.prompt for a in self.agents.values()) + self.task.tokens[1]
        grow = max(a.output[1] + (a.tool.tokens[1] if a.tool else 0) for a in self.agents.values())
        return fixed, grow

    def worst_ids(self) -> int:
        """An upper bound on the hash ids the calls of one workflow hold in all: flow.max_steps
        calls, each at its longest possible prompt (a longer one than MAX_PROMPT_TOKENS is an
        error when generated), one id per started block."""
        (fixed, grow), bs = self._prompt_growth(), self.block_size
        return sum(-(-min(fixed + step * grow, MAX_PROMPT_TOKENS) // bs) for step in range(self.flow.max_steps))

    # ------------------------------------------------------------ helpers for the generator
    def compile_p(self, p: float | str) -> float | Expr | None:
        """A transition probability as a constant, a checked compiled expression, or None for 'rest'."""
        if not isinstance(p, str):
            return p
        if p == REST:
            return None
        choices: dict[str, list] = {f"task.{k}": v.values for k, v in self.task.vars.items()}
        choices.update({f"turn.{k}": v.values for k, v in self.turn_vars.items()})
        choices["last"] = [START, *self.agents]
        return compile_expr(p, {"task": list(self.task.vars), "turn": list(self.turn_vars),
                                "visits": list(self.agents)},
                            scalars=("step", "last"), choices=choices, dict_default={"visits": 0})

    def edges(self) -> dict[str, list[str]]:
        """The static agent graph: START and every agent -> each possible next agent or END.

        A target whose p is the constant 0 is left out; an agent without transitions -> [END].
        Not shown: ends caused by `max_steps` or by every p of a list evaluating to 0 (for
        `flow.start` that is an error, not an end).
        """
        def targets(items):
            return list(dict.fromkeys(t.to for t in items if isinstance(t.p, str) or t.p > 0)) or [END]
        out = {START: targets(self.flow.start)}
        for a in self.agents:
            out[a] = targets(self.flow.transitions.get(a, []))
        return out
