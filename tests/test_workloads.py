"""Tests of the workflow spec language, the generator and the four built-ins (fast: a few seconds)."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import pytest
import yaml

from pbkv.trace.io import call_to_dict, read_trace, validate, write_trace
from pbkv.workloads import (ExprError, SpecError, WorkflowSpec, builtin_names, compile_expr, generate, load_spec,
                            parse_spec, runs)
from pbkv.workloads.spec_files import BUILTIN_DIR

BUILTINS = ["dialogue", "finance", "hover", "swe"]

# A small custom spec touching every feature: preamble, odd block size, `sees`, `draw`, a persistent
# turn var, a start list, `rest`, visits['Name With Space'], an agent without transitions (ends).
MINI = """
name: mini
description: a tiny custom workflow
block_size: 7
preamble: 10
agents:
  intake: {prompt: 12, output: [1, 9], draw: [mood]}
  Deep Worker:
    prompt: 30
    output: 5
    tool: {tokens: [3, 20], wait: [0.5, 1.0]}
    sees: [Deep Worker]
  checker: {prompt: 9, output: [2, 4], sees: [intake]}
  closer: {prompt: 20, output: 3}
task:
  text: do a small job
  tokens: [5, 15]
  vars:
    size: {values: [small, big], words: {small: [tiny job], big: [huge job]}, noise: 0.1}
turn_vars:
  mood: {values: [1, 2], words: {1: [calm], 2: [angry]}, persist: 0.5}
flow:
  start: [{to: intake, p: 0.8}, {to: checker, p: 0.2}]
  max_steps: 12
  transitions:
    intake:
      - {to: Deep Worker, p: "0.7 if task.size == 'big' else 0.3"}
      - {to: checker, p: rest}
    Deep Worker:
      - {to: Deep Worker, p: "0.6 if visits['Deep Worker'] < 3 else 0"}
      - {to: checker, p: "0.4 + 0.1 * turn.mood"}
    checker:
      - {to: checker, p: "0.2 if visits.checker < 3 else 0"}
      - {to: intake, p: "0.5 if step < 6 else 0"}
      - {to: closer, p: rest}
"""


@pytest.fixture(scope="module")
def mini() -> WorkflowSpec:
    return parse_spec(yaml.safe_load(MINI), "mini.yaml")


@pytest.fixture(scope="module")
def hover_runs():
    return list(runs(load_spec("hover"), 1000, 0))


def by_workflow(trace):
    return list(trace.workflows().values())


def reference_ids(spec: WorkflowSpec, run_list) -> list[list[int]]:
    """Hash ids rebuilt the slow, obvious way: every block of every prompt interned on (parent, content)."""
    bs, intern, out = spec.block_size, {}, []
    for i, run in enumerate(run_list):
        hist = 0  # history items that exist before the call
        for c in run.calls:
            a = spec.agents[c.agent]
            segs = [("pre", spec.preamble), (("agent", c.agent), a.prompt), (("task", i), run.task_tokens)]
            segs += [(("h", i, j), n) for j, (owner, n) in enumerate(run.history[:hist])
                     if a.sees is None or owner in a.sees]
            ids, parent, pieces, filled = [], -1, [], 0
            for key, n in segs:
                pos = 0
                while pos < n:
                    take = min(bs - filled, n - pos)
                    pieces.append((key, pos, pos + take))
                    pos, filled = pos + take, filled + take
                    if filled == bs:
                        parent = intern.setdefault((parent, tuple(pieces)), len(intern))
                        ids.append(parent)
                        pieces, filled = [], 0
            if pieces:
                ids.append(intern.setdefault((parent, tuple(pieces)), len(intern)))
            assert sum(n for _, n in segs) == c.input_length
            out.append(ids)
            hist += 1 + (a.tool is not None and not c.done)  # its output, then its tool's result
        assert hist == len(run.history)
    return out


# ---------------------------------------------------------------- built-ins and the trace format

def test_builtin_names():
    assert builtin_names() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_generates_valid_trace(name):
    spec = load_spec(name)
    trace = generate(spec, 200, seed=3)
    validate(trace)
    assert trace.block_size == spec.block_size
    assert trace.meta.source == f"pbkv gen {name} seed=3"
    wfs = by_workflow(trace)
    assert len(wfs) == 200 and wfs[0][0].workflow_id == f"{name}-3-00000"
    assert [c.workflow_id for c in trace.calls] == sorted(c.workflow_id for c in trace.calls)  # workflow, then step
    for calls in wfs:
        assert [c.done for c in calls] == [False] * (len(calls) - 1) + [True]
        assert calls[0].tool_wait is None
        for c in calls:
            assert c.workload == name and c.t is None and c.agent in spec.agents
            assert c.context.endswith(f"| agent: {c.agent}")
            assert 1 <= c.input_length <= 30_000 and c.output_length >= 1
    for prev, c in ((p, c) for calls in wfs for p, c in zip(calls, calls[1:])):
        tool = spec.agents[prev.agent].tool
        if tool is None or tool.wait[1] == 0:
            assert c.tool_wait is None
        else:
            assert tool.wait[0] <= c.tool_wait <= tool.wait[1]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_sizes_are_plausible(name):
    spec = load_spec(name)
    assert all(500 <= a.prompt <= 4000 for a in spec.agents.values())
    wfs = by_workflow(generate(spec, 300, seed=0))
    n = statistics.median(len(c) for c in wfs)
    lo, hi = {"hover": (8, 20), "swe": (8, 30), "finance": (8, 8), "dialogue": (6, 20)}[name]
    assert lo <= n <= hi
    assert max(c.input_length for calls in wfs for c in calls) <= 25_000


def test_write_read_roundtrip(tmp_path):
    trace = generate("dialogue", 20, seed=1)
    back = read_trace(write_trace(trace, tmp_path / "d.jsonl.gz"))
    assert [call_to_dict(c) for c in back.calls] == [call_to_dict(c) for c in trace.calls]


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("name", ["hover", "dialogue"])
def test_deterministic(name):
    a = [call_to_dict(c) for c in generate(name, 60, seed=7).calls]
    b = [call_to_dict(c) for c in generate(name, 60, seed=7).calls]
    assert a == b
    assert a != [call_to_dict(c) for c in generate(name, 60, seed=8).calls]


def test_first_workflows_do_not_depend_on_n():
    short = generate("swe", 25, seed=5).calls
    long = generate("swe", 80, seed=5).calls
    assert [call_to_dict(c) for c in long[:len(short)]] == [call_to_dict(c) for c in short]
    assert long[len(short)].workflow_id == "swe-5-00025"


# ---------------------------------------------------------------- prompt layout and hash ids

@pytest.mark.parametrize("name", BUILTINS + ["mini"])
def test_ids_equal_slow_reference(name, mini):
    """The incremental ids are exactly those of interning every block of every prompt."""
    spec = mini if name == "mini" else load_spec(name)
    run_list = list(runs(spec, 40 if name != "mini" else 300, seed=2))
    fast = [c.hash_ids for r in run_list for c in r.calls]
    assert fast == reference_ids(spec, run_list)


@pytest.mark.parametrize("block_size, preamble", [(1, 0), (16, 0), (7, 21), (64, 100)])
def test_ids_equal_slow_reference_any_block_size(block_size, preamble):
    data = yaml.safe_load(MINI)
    data.update(block_size=block_size, preamble=preamble)
    spec = parse_spec(data)
    run_list = list(runs(spec, 150, seed=4))
    assert [c.hash_ids for r in run_list for c in r.calls] == reference_ids(spec, run_list)


@pytest.mark.parametrize("name", BUILTINS + ["mini"])
def test_agent_prompt_only_grows(name, mini):
    spec = mini if name == "mini" else load_spec(name)
    bs = spec.block_size
    for calls in by_workflow(generate(spec, 100, seed=0)):
        last = {}
        for c in calls:
            if c.agent in last:
                old = last[c.agent]
                full = old.input_length // bs
                assert c.input_length >= old.input_length
                assert c.hash_ids[:full] == old.hash_ids[:full]
                if c.input_length == old.input_length:
                    assert c.hash_ids == old.hash_ids  # unchanged prompt, same ids
            last[c.agent] = c


@pytest.mark.parametrize("name", ["dialogue", "hover", "mini"])
def test_fixed_prompts_shared_across_workflows(name, mini):
    spec = mini if name == "mini" else load_spec(name)
    bs = spec.block_size
    heads = defaultdict(set)
    after = defaultdict(set)
    for c in generate(spec, 50, seed=0).calls:
        n = (spec.preamble + spec.agents[c.agent].prompt) // bs
        heads[c.agent].add(tuple(c.hash_ids[:n]))
        after[c.agent].add((c.workflow_id, c.hash_ids[n]))
    assert all(len(h) == 1 for h in heads.values())  # the same fixed blocks in every workflow
    for agent, items in after.items():  # ... and the next block is private to the workflow
        ids_by_wf = defaultdict(set)
        for wf, h in items:
            ids_by_wf[h].add(wf)
        assert all(len(wfs) == 1 for wfs in ids_by_wf.values())
    # different agents share exactly the preamble's full blocks
    firsts = {a: next(iter(h)) for a, h in heads.items()}
    shared = spec.preamble // bs
    agents = list(firsts)
    for a in agents:
        for b in agents:
            if a < b:
                x, y = firsts[a], firsts[b]
                common = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                assert common == shared


def test_ids_in_first_appearance_order():
    seen = set()
    for c in generate("swe", 50, seed=0).calls:
        for h in c.hash_ids:
            if h not in seen:
                assert h == len(seen)
                seen.add(h)


# ---------------------------------------------------------------- workflow shapes and context

def test_finance_is_static():
    wfs = by_workflow(generate("finance", 100, seed=0))
    seqs = {tuple(c.agent for c in calls) for calls in wfs}
    assert seqs == {("researcher",) * 3 + ("analyst", "calculator", "calculator", "writer", "reviewer")}


def test_hover_retrievals_grow_with_hops(hover_runs):
    by_hops = defaultdict(list)
    for r in hover_runs:
        by_hops[r.task["hops"]].append(sum(c.agent == "retriever" for c in r.calls))
    means = [statistics.mean(by_hops[h]) for h in (2, 3, 4)]
    assert means[0] + 0.5 < means[1] < means[2] - 0.5
    noisy = [len(r.calls) for r in hover_runs if r.task["evidence"] == "noisy"]
    clean = [len(r.calls) for r in hover_runs if r.task["evidence"] == "clean"]
    assert statistics.mean(noisy) > statistics.mean(clean) + 1


@pytest.mark.parametrize("var", ["hops", "evidence"])
def test_context_word_reveals_value_with_noise(hover_runs, var):
    spec = load_spec("hover")
    v = spec.task.vars[var]
    hits = 0
    for r in hover_runs:
        ctx = {c.context.rsplit(" | agent:", 1)[0] for c in r.calls}
        assert len(ctx) == 1  # task words are drawn once and repeated in every call
        text = ctx.pop()
        hits += any(w in text for w in v.words_for(r.task[var]))
    assert abs(hits / len(hover_runs) - (1 - v.noise)) < 0.05


def test_turn_var_words_and_persistence():
    spec = load_spec("dialogue")
    topic = spec.turn_vars["topic"]
    hits = total = kept = redraws = 0
    for r in runs(spec, 400, seed=0):
        routes = [(c, t) for c, t in zip(r.calls, r.turns) if c.agent == "router"]
        for c, t in routes:
            total += 1
            hits += any(w in c.context for w in topic.words_for(t["topic"]))
        for (_, a), (_, b) in zip(routes, routes[1:]):
            redraws += 1
            kept += a["topic"] == b["topic"]
    assert abs(hits / total - (1 - topic.noise)) < 0.04
    # keep with p .6, else a fresh draw that repeats with p sum(w^2) = .275: ~.71
    assert 0.64 < kept / redraws < 0.78


def test_all_zero_transitions_end_and_max_steps_caps(mini):
    data = yaml.safe_load(MINI)
    data["flow"]["transitions"]["intake"] = [{"to": "checker", "p": "0 if task.size == 'big' else 0"}]
    data["flow"]["start"] = "intake"
    for calls in by_workflow(generate(parse_spec(data), 10, seed=0)):
        assert [c.agent for c in calls] == ["intake"]
    data = yaml.safe_load(MINI)
    data["flow"]["transitions"]["closer"] = [{"to": "closer"}]
    data["flow"]["max_steps"] = 4
    lengths = {len(calls) for calls in by_workflow(generate(parse_spec(data), 30, seed=0))}
    assert lengths == {4}


def test_edges():
    assert load_spec("finance").edges() == {
        "START": ["researcher"], "researcher": ["researcher", "analyst"], "analyst": ["calculator"],
        "calculator": ["calculator", "writer"], "writer": ["reviewer"], "reviewer": ["END"]}
    e = load_spec("hover").edges()
    assert e["START"] == ["planner"] and set(e["verifier"]) == {"retriever", "planner", "judge"}
    assert set(e["judge"]) == {"retriever", "END"}


# ---------------------------------------------------------------- spec files and errors

def test_custom_spec_yaml_and_json(tmp_path, mini):
    y = tmp_path / "mini.yaml"
    y.write_text(MINI)
    j = tmp_path / "mini.json"
    j.write_text(json.dumps(yaml.safe_load(MINI)))  # JSON: value keys of `words` become strings
    a, b = generate(load_spec(y), 50, seed=1), generate(load_spec(str(j)), 50, seed=1)
    validate(a)
    assert [call_to_dict(c) for c in a.calls] == [call_to_dict(c) for c in b.calls]
    assert {c.agent for c in a.calls} == {"intake", "Deep Worker", "checker", "closer"}


def mutate(fn):
    data = yaml.safe_load((BUILTIN_DIR / "hover.yaml").read_text())
    fn(data)
    return data


def set_p(i, p):
    return lambda d: d["flow"]["transitions"]["verifier"][i].update(p=p)


@pytest.mark.parametrize("fn, expected", [
    (lambda d: d["flow"]["transitions"]["verifier"][2].update(to="jugde"),
     "hover.yaml: flow.transitions.verifier[2].to: unknown agent 'jugde' (known: planner, retriever"),
    (set_p(0, "0.9 if vists.retriever < 2 else 0.1"),
     "flow.transitions.verifier[0].p: at column 8: unknown name 'vists'"),
    (set_p(0, "visits.retreiver < 2"), "unknown visits key 'retreiver'"),
    (set_p(0, "0.5 if task.evidence == 'nosiy' else 0"), "task.evidence is never 'nosiy'"),
    (set_p(0, "0.5 if (task.hops < 2 else 0"), "verifier[0].p: syntax error"),
    (set_p(0, "__import__('os').system('x')"), "only min, max can be called"),
    (set_p(0, "task.hops ** 2"), "Pow is not allowed"),
    (set_p(0, "(lambda: 1)()"), "only min, max can be called"),
    (set_p(0, -0.5), "flow.transitions.verifier[0].p: expected a number >= 0"),
    (lambda d: d["task"]["vars"]["hops"].update(weights=[0.5, 0.5]),
     "task.vars.hops.weights: has 2 weights for 3 values"),
    (lambda d: d["agents"]["planner"].pop("output"), "agents.planner.output: required field is missing"),
    (lambda d: d.pop("flow"), "hover.yaml: flow: required field is missing"),
    (lambda d: d["agents"]["planner"].update(output=[200, 100]), "agents.planner.output: expected an integer >= 1"),
    (lambda d: d["agents"]["planner"].update(prompt=100_001), "agents.planner.prompt:"),
    # every token count is bounded (an unbounded one exhausted memory while generating)
    (lambda d: d["agents"]["planner"].update(output=10**12),
     "hover.yaml: agents.planner.output: expected at most 100000 tokens (got 1000000000000)"),
    (lambda d: d["agents"]["planner"].update(output=[1, 100_001]),
     "agents.planner.output: expected at most 100000 tokens (got [1, 100001])"),
    (lambda d: d["task"].update(tokens=10**11), "task.tokens: expected at most 100000 tokens (got 100000000000)"),
    (lambda d: d["agents"]["retriever"]["tool"].update(tokens=10**11),
     "agents.retriever.tool.tokens: expected at most 100000 tokens (got 100000000000)"),
    (lambda d: d.update(preamble=100_001), "preamble:"),
    # a wait is at most a day (1e308-s waits summed to inf: NaN latencies in bench.json)
    (lambda d: d["agents"]["retriever"]["tool"].update(wait=[1e308, 1.7e308]),
     "hover.yaml: agents.retriever.tool.wait: expected at most 86400 s (got [1e+308, 1.7e+308])"),
    (set_p(0, "[1] * 100000000"), "flow.transitions.verifier[0].p: at column 1: '[1] * 100000000' would build "
                                  "a sequence of 100000000 items (at most 1000)"),
    # a function used as a namespace is called a function, not an unknown name
    (set_p(0, "min.real"), "verifier[0].p: at column 1: 'min' is a function: call it, e.g. min(a, b)"),
    (set_p(0, "max['x'] + 1"), "verifier[0].p: at column 1: 'max' is a function: call it, e.g. max(a, b)"),
    (lambda d: d["agents"]["planner"].update(propmt=5), "agents.planner.propmt: unknown field"),
    (lambda d: d["agents"]["judge"].update(sees=["planer"]), "agents.judge.sees[0]: unknown agent 'planer'"),
    (lambda d: d["agents"]["judge"].update(draw=["topic"]), "agents.judge.draw[0]: unknown turn variable 'topic'"),
    (lambda d: d["task"]["vars"]["hops"]["words"].pop(4), "task.vars.hops.words: no words for value(s) 4"),
    (lambda d: d["task"]["vars"]["hops"]["words"][4].append("a simple bridge between two pages"),
     "is listed for both 2 and 4"),
    (lambda d: d["task"]["vars"]["hops"].update(persist=0.5), "task.vars.hops.persist: only turn_vars persist"),
    (lambda d: d["flow"].update(start="END"), "flow.start[0].to: a workflow cannot start with END"),
    (lambda d: d["flow"]["transitions"]["judge"].append({"to": "planner", "p": "rest"}), "only one transition"),
])
def test_spec_errors_name_field_path(fn, expected):
    with pytest.raises(SpecError) as err:
        parse_spec(mutate(fn), "hover.yaml")
    assert expected in str(err.value)


def test_token_counts_at_the_bound_are_accepted():
    spec = parse_spec(mutate(lambda d: (d["agents"]["planner"].update(prompt=100_000, output=100_000),
                                        d["task"].update(tokens=[1, 100_000]))), "hover.yaml")
    assert spec.agents["planner"].output == (100_000, 100_000) and spec.task.tokens == (1, 100_000)
    assert parse_spec(mutate(lambda d: d["agents"]["retriever"]["tool"].update(wait=86_400))
                      ).agents["retriever"].tool.wait == (86_400.0, 86_400.0)  # a day: the bound on a wait


def test_load_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="not a built-in workload"):
        load_spec("hovr")
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "dup.yaml"
    bad.write_text("name: x\nname: y\n")
    with pytest.raises(SpecError, match=r"dup.yaml:2: not valid YAML: duplicate key 'name'"):
        load_spec(bad)
    bad.write_text("- just a list\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(bad)
    bad.write_bytes(b"\xff\xfe" + "name: x\n".encode("utf-16-le"))
    with pytest.raises(SpecError, match=r"dup.yaml: not UTF-8 text \(byte 0xff at offset 0\)"):
        load_spec(bad)


# ---------------------------------------------------------------- expressions

def test_expressions_evaluate():
    ns = {"task": ["hops"], "visits": ["a", "b c"]}
    env = {"task": {"hops": 3}, "visits": {"a": 2, "b c": 0}, "step": 4, "last": "a"}
    cases = {
        "0.9 if visits.a < task.hops else 0.1": 0.9,
        "visits['b c'] + visits[last] * 2": 4,
        "min(1, step / 2) - max(0, -1)": 1,
        "not (step > 3 and last == 'a') or 5": 5,
        "last in ['a', 'b c'] and 1 < step <= 4": True,
        "visits[last + 'x']": 0,  # a computed key that is not an agent counts 0 visits
    }
    for src, want in cases.items():
        e = compile_expr(src, ns, scalars=("step", "last"), dict_default={"visits": 0})
        assert e(env) == want, src
    with pytest.raises(ExprError, match="ZeroDivisionError"):
        compile_expr("1 / (step - 4)", ns, scalars=("step",))(env)


def test_expressions_refuse_long_sequences_before_building_them():
    ns = {"visits": ["a"]}
    env = {"visits": {"a": 10**8}, "step": 2}
    assert compile_expr("'ab' * 500", ns)(env) == "ab" * 500  # 1000 characters: the bound itself
    assert compile_expr("3 in [1, 2] * 2 + [4]", ns)(env) is False
    with pytest.raises(ExprError, match=r"at column 1: '\[1\] \* 100000000' would build a sequence of 100000000"):
        compile_expr("[1] * 100000000", ns)  # constants: refused at compile time, not after seconds
    with pytest.raises(ExprError, match="would build a sequence of 1002 items"):
        compile_expr("'ab' * 501", ns)
    with pytest.raises(ExprError, match=r"\(at most 1000\)"):
        compile_expr("[1] * 600 + [2] * 600", ns)
    late = compile_expr("0.5 if step < 3 else 1 in [1] * visits.a", ns, scalars=("step",))
    assert late(env) == 0.5
    t0 = time.perf_counter()
    with pytest.raises(ExprError, match=r"at column 27: '\[1\] \* visits.a' would build a sequence of 100000000"):
        late({**env, "step": 3})
    assert time.perf_counter() - t0 < 0.1
    # a constant operation that fails for another reason stays a run-time error, as before
    assert compile_expr("0 if step < 9 else 'a' + 1", ns, scalars=("step",))(env) == 0


def test_expressions_count_nested_list_items_toward_the_bound():
    # only the top level was counted: `[[[1] * 1000] * 1000] * 1000` passed as 1000 items, and
    # comparing two of them (or hashing one as a visits key) walked 1e9 items: a hang
    ns = {"visits": ["a"]}
    env = {"visits": {"a": 9}, "step": 2}
    assert compile_expr("[[1] * 9] * 100 == [[1] * 9] * 100", ns)(env) is True  # (1 + 9) * 100: the bound
    t0 = time.perf_counter()
    for src, n in [("[[1] * 10] * 100", 1100), ("[[]] * 1001", 1001), ("[[1] * 1000] * 1000", 1001000),
                   ("([[[[1]*1000]*1000]*1000]*1000 == [[[[1]*1000]*1000]*1000]*1000) * 0.5", 1001000),
                   ("[['ab'] * 600] + [[1] * 600]", 1202)]:
        with pytest.raises(ExprError, match=rf"would build a sequence of {n} items \(at most 1000\)"):
            compile_expr(src, ns)  # constants: refused when the spec loads
    late = compile_expr("step in [[1] * visits.a] * 100", ns, scalars=("step",))
    assert late(env) is False
    with pytest.raises(ExprError, match=r"at column 9: .* would build a sequence of 1200 items"):
        late({**env, "visits": {"a": 11}})
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("p", ["1" + "0" * 400, "(step + 1) * 1" + "0" * 400, "1e308 * 10"])
def test_a_p_evaluating_past_a_float_is_an_error_naming_the_transition(p):
    # 10**400 compares below inf but overflowed the sum of the list (OverflowError)
    data = yaml.safe_load(MINI)
    data["flow"]["transitions"]["intake"] = [{"to": "checker", "p": p}, {"to": "END", "p": 0.5}]
    data["flow"]["start"] = "intake"
    with pytest.raises(ExprError, match=r"flow.transitions.intake: p of 'checker' evaluated to ([0-9]{50}|inf)"
                                        r".*, expected a finite number >= 0$"):
        list(runs(parse_spec(data, "mini.yaml"), 3))


def test_integer_ps_whose_sum_passes_a_float_draw_like_float_ones():
    # two p's of 10**308 (ints from an expression): each a finite float, their int sum compared
    # below inf and crashed the draw (OverflowError); they draw as [1e308, 1e308] do
    def drawn(p):
        data = yaml.safe_load(MINI)
        data["flow"]["transitions"]["intake"] = [{"to": "checker", "p": p}, {"to": "END", "p": p}]
        data["flow"]["start"] = "intake"
        return [[c.agent for c in r.calls] for r in runs(parse_spec(data, "mini.yaml"), 50)]
    assert drawn(f"{10 ** 308} * 1") == drawn(1e308) == drawn(1.0)


def test_long_values_are_cut_in_error_messages():
    data = yaml.safe_load(MINI)
    data["flow"]["transitions"]["intake"] = [{"to": "checker", "p": "[1] * 300"}]
    data["flow"]["start"] = "intake"
    with pytest.raises(ExprError) as err:
        generate(parse_spec(data, "mini.yaml"), 1)
    msg = str(err.value)
    assert "flow.transitions.intake: p of 'checker' evaluated to (1, 1, 1," in msg
    assert msg.endswith(" 1,..., expected a finite number >= 0") and len(msg) < 200
    with pytest.raises(ExprError, match=r"^no key \('x{55}\.\.\. in task$"):  # 60 characters
        compile_expr("task[['x' * 200, 'x' * 200]]", {"task": None})({"task": {}})


@pytest.mark.parametrize("src", ["task", "task.hops.real", "open('x')", "[x for x in task]", "task.__class__",
                                 "step.bit_length()", "{'a': 1}", "task.hops if True", "", "a := 1", "'%s' % step"])
def test_expressions_reject_outside_whitelist(src):
    with pytest.raises(ExprError):
        compile_expr(src, {"task": ["hops"]}, scalars=("step",))


def test_huge_probabilities_do_not_overflow():
    # p's are relative weights: 1e308 against 1e308 is 50/50 (their sum overflowed to inf, which
    # made every workflow take the last target) and draws exactly as 1e307 against 1e307
    def spec(p):
        agent = {"prompt": 10, "output": 5}
        return parse_spec({"name": "big", "agents": {"a": agent, "b": agent}, "task": {"tokens": 5},
                           "flow": {"start": "a", "transitions": {"a": [{"to": "b", "p": p}, {"to": "END", "p": p}]}}})
    huge, big = generate(spec(1e308), 400, seed=0), generate(spec(1e307), 400, seed=0)
    assert [call_to_dict(c) for c in huge.calls] == [call_to_dict(c) for c in big.calls]
    two = sum(len(calls) == 2 for calls in by_workflow(huge))
    assert 150 < two < 250
    data = yaml.safe_load(MINI)  # an expression and a constant together, and `rest` next to them
    data["flow"]["transitions"]["intake"] = [{"to": "checker", "p": "1e308 if step > 0 else 0"},
                                             {"to": "closer", "p": 1.7e308}, {"to": "Deep Worker", "p": "rest"}]
    data["flow"]["start"] = "intake"
    seconds = [calls[1].agent for calls in by_workflow(generate(parse_spec(data), 400, seed=0))]
    assert set(seconds) == {"checker", "closer"} and 0.27 < seconds.count("checker") / 400 < 0.47  # 1 : 1.7


def test_huge_variable_weights_do_not_overflow():
    # weights [1e308, 1e308] summed to inf, and a draw scaled by inf always took the last value;
    # they mean what [1e307, 1e307] mean, and draw exactly as those do
    def drawn(w):
        spec = parse_spec({"name": "big", "agents": {"a": {"prompt": 10, "output": 5}}, "flow": {"start": "a"},
                           "task": {"tokens": 5, "vars": {"v": {"values": ["x", "y"], "weights": [w, w]}}}})
        return [r.task["v"] for r in runs(spec, 400, 0)]
    huge = drawn(1e308)
    assert huge == drawn(1e307) and 150 < huge.count("x") < 250


def test_a_prompt_longer_than_any_model_serves_is_an_error_naming_the_call():
    # every count within its bound, but each output joins the next prompt: 100,000 tokens a step
    agent = {"prompt": 10, "output": 100_000}
    spec = parse_spec({"name": "grows", "agents": {"a": agent}, "task": {"tokens": 5},
                       "flow": {"start": "a", "max_steps": 20, "transitions": {"a": [{"to": "a", "p": 1}]}}})
    with pytest.raises(SpecError, match=r"grows-0-00000 step 10: agent a's prompt would hold 1,000,015 tokens, "
                                        r"more than 1,000,000; lower the outputs"):
        generate(spec, 1, seed=0)


# ---------------------------------------------------------------- speed

def test_speed_sanity():
    spec = load_spec("hover")
    t0 = time.perf_counter()
    trace = generate(spec, 1000, seed=0)
    assert time.perf_counter() - t0 < 20  # about 0.2 s on a laptop core; generous for slow CI
    assert len({c.workflow_id for c in trace.calls}) == 1000
