"""Generate a trace (format v1, docs/trace-format.md) from a `WorkflowSpec`: seeded, deterministic, fast.

Prompt layout of every call: [preamble][agent prompt][task statement][history visible to the agent].
History items are each earlier call's output (owned by that call's agent) and each tool result
(owned by the agent whose call ran the tool), in the order they happened. So:
- an agent's prompt only grows inside a workflow: its previous prompt is a prefix of its next one;
- agents diverge right after the preamble (their own fixed prompts come first);
- the [preamble][agent prompt] blocks are the same in every workflow (cross-workflow reuse).

Hash ids (chained, docs/trace-format.md): a block's content is the (segment, start, end) pieces it covers and
its id is interned on (parent id, content), numbered 0, 1, 2, ... in order of first appearance in
the trace. Only [preamble][agent prompt] blocks are shared, so only they go through an intern table.
Every other block contains workflow-private tokens and belongs to exactly one (workflow, agent)
prompt chain (chains of different agents split at the agent prompt), and each such chain computes
each of its blocks once, so such a block is new by construction: it gets the next free id directly.
The one block that is recomputed is a chain's partial last block; if the agent's prompt did not
change since its previous call, its previous ids are reused, otherwise the partial block holds
content never seen before and gets a new id.

Determinism: workflow i draws from its own `random.Random(f"{name}:{seed}:{i}")` (a string seed is
hashed with SHA-512, not Python's per-process `hash()`), so the same (spec, N, seed) gives the same
trace and the first k workflows do not depend on N. Ids are numbered in workflow order, so they too
depend only on the workflows before.

Randomness per workflow, in order: task statement tokens, task vars and their words, turn vars and
their words; then per call: re-draws of the agent's `draw` vars, output tokens, the next agent, and,
when the workflow continues and the agent has a tool, the tool's tokens and wait. A tool does not
run after the last call (nobody reads its result).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Iterator

from pbkv.trace.call import Call, Trace, TraceMeta
from pbkv.trace.io import is_number
from pbkv.workloads.expr import Expr, ExprError, show
from pbkv.workloads.spec import END, MAX_PROMPT_TOKENS, MAX_TRACE_IDS, START, VarSpec, WorkflowSpec
from pbkv.workloads.spec_files import SpecError, load_spec, spec_source


@dataclass
class Run:
    """One generated workflow plus its hidden truth (never written to the trace)."""

    calls: list[Call]
    task: dict[str, Any]  # the hidden task variables
    turns: list[dict[str, Any]] = field(default_factory=list)  # hidden turn variables at each call
    task_tokens: int = 0  # length of the task statement
    history: list[tuple[str, int]] = field(default_factory=list)  # (owner agent, tokens): outputs and tool results


def generate(spec: WorkflowSpec | str | Path, workflows: int, seed: int = 0, source: str | None = None) -> Trace:
    """`workflows` workflows of `spec` (a spec, built-in name or file) as one trace, ordered by workflow
    then step. An error of generation names `source` (default: the file a name or path reads).
    A trace is held whole until written: one that grows past MAX_TRACE_IDS hash ids is refused
    then (a SpecError), not left to exhaust memory."""
    if not isinstance(spec, WorkflowSpec):
        source = source or spec_source(spec)
        spec = load_spec(spec)
    calls, held = [], 0
    for i, run in enumerate(runs(spec, workflows, seed, source)):
        held += sum(len(c.hash_ids) for c in run.calls)
        if held > MAX_TRACE_IDS:
            _too_large(source, i + 1, workflows)
        calls.extend(run.calls)
    meta = TraceMeta(block_size=spec.block_size, source=f"pbkv gen {spec.name} seed={seed}",
                     notes=f"{workflows} synthetic '{spec.name}' workflows. {spec.description}".strip())
    return Trace(meta=meta, calls=calls)


def _too_large(source: str | None, done: int, workflows: int):
    """Counted, not bounded by the worst case: a spec's worst case (`worst_ids`) is far above what
    its workflows hold (swe's would refuse 3,200 workflows that need a tenth of the bound)."""
    where = f"{source}: " if source else ""
    raise SpecError(f"{where}the trace would hold more than {MAX_TRACE_IDS:,} hash ids (about 4 GB, held "
                    f"until written) after {done:,} of {workflows:,} workflows; ask for fewer workflows, or "
                    f"lower flow.max_steps or the token counts")


def runs(spec: WorkflowSpec, workflows: int, seed: int = 0, source: str | None = None) -> Iterator[Run]:
    """Workflows 0..workflows-1 one by one, each with its hidden truth (for tests and oracles). An
    error only a draw reveals (an expression's value, a start list all 0) starts with `source:`,
    the spec's file, when given (a `WorkflowSpec` does not know the file it came from)."""
    if workflows < 0:
        raise ValueError(f"workflows must be >= 0, got {workflows}")
    gen = _Generator(spec)
    for i in range(workflows):
        try:
            run = gen.workflow(seed, i)
        except (ExprError, SpecError) as e:
            if source is None:
                raise
            raise type(e)(f"{source}: {e}") from None
        yield run


# ---------------------------------------------------------------- compiled form of a spec

class _Var:
    __slots__ = ("name", "values", "cum", "words", "noise", "persist")

    def __init__(self, name: str, spec: VarSpec):
        self.name, self.values = name, list(spec.values)
        self.cum = list(accumulate(finite_sum(spec.weights or [1.0] * len(self.values))))
        self.words = None if spec.words is None else [spec.words_for(v) for v in self.values]
        self.noise, self.persist = spec.noise, spec.persist

    def draw(self, rng: random.Random) -> int:
        return min(bisect_right(self.cum, rng.random() * self.cum[-1]), len(self.values) - 1)

    def word(self, rng: random.Random, idx: int) -> str | None:
        """A revealing word: from the true value, or with prob. `noise` from a uniformly chosen other value."""
        if self.words is None:
            return None
        n = len(self.values)
        if n > 1 and rng.random() < self.noise:
            j = rng.randrange(n - 1)
            idx = j + (j >= idx)
        return rng.choice(self.words[idx])


class _Agent:
    __slots__ = ("name", "key", "prompt", "out", "tool", "sees", "draw", "trans", "shared_ids", "shared_tail")

    def __init__(self, name: str, key: int, spec: WorkflowSpec):
        a = spec.agents[name]
        self.name, self.key, self.prompt, self.out = name, key, a.prompt, a.output
        self.tool = None if a.tool is None else (a.tool.tokens, a.tool.wait)
        self.sees = None if a.sees is None else frozenset(a.sees)
        self.draw = tuple(a.draw)
        self.trans = [(t.to, spec.compile_p(t.p)) for t in spec.flow.transitions.get(name, [])]
        self.shared_ids: list[int] | None = None  # ids of the full [preamble][prompt] blocks, set on first use
        self.shared_tail = (spec.preamble + a.prompt) % spec.block_size


class _Stream:
    """One agent's prompt chain in one workflow: ids of its full blocks and the partial tail length."""

    __slots__ = ("ids", "tail", "tokens", "seen", "last")

    def __init__(self, agent: _Agent, preamble: int):
        self.ids = list(agent.shared_ids)
        self.tail = agent.shared_tail
        self.tokens = preamble + agent.prompt
        self.seen = 0  # history items already considered (visible or not)
        self.last: list[int] | None = None  # hash ids at the previous call, valid while nothing was added


def transition_weights(items: list[tuple[str, float | Expr | None]], env: dict, where: str) -> list[float]:
    """The weight of each target of a transition list in state `env`: constants as given,
    expressions evaluated (each checked to be a number >= 0), None ('rest') = 1 - the others'
    sum, at least 0. Not normalised: the chance of a target is its weight over the sum, and a
    sum of 0 means END. The sum is always finite: weights whose sum overflows (two p's of 1e308)
    are divided by the largest, which keeps their ratios. The generator draws by it (`_pick`);
    diagnostics read it as a distribution."""
    ps, rest = [], None
    for k, (to, p) in enumerate(items):
        if p is None:
            rest = k
            p = 0.0
        elif not isinstance(p, float):
            try:
                p = p(env)
            except ExprError as e:
                raise ExprError(f"{where}: {e}") from None
            if not _finite_weight(p):
                raise ExprError(f"{where}: p of '{to}' evaluated to {show(p)}, expected a finite number >= 0")
        ps.append(p)
    if rest is not None:
        ps[rest] = max(0.0, 1.0 - sum(ps))
    return finite_sum(ps)


def _finite_weight(p) -> bool:
    """An int or float (a bool is 0 or 1) >= 0 and finite as a float: an expression may give an
    integer too large for one (10**400, which compares below inf but overflows every sum)."""
    return (isinstance(p, bool) or is_number(p)) and p >= 0


def finite_sum(weights: list[float]) -> list[float]:
    """`weights` (finite, >= 0) with a finite sum and the same ratios: as given when their sum is
    finite (so every such spec draws exactly as before), else each divided by the largest (two
    weights of 1e308 overflow to inf, and a draw scaled by inf always lands on the last). Floats
    out: an expression's ints (two of 10**308) have an int sum that no draw can be scaled by."""
    weights = [float(w) for w in weights]   # each is finite as a float (`_finite_weight`)
    if sum(weights) < math.inf:
        return weights
    top = max(weights)
    return [w / top for w in weights]


def _pick(rng: random.Random, items: list[tuple[str, float | Expr | None]], env: dict, where: str) -> str:
    """Choose a target from a transition list (p's normalised; None is 'rest'); END if every p is 0."""
    ps = transition_weights(items, env, where)
    total = sum(ps)
    if total <= 0:
        return END
    r = rng.random() * total
    for (to, _), p in zip(items, ps):
        r -= p
        if r < 0:
            return to
    return next(to for (to, _), p in zip(reversed(items), reversed(ps)) if p > 0)  # rounding at the end


class _Generator:
    def __init__(self, spec: WorkflowSpec):
        self.spec, self.bs = spec, spec.block_size
        self.agents = {a: _Agent(a, k + 1, spec) for k, a in enumerate(spec.agents)}  # key 0: preamble
        self.start = [(t.to, spec.compile_p(t.p)) for t in spec.flow.start]
        self.task_vars = [_Var(n, v) for n, v in spec.task.vars.items()]
        self.turn_vars = {n: _Var(n, v) for n, v in spec.turn_vars.items()}
        self.next_id = 0
        self.intern: dict[tuple, int] = {}  # (parent, content) -> id, for shared blocks only

    def _new_ids(self, n: int) -> range:
        r = range(self.next_id, self.next_id + n)
        self.next_id += n
        return r

    def _shared(self, agent: _Agent) -> list[int]:
        """Interned chain of the full blocks of [preamble][agent prompt] (computed once per agent)."""
        if agent.shared_ids is None:
            segs = [(0, self.spec.preamble), (agent.key, agent.prompt)]
            ids, parent, pieces, filled = [], -1, [], 0
            for key, length in segs:
                pos = 0
                while pos < length:
                    take = min(self.bs - filled, length - pos)
                    pieces.append((key, pos, pos + take))
                    pos, filled = pos + take, filled + take
                    if filled == self.bs:
                        k = (parent, tuple(pieces))
                        parent = self.intern.get(k)
                        if parent is None:
                            parent = self.intern[k] = self._new_ids(1)[0]
                        ids.append(parent)
                        pieces, filled = [], 0
            agent.shared_ids = ids
        return agent.shared_ids

    def _extend(self, st: _Stream, length: int):
        """Append a workflow-private segment of `length` tokens: its new full blocks get fresh ids."""
        bs, tail = self.bs, st.tail
        st.tokens += length
        if tail:
            if tail + length < bs:
                st.tail = tail + length
                return
            st.ids.extend(self._new_ids(1))
            length -= bs - tail
        n = length // bs
        if n:
            st.ids.extend(self._new_ids(n))
        st.tail = length - n * bs

    def _prompt(self, st: _Stream, agent: _Agent, history: list[tuple[str, int]]) -> list[int]:
        grew = False
        for owner, length in history[st.seen:]:
            if agent.sees is None or owner in agent.sees:
                self._extend(st, length)
                grew = True
        st.seen = len(history)
        if st.last is None or grew:
            st.last = st.ids + list(self._new_ids(1)) if st.tail else list(st.ids)
        return list(st.last)

    def _first(self, rng: random.Random, env: dict, wf_id: str) -> str:
        """The first agent of a workflow, drawn from `flow.start`; never END (every p 0 is an error)."""
        name = _pick(rng, self.start, env, f"{wf_id}: flow.start")
        if name == END:
            starts = [(t.to, t.p) for t in self.spec.flow.start]
            raise SpecError(f"{wf_id}: flow.start: every p evaluated to 0 with task {show(env['task'], 120)} "
                            f"and turn {show(env['turn'], 120)} (p's: {show(starts, 120)}); "
                            f"a workflow needs a first agent")
        return name

    def workflow(self, seed: int, i: int) -> Run:
        spec, agents = self.spec, self.agents
        # the spec name is part of the seed so that two workloads mixed in one experiment are independent
        rng = random.Random(f"{spec.name}:{seed}:{i}")
        wf_id = f"{spec.name}-{seed}-{i:05d}"
        task_tokens = rng.randint(*spec.task.tokens)
        task, task_words = {}, []
        for var in self.task_vars:
            idx = var.draw(rng)
            task[var.name] = var.values[idx]
            w = var.word(rng, idx)
            if w is not None:
                task_words.append(w)
        turn_idx = {n: v.draw(rng) for n, v in self.turn_vars.items()}
        turn = {n: self.turn_vars[n].values[k] for n, k in turn_idx.items()}
        turn_words = {n: self.turn_vars[n].word(rng, k) for n, k in turn_idx.items()}
        drawn: set[str] = set()  # turn vars already drawn at a call (the first such draw is the start value)
        head = f"task: {spec.task.text or spec.name}" + (f" ({'; '.join(task_words)})" if task_words else "")

        visits = dict.fromkeys(agents, 0)
        env = {"task": task, "turn": turn, "visits": visits, "step": 0, "last": START}
        history: list[tuple[str, int]] = []  # (owner agent, tokens), after the task statement
        streams: dict[str, _Stream] = {}
        calls: list[Call] = []
        turns: list[dict] = []
        name = self._first(rng, env, wf_id)
        wait = 0.0
        for step in range(spec.flow.max_steps):
            agent = agents[name]
            for v in agent.draw:
                if v in drawn:
                    var = self.turn_vars[v]
                    if rng.random() >= var.persist:
                        turn_idx[v] = var.draw(rng)
                        turn[v] = var.values[turn_idx[v]]
                    turn_words[v] = var.word(rng, turn_idx[v])
                drawn.add(v)
            st = streams.get(name)
            if st is None:
                self._shared(agent)
                st = streams[name] = _Stream(agent, spec.preamble)
                self._extend(st, task_tokens)
            hash_ids = self._prompt(st, agent, history)
            if st.tokens > MAX_PROMPT_TOKENS:
                raise SpecError(f"{wf_id} step {step}: agent {name}'s prompt would hold {st.tokens:,} tokens, more "
                                f"than {MAX_PROMPT_TOKENS:,}; lower the outputs, tool tokens or flow.max_steps")
            out = rng.randint(*agent.out)
            words = [w for w in turn_words.values() if w is not None]
            context = head + (f" | turn: {'; '.join(words)}" if words else "") + f" | agent: {name}"
            call = Call(workflow_id=wf_id, step=step, agent=name, workload=spec.name, input_length=st.tokens,
                        output_length=out, hash_ids=hash_ids, tool_wait=wait if wait > 0 else None,
                        context=context, done=False)
            calls.append(call)
            turns.append(dict(turn))
            history.append((name, out))
            visits[name] += 1
            env["step"], env["last"] = step + 1, name
            nxt = _pick(rng, agent.trans, env, f"{wf_id} step {step}: flow.transitions.{name}") \
                if agent.trans else END
            if nxt == END or step + 1 == spec.flow.max_steps:
                call.done = True
                break
            wait = 0.0
            if agent.tool is not None:
                (lo, hi), (wlo, whi) = agent.tool
                history.append((name, rng.randint(lo, hi)))
                wait = round(rng.uniform(wlo, whi), 3)
            name = nxt
        return Run(calls=calls, task=dict(task), turns=turns, task_tokens=task_tokens, history=history)
