"""Exact eviction orders of each policy on small hand-built trees, and the policy registry."""

import pytest

from helpers import BLOCK, ids, make_cache, put
from pbkv.cache import Tier
from pbkv.policy import CallEvent, PolicyContext, UnknownPolicy, make_policy, policy_names
from pbkv.policy.future import Future
from pbkv.policy.step_graph import StepGraph, graph_from_sequences
from pbkv.trace import Call


def eviction_order(cache):
    """Evict the whole device tier one token at a time; return the evicted nodes' end labels."""
    order = []
    original = cache.rules.on_evict
    cache.rules.on_evict = lambda node, src, dst: (order.append(node.blocks[-1]), original(node, src, dst))
    while cache.evict(Tier.DEVICE, 1):
        pass
    return order


def labels(*prompts):
    return [ids(p)[-1] for p in prompts]


def run_call(cache, pol, prompt, now, wf, agent, step):
    leaf = put(cache, prompt, now, workflow=wf, agent=agent)
    event = CallEvent(wf, agent, step, None, leaf, now)
    pol.on_call_start(event)
    pol.on_call_end(event)
    return leaf


def test_registry_lists_and_rejects_unknown_names():
    assert policy_names()[:4] == ["lru", "kvflow", "oracle", "pbkv"]
    assert {"continuum", "scalesim", "arc", "slru"} <= set(policy_names())
    with pytest.raises(UnknownPolicy, match=r"unknown policy 'lfu'; known policies: lru, kvflow, oracle, pbkv"):
        make_policy("lfu", PolicyContext())
    with pytest.raises(UnknownPolicy, match="cannot load"):
        make_policy("nowhere.mod:Cls", PolicyContext())
    assert make_policy("pbkv.policy.lru:LRUPolicy", PolicyContext()).name == "lru"


def test_a_policy_module_that_fails_as_it_is_imported_is_an_unknown_policy(tmp_path, monkeypatch):
    (tmp_path / "broken_policy.py").write_text("def oops(:\n")            # a user's syntax error
    (tmp_path / "raising_policy.py").write_text("raise RuntimeError('no config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownPolicy, match=r"cannot load 'broken_policy:P': importing broken_policy raised SyntaxError"):
        make_policy("broken_policy:P", PolicyContext())
    with pytest.raises(UnknownPolicy, match=r"importing raising_policy raised RuntimeError: no config file"):
        make_policy("raising_policy:P", PolicyContext())


def test_lru_order_is_least_recent_first():
    cache, _ = make_cache(100 * BLOCK)
    for i, p in enumerate(["k", "m", "n"]):
        put(cache, p, float(i))
    put(cache, "k", 9.0)  # touched again: now the most recent
    assert eviction_order(cache) == labels("m", "n", "k")


def test_kvflow_evicts_suffixes_then_fixed_by_descending_steps():
    graph = {"START": ["a"], "a": ["b"], "b": ["c"], "c": ["END"]}
    cache, pol = make_cache(100 * BLOCK, policy="kvflow", ctx=PolicyContext(block_size=BLOCK, agent_graph=graph))
    pol.on_workflow_start(1, "w1")
    pol.on_workflow_start(2, "w2")
    t = 0.0
    for agent, fixed in (("c", "C"), ("b", "B"), ("a", "A")):
        for wf in (1, 2):
            t += 1
            run_call(cache, pol, fixed + str(wf), t, wf, agent, step=0)
    # Now workflow 1 and 2 last ran "a": b is 1 step away, c 2 steps, a (no loop back) far.
    assert pol.min_steps == {"a": 5, "b": 1, "c": 2}
    # Suffixes first in LRU order, then fixed prompts: a (far), c (2 steps), b (next).
    assert eviction_order(cache) == labels("C1", "C2", "B1", "B2", "A1", "A2", "A", "C", "B")


def test_kvflow_static_sequence_gives_exact_positions():
    g = StepGraph({}, horizon=5, sequence=["r", "r", "r", "a", "c", "c", "w"])
    assert g.steps_from("START", -1) == {"r": 1, "a": 4}
    assert g.steps_from("r", 2) == {"a": 1, "c": 2, "w": 4}
    assert StepGraph(graph_from_sequences([["x", "y", "x"]])).steps_from("y") == {"x": 1, "y": 2}


def test_oracle_evicts_farthest_next_use_first():
    # One lane, 1 s per call: w0 runs AB, then w1 runs AC, then w2 runs AB again.
    calls = [Call(f"w{i}", 0, "x", len(p) * BLOCK, 1, ids(p)) for i, p in enumerate(["AB", "AC", "AB"])]
    future = Future([[c] for c in calls], BLOCK, 1, lambda c: 1.0)
    cache, pol = make_cache(100 * BLOCK, policy="oracle", ctx=PolicyContext(block_size=BLOCK, future=future))
    for i, p in enumerate(["AB", "AC", "DD"]):
        put(cache, p, float(i))
    future.started("w0", 0.0)
    future.call_ended("w0", 0, 1.0)
    future.ended("w0")
    assert (future.next_use(ids("AC")[1]), future.next_use(ids("AB")[1])) == (2.0, 3.0)
    for n in list(cache.tree.iter_nodes()):
        cache.refresh(n)
    # DD is never used again; AB next at 3 (w2); AC next at 2 (w1); A (prefix of both) at 2, last.
    assert eviction_order(cache) == labels("DD", "AB", "AC", "A")


def test_oracle_drops_dead_nodes_instead_of_offloading():
    calls = [Call("w0", 0, "x", 2 * BLOCK, 1, ids("EF"))]
    future = Future([calls], BLOCK, 1, lambda c: 1.0)
    cache, _ = make_cache(2 * BLOCK, host=10 * BLOCK, policy="oracle", ctx=PolicyContext(block_size=BLOCK, future=future))
    put(cache, "GH", 0.0)
    put(cache, "EF", 1.0)   # GH has no future use: dropped, not kept on host
    assert cache.usage[Tier.HOST] == 0 and cache.stats.dropped[Tier.DEVICE] == 2 * BLOCK
