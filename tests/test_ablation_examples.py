"""examples/ablation_policies.py: every ablation loads by `module:Class` and runs a small
simulated replay next to pbkv (the docs' diagnosis commands use them)."""

import sys
from pathlib import Path

import pytest

from pbkv.bench.run import RunConfig, Workload, simulate
from pbkv.cache import CacheConfig
from pbkv.engine.profiles import load_profile
from pbkv.policy.pbkv import DEAD_P, PBKVPolicy
from pbkv.policy.registry import needed_predictor, policy_class
from pbkv.predict.markov import fit_markov_seqs
from pbkv.workloads import generate, load_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = ["NoDead", "NoRetired", "NoStaleness", "NoCommon", "Dead02", "Dead10", "Dead20", "Dead35"]


@pytest.fixture(scope="module")
def hover():
    sys.path.insert(0, str(EXAMPLES))
    spec = load_spec("hover")
    workload = Workload("hover", generate(spec, 20, 3), spec.edges())
    train = Workload("hover", generate(spec, 60, 1), spec.edges())
    predictor = fit_markov_seqs([[c.agent for c in w] for w in train.workflows], horizon=3)
    yield workload, predictor, run(workload, predictor, "pbkv")
    sys.path.remove(str(EXAMPLES))


def run(workload, predictor, policy):
    return simulate(workload, RunConfig(policy=policy, concurrency=8, profile=load_profile("a6000-qwen3-32b"),
                                        cache=CacheConfig(12000, 12000, 0),
                                        predictors={needed_predictor(policy): predictor}, live_predictions=True))


@pytest.mark.parametrize("name", NAMES)
def test_each_ablation_is_pbkv_with_one_rule_changed_and_runs(hover, name):
    workload, predictor, base = hover
    cls = policy_class(f"ablation_policies:{name}")
    assert issubclass(cls, PBKVPolicy) and cls.name != PBKVPolicy.name
    r = run(workload, predictor, f"ablation_policies:{name}")
    assert r["prompt_tokens"] == base["prompt_tokens"]
    assert 0 < r["recomputed_tokens"] <= r["prompt_tokens"]


def test_the_dead_thresholds_are_the_only_change(hover):
    assert PBKVPolicy.dead_p == DEAD_P
    assert [policy_class(f"ablation_policies:{n}").dead_p for n in NAMES] == [0.0, DEAD_P, DEAD_P, DEAD_P,
                                                                              0.02, 0.10, 0.20, 0.35]


def test_nostaleness_takes_staleness_out_of_the_ranking(monkeypatch):
    """pbkv's eviction ranking reads staleness through NextUse._read (Staleness.state / .table),
    not Staleness.live: NoStaleness patched only `live` and ranked exactly like pbkv. On a small
    hover replay where staleness decides an eviction it now ranks as pbkv with `_read` and `live`
    switched off does, and unlike pbkv."""
    from pbkv.policy import next_use as nu
    from pbkv.policy.staleness import Staleness

    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = load_spec("hover")
    wl = Workload("hover", generate(spec, 12, 3), spec.edges())
    pred = fit_markov_seqs([[c.agent for c in w] for w in Workload("hover", generate(spec, 40, 1)).workflows],
                           horizon=3)
    distinct = len({h for w in wl.workflows for c in w for h in c.hash_ids}) * 16
    longest = max(c.input_length + c.output_length for w in wl.workflows for c in w)
    dev = max(int(distinct * 0.25), longest + 64)

    def sim(policy):
        return simulate(wl, RunConfig(policy=policy, concurrency=4, profile=load_profile("a6000-qwen3-32b"),
                                      cache=CacheConfig(dev, 0), predictors={"fused": pred}))

    read, scaled = nu.NextUse._read, [0]

    def spy(self, w, block, mask):
        r = read(self, w, block, mask)
        scaled[0] += r is not None
        return r

    monkeypatch.setattr(nu.NextUse, "_read", spy)
    pbkv = sim("pbkv")
    assert scaled[0] > 0                       # pbkv ranks nodes by staleness here
    scaled[0] = 0
    ablation = sim("ablation_policies:NoStaleness")
    assert scaled[0] == 0                      # NoStaleness ranks none by it
    monkeypatch.setattr(nu.NextUse, "_read", lambda self, w, block, mask: None)
    monkeypatch.setattr(Staleness, "live", lambda self, w, block: 1.0)
    without = sim("pbkv")
    key = ("device_hit_rate", "recomputed_tokens", "makespan_s")
    assert [ablation[k] for k in key] == [without[k] for k in key]
    assert ablation["recomputed_tokens"] != pbkv["recomputed_tokens"]
