"""Hostile or malformed spec files: each gives one clear `SpecError` (FILE: where: what), never a traceback."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest
import yaml

from pbkv.workloads import ExprError, SpecError, generate, load_spec, parse_spec
from pbkv.workloads.expr import show

AGENT = {"prompt": 100, "output": 10}


def small(**flow) -> dict:
    """A minimal valid spec (one agent `a`), with `flow` fields replaced."""
    return {"name": "x", "agents": {"a": dict(AGENT)}, "task": {"tokens": 50},
            "flow": {"start": "a", **flow}}


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_json_repeated_key_is_an_error_naming_its_line(tmp_path):
    text = ('{"name": "dup",\n "agents": {"a": {"prompt": 100, "output": 10},\n'
            '            "a": {"prompt": 5000, "output": 10}},\n'
            ' "task": {"tokens": 50}, "flow": {"start": "a", "max_steps": 3}}\n')
    with pytest.raises(SpecError, match=r"/dup.json:3: not valid JSON: duplicate key 'a'$"):
        load_spec(write(tmp_path, "dup.json", text))
    nested = json.dumps(small()).replace('"tokens": 50', '"tokens": 50, "tokens": 60')
    with pytest.raises(SpecError, match=r"/n.json:1: not valid JSON: duplicate key 'tokens'$"):
        load_spec(write(tmp_path, "n.json", nested))
    assert load_spec(write(tmp_path, "ok.json", json.dumps(small()))).agents["a"].prompt == 100


@pytest.mark.parametrize("name, text", [
    ("deep.json", "[" * 100_000 + "]" * 100_000),
    ("deep.yaml", "a: " + "[" * 50_000 + "]" * 50_000 + "\n"),
    ("deep2.json", json.dumps({**small(), "description": json.loads("[" * 200 + "]" * 200)})),
])
def test_deeply_nested_files_are_refused(tmp_path, name, text):
    with pytest.raises(SpecError, match=rf"{name}: nested too deeply \(more than \d+ levels\)$"):
        load_spec(write(tmp_path, name, text))


@pytest.mark.parametrize("p, expected", [
    ("+".join(["0.1"] * 50_000), "an expression of 199,999 characters (at most 1000)"),
    ("not " * 5000 + "step", "an expression of 20,004 characters (at most 1000)"),
    ("-" * 20_000 + "1", "an expression of 20,001 characters (at most 1000)"),
    ("(" * 5000 + "1" + ")" * 5000, "an expression of 10,001 characters (at most 1000)"),
    ("+".join(["0.1"] * 240), "nested too deeply"),
    ("not " * 240 + "step", "nested too deeply"),
    ("-" * 900 + "1", "nested too deeply"),
    ("(" * 400 + "1" + ")" * 400, "too many nested parentheses"),
])
def test_long_or_deep_expressions_are_clear_short_errors(tmp_path, p, expected):
    spec = small(max_steps=10, transitions={"a": [{"to": "a", "p": p}, {"to": "END", "p": 0.3}]})
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, "e.json", json.dumps(spec)))
    msg = str(err.value)
    assert "e.json: flow.transitions.a[0].p: " in msg and expected in msg
    assert len(msg.split("e.json: ", 1)[1]) < 250  # the expression is shown cut, not in full


def laughs(levels: int) -> str:
    """A YAML "billion laughs": `levels` lists of 9 aliases of the one before (9**levels strings)."""
    rows = ['  - &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    rows += [f"  - &l{k} [{','.join([f'*l{k - 1}'] * 9)}]" for k in range(1, levels)]
    return "name: bomb\ndescription:\n" + "\n".join(rows) + "\nagents: {a: {prompt: 10, output: 1}}\n" \
           "task: {tokens: 1}\nflow: {start: a}\n"


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=r"bomb.yaml: more than 100,000 values \(YAML aliases"):
        load_spec(write(tmp_path, "bomb.yaml", laughs(9)))
    assert time.perf_counter() - t0 < 2


def test_show_builds_at_most_about_its_width():
    x = ["lol"] * 9
    for _ in range(9):
        x = [x] * 9  # 9**10 strings by reference: a full repr would take gigabytes
    t0 = time.perf_counter()
    assert show(x) == "[" * 10 + "'lol', " * 6 + "'lol'..." and time.perf_counter() - t0 < 0.1
    for v in [1, -2.5, None, True, "it's", ("a",), (), [], {}, {1: [2, (3,)], "k": {"v": None}}, "x" * 80,
              list(range(50)), [[1, 2]] * 30, float("nan"), {"a"}]:
        full = repr(v)
        assert show(v) == (full if len(full) <= 60 else full[:57] + "..."), v


@pytest.mark.parametrize("text, expected", [
    ('{"name": "sur", "agents": {"a\\ud800": {"prompt": 100, "output": 10}}, "task": {"tokens": 50}, '
     '"flow": {"start": "a\\ud800"}}', r"sur.json: agents: the name 'a\ud800' holds a lone surrogate"),
    (json.dumps(small()).replace('"tokens": 50', '"tokens": 50, "text": "x\\udc00y"'),
     r"sur.json: task.text: 'x\udc00y' holds a lone surrogate \(not valid Unicode text\)$"),
])
def test_lone_surrogates_are_refused_at_load(tmp_path, text, expected):
    with pytest.raises(SpecError, match=expected.replace("\\u", "\\\\u")):
        load_spec(write(tmp_path, "sur.json", text))


MERGE = """name: mrg
agents:
  a: &base {prompt: 100, output: 10, tool: {tokens: 5}}
  b:
    <<: *base
    prompt: 200
  c: {<<: [*base, {output: 7}], sees: [a]}
task: {tokens: 50}
flow: {start: a, transitions: {a: [{to: b}], b: [{to: c}]}}
"""


def test_yaml_merge_keys_read_as_safe_load_reads_them(tmp_path):
    spec = load_spec(write(tmp_path, "merge.yaml", MERGE))
    assert spec.agents["b"].prompt == 200 and spec.agents["b"].output == (10, 10)
    assert spec.agents["b"].tool.tokens == (5, 5) and spec.agents["a"].prompt == 100
    assert spec.agents["c"].prompt == 100 and spec.agents["c"].output == (7, 7) and spec.agents["c"].sees == ["a"]
    assert spec.agents == parse_spec(yaml.safe_load(MERGE)).agents
    twice = MERGE.replace("    prompt: 200\n", "    prompt: 200\n    prompt: 300\n")
    with pytest.raises(SpecError, match=r"merge.yaml:7: not valid YAML: duplicate key 'prompt'"):
        load_spec(write(tmp_path, "merge.yaml", twice))


@pytest.mark.parametrize("key", ["[a, b]", "{x: 1}"])
def test_yaml_unhashable_key_is_not_valid_yaml(tmp_path, key):
    text = f"name: k\nagents:\n  {key}: {{prompt: 100, output: 10}}\ntask: {{tokens: 50}}\nflow: {{start: a}}\n"
    with pytest.raises(SpecError, match=r"k.yaml:3: not valid YAML: found unhashable key"):
        load_spec(write(tmp_path, "k.yaml", text))


def test_a_key_of_the_wrong_type_is_named_as_a_key(tmp_path):
    text = "name: k\nagents:\n  1: {prompt: 100, output: 10}\n  null: {prompt: 100, output: 10}\n" \
           "task: {tokens: 50}\nflow: {start: '1'}\n"
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, "k.yaml", text))
    lines = [line.split("k.yaml: ", 1)[1] for line in str(err.value).splitlines()]
    assert lines == ["agents: key 1: Input should be a valid string (got 1)",
                     "agents: key None: Input should be a valid string (got None)"]


def with_var(**var) -> dict:
    spec = small()
    spec["task"]["vars"] = {"v": {"values": ["x", "y"], "words": {"x": ["wx"], "y": ["wy"]}, **var}}
    return spec


@pytest.mark.parametrize("var, expected", [
    ({"noise": True}, "task.vars.v.noise: expected a number from 0 to 1 (got True)"),
    ({"noise": "0.5"}, "task.vars.v.noise: expected a number from 0 to 1 (got '0.5')"),
    ({"noise": 1.5}, "task.vars.v.noise: expected a number from 0 to 1 (got 1.5)"),
    ({"weights": [True, "3"]}, "task.vars.v.weights[0]: expected a number >= 0 (got True)"),
    ({"weights": [1, "3"]}, "task.vars.v.weights[1]: expected a number >= 0 (got '3')"),
    ({"weights": [1, float("nan")]}, "task.vars.v.weights[1]: expected a number >= 0 (got nan)"),
])
def test_float_fields_take_numbers_only(var, expected):
    with pytest.raises(SpecError) as err:
        parse_spec(with_var(**var), "lax.yaml")
    assert f"lax.yaml: {expected}" in str(err.value).splitlines()
    spec = {**small(), "turn_vars": {"t": {"values": [1, 2], "persist": False}}}
    with pytest.raises(SpecError, match=r"turn_vars.t.persist: expected a number from 0 to 1 \(got False\)"):
        parse_spec(spec, "lax.yaml")


HUGE = 10**400  # read exactly by YAML and JSON; too large for a float


@pytest.mark.parametrize("edit, expected", [
    (lambda s: s["flow"].update(transitions={"a": [{"to": "a", "p": HUGE}]}),
     "flow.transitions.a[0].p: expected a number >= 0 or an expression string"),
    (lambda s: s["agents"]["a"].update(output=HUGE), "agents.a.output: expected an integer >= 1"),
    (lambda s: s["agents"]["a"].update(tool={"tokens": [1, HUGE], "wait": 1}), "agents.a.tool.tokens: expected an"),
    (lambda s: s["agents"]["a"].update(tool={"tokens": 1, "wait": HUGE}), "agents.a.tool.wait: expected a number"),
    (lambda s: s["task"].update(tokens=HUGE), "task.tokens: expected an integer >= 1"),
    (lambda s: s["task"].update(vars={"v": {"values": [1, 2], "weights": [HUGE, 1]}}),
     "task.vars.v.weights[0]: expected a number >= 0"),
    (lambda s: s["task"].update(vars={"v": {"values": [1, 2], "noise": HUGE}}),
     "task.vars.v.noise: expected a number from 0 to 1"),
    (lambda s: s.update(turn_vars={"t": {"values": [1, 2], "persist": HUGE}}),
     "turn_vars.t.persist: expected a number from 0 to 1"),
    (lambda s: s.update(turn_vars={"t": {"values": [HUGE, 2]}}),
     "turn_vars.t.values: values must be strings, numbers or booleans, got 100000"),
])
def test_an_integer_too_large_for_a_float_is_a_field_error_naming_the_file(tmp_path, edit, expected):
    spec = small()
    edit(spec)
    with pytest.raises(SpecError) as err:  # not an OverflowError
        load_spec(write(tmp_path, "big.yaml", yaml.safe_dump(spec)))
    line = str(err.value)
    assert line.startswith(f"{tmp_path / 'big.yaml'}: {expected}") and len(line) < 300, line


def test_float_fields_take_ints_and_floats():
    var = parse_spec(with_var(noise=0, weights=[1, 2.5]), "ok.yaml").task.vars["v"]
    assert (var.noise, var.weights) == (0.0, [1.0, 2.5]) and type(var.noise) is float
    assert type(var.weights[0]) is float


@pytest.mark.parametrize("start", [[{"to": "a", "p": 0}], [{"to": "a", "p": 0}, {"to": "b", "p": 0.0}]])
def test_a_constant_all_zero_start_is_refused_at_load(start):
    spec = small(start=start)
    spec["agents"]["b"] = dict(AGENT)
    with pytest.raises(SpecError, match=r"^zero.yaml: flow.start: every p is 0 \(a workflow needs a first agent\)$"):
        parse_spec(spec, "zero.yaml")
    ok = small(start=[{"to": "a", "p": 0}, {"to": "b", "p": "rest"}])
    ok["agents"]["b"] = dict(AGENT)
    assert [c.agent for c in generate(parse_spec(ok), 3).calls] == ["b"] * 3


COND = """name: cond
agents: {coder: {prompt: 100, output: 10}, writer: {prompt: 100, output: 10}}
task: {tokens: 50, vars: {kind: {values: [code, text, other]}}}
flow:
  start:
    - {to: coder, p: "task.kind == 'code'"}
    - {to: writer, p: "task.kind == 'text'"}
"""


def test_a_start_list_evaluating_to_all_zero_is_an_error_naming_the_workflow_and_variables():
    spec = parse_spec(yaml.safe_load(COND), "cond.yaml")
    with pytest.raises(SpecError) as err:
        generate(spec, 10)
    msg = str(err.value)
    assert msg.startswith("cond-0-0000") and ": flow.start: every p evaluated to 0 with task {'kind': 'other'}" in msg
    assert "(p's: [('coder', \"task.kind == 'code'\")," in msg and msg.endswith("; a workflow needs a first agent")


def test_a_workflow_that_could_need_too_many_hash_ids_is_refused_at_load():
    # every count within its bound, but 100,000 calls of 100,000-token prompts in blocks of 1
    spec = {"name": "mem", "block_size": 1, "agents": {"a": {"prompt": 100_000, "output": 1}},
            "task": {"tokens": 1}, "flow": {"start": "a", "max_steps": 100_000, "transitions": {"a": [{"to": "a"}]}}}
    t0 = time.perf_counter()
    with pytest.raises(SpecError) as err:
        parse_spec(spec, "mem.yaml")
    assert time.perf_counter() - t0 < 1
    assert str(err.value) == (
        "mem.yaml: flow.max_steps: one workflow could hold 15,000,050,000 hash ids (100,000 calls of prompts up to "
        "200,000 tokens, in blocks of 1 token), more than 20,000,000; lower flow.max_steps or the token counts "
        "(preamble, agents' prompt, output and tool tokens, task.tokens), or raise block_size")
    spec["flow"]["max_steps"] = 190  # 190 calls of 100,001..100,190 tokens: 19,018,145 ids
    assert parse_spec(spec).flow.max_steps == 190
    spec["flow"]["max_steps"] = 200
    with pytest.raises(SpecError, match="one workflow could hold 20,020,100 hash ids"):
        parse_spec(spec)


def test_a_trace_that_grows_past_the_hash_id_bound_is_refused_naming_the_spec(tmp_path, monkeypatch):
    # gen keeps every workflow until it writes: 100 workflows of 100 calls of 100,000-token prompts
    # in blocks of 1 needed ~8 GB (a MemoryError traceback under a 4 GB limit); here the bound is
    # lowered so that the third workflow of 13 ids each passes it
    from typer.testing import CliRunner

    from pbkv.cli import app
    gen_mod = sys.modules["pbkv.workloads.generate"]  # the module: pbkv.workloads.generate is the function
    monkeypatch.setattr(gen_mod, "MAX_TRACE_IDS", 30)
    spec = {"name": "big", "block_size": 1, "agents": {"a": {"prompt": 5, "output": 1}},
            "task": {"tokens": 1}, "flow": {"start": "a", "max_steps": 2, "transitions": {"a": [{"to": "a"}]}}}
    path = write(tmp_path, "big.yaml", yaml.safe_dump(spec))
    assert [len(c.hash_ids) for c in generate(path, 1).calls] == [6, 7]   # 13 ids a workflow: 2 fit
    expected = (f"{path}: the trace would hold more than 30 hash ids (about 4 GB, held until written) after 3 of "
                f"100 workflows; ask for fewer workflows, or lower flow.max_steps or the token counts")
    with pytest.raises(SpecError) as err:
        generate(path, 100)
    assert str(err.value) == expected
    r = CliRunner().invoke(app, ["gen", "--spec", str(path), "-o", str(tmp_path / "o.jsonl")])  # gen's default: 100
    assert r.exit_code == 2 and " ".join(r.output.split()) == f"error: {expected}", r.output
    assert len(generate(path, 2).calls) == 4


def test_a_training_trace_past_the_bound_is_named_as_the_one_bench_trains_on(tmp_path, monkeypatch):
    # bench trains on at least TRAIN_WORKFLOWS workflows whatever --workflows: "fewer workflows" alone misled
    from types import SimpleNamespace as NS

    from pbkv.bench.predictors import TRAIN_WORKFLOWS, training_trace
    monkeypatch.setattr(sys.modules["pbkv.workloads.generate"], "MAX_TRACE_IDS", 30)
    spec = parse_spec({"name": "big", "block_size": 1, "agents": {"a": {"prompt": 5, "output": 1}},
                       "task": {"tokens": 1}, "flow": {"start": "a", "max_steps": 2, "transitions": {"a": [{"to": "a"}]}}})
    with pytest.raises(SpecError) as err:
        training_trace(NS(spec=spec, workflows=30, seed=0))
    assert str(err.value).startswith(f"the trace pbkv trains its predictor on ({TRAIN_WORKFLOWS:,} workflows of the "
                                     f"spec, seed 1: at least {TRAIN_WORKFLOWS:,} whatever --workflows): the trace would")
    assert str(err.value).endswith("; or give --train FILE or --predictor DIR")


@pytest.mark.parametrize("name, text", [("big.yaml", "name: x\nblock_size: " + "1" * 5000 + "\n"),
                                        ("big.json", '{"name": "x", "block_size": ' + "1" * 5000 + "}")])
def test_an_integer_too_long_to_read_names_the_file(tmp_path, name, text):
    with pytest.raises(SpecError, match=rf"/{name}: not valid (JSON|YAML): Exceeds the limit \(4300 digits\)"):
        load_spec(write(tmp_path, name, text))


def test_a_folder_named_like_a_spec_is_called_a_folder(tmp_path):
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(SpecError, match=r"d\.yaml: is a folder, not a spec file$"):
        load_spec(tmp_path / "d.yaml")
    with pytest.raises(SpecError, match=r"e\.yaml: no such spec file$"):
        load_spec(tmp_path / "e.yaml")


def test_a_json_spec_may_start_with_a_byte_order_mark_as_a_yaml_one_may(tmp_path):
    text = json.dumps(small())
    plain = load_spec(write(tmp_path, "s.json", text))
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + text.encode())
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbf" + yaml.safe_dump(small()).encode())
    assert load_spec(tmp_path / "bom.json") == plain == load_spec(tmp_path / "bom.yaml")


def test_an_expression_error_at_generation_names_the_spec_file(tmp_path):
    from typer.testing import CliRunner

    from pbkv.cli import app
    path = write(tmp_path, "s.yaml", yaml.safe_dump(small(transitions={"a": [{"to": "a", "p": "[1]"}]})))
    with pytest.raises(ExprError, match=rf"^{re.escape(str(path))}: x-0-00000 step 0: flow.transitions.a: p of 'a' evaluated to "
                                        r"\(1,\)"):
        generate(path, 1)
    r = CliRunner().invoke(app, ["gen", "--spec", str(path), "--workflows", "1", "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 2 and " ".join(r.output.split()).startswith(f"error: {path}: x-0-00000 step 0: "), r.output


def test_gen_help_states_gens_own_workflows_default():
    from typer.testing import CliRunner

    from pbkv.cli import app
    r = CliRunner().invoke(app, ["gen", "--help"], env={"COLUMNS": "200"})
    said = " ".join(r.output.split())
    assert "(gen: 100, bench and ablate: 400," in said and "[default: 100]" in said, said
