"""The vLLM connector's policy safety net, without vLLM (the scheduler-side `Shadow`): a policy
hook that raises is logged once, the shadow ranks by LRU from then on, the hook runs again on
LRU, the fallback is counted in the connector's stats, and every vLLM call keeps answering."""

import logging
from dataclasses import asdict
from itertools import count

import pytest

from pbkv.cache import Capacities, Tier
from pbkv.integrations.vllm.hints import parse_hints
from pbkv.integrations.vllm.shadow import Shadow
from pbkv.policy import Policy

BS = 4
BROKEN = "test_vllm_fallback:BrokenPolicy"
NEVER = 10**9


class BrokenPolicy(Policy):
    """Most recently used first (an order LRU never gives), and every hook call from the
    `fail_from`-th on raises. `calls` names the hooks called, in order."""

    name = "broken-mru"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls: list[str] = []
        self.fail_from = NEVER

    def priority(self, node):
        return (-node.last_access,)

    def _called(self, hook: str) -> None:
        self.calls.append(hook)
        if len(self.calls) >= self.fail_from:
            raise IndexError(f"bug in {hook}")

    def on_workflow_start(self, workflow, workflow_id):
        self._called("on_workflow_start")

    def on_workflow_end(self, workflow, nodes):
        self._called("on_workflow_end")

    def on_call_start(self, event):
        self._called("on_call_start")

    def on_call_end(self, event):
        self._called("on_call_end")

    def prefetch(self, request):
        self._called("prefetch")
        return []


def shadow(policy: str = BROKEN, fail_from: int = NEVER, **kw) -> Shadow:
    """A shadow with a device model of two 2-block prefixes, a RAM tier, and a clock that ticks
    once per reading (so every access time differs)."""
    ticks = count()
    sh = Shadow(BS, Capacities(16, 64, 0), policy, clock=lambda: float(next(ticks)), **kw)
    if fail_from != NEVER:
        sh.policy.fail_from = fail_from
    return sh


def serve(sh: Shadow, rid: str, keys: list[int], local: int = 0):
    """One whole request as vLLM drives it (no hints: a workflow of its own); its plan."""
    prompt = len(keys) * BS + 1
    ext = sh.match(rid, keys, prompt, local, parse_hints(None))
    sh.allocated(rid, local, ext)
    plan = sh.build([(rid, list(range(100, 101 + len(keys))), True, prompt)])
    sh.finished(rid)
    return plan


def a_then_b_then_a_then_c(sh: Shadow) -> None:
    """A and B fill the device model, A is used again, C needs room: LRU moves B to RAM, MRU A."""
    for rid, keys in (("a", [1, 2]), ("b", [3, 4]), ("a2", [1, 2]), ("c", [5, 6])):
        serve(sh, rid, keys)


def tier(sh: Shadow, keys: list[int]) -> Tier:
    node, matched = sh.tree.match(keys)
    assert matched == len(keys)
    return node.tier


def ranked_by_current_policy(sh: Shadow) -> bool:
    return sh.cache.rules is sh.policy and all(
        n.key == sh.policy.priority(n) for t in (Tier.DEVICE, Tier.HOST) for n in sh.cache.candidates(t))


HOOKS_PER_REQUEST = 5   # on_workflow_start, on_call_start, on_call_end, on_workflow_end, prefetch


@pytest.mark.parametrize("fail_from", range(1, 4 * HOOKS_PER_REQUEST + 1))
def test_a_raising_hook_falls_back_to_lru_once_and_serving_goes_on(fail_from, caplog):
    sh = shadow(fail_from=fail_from)
    broken = sh.policy
    with caplog.at_level(logging.ERROR):
        a_then_b_then_a_then_c(sh)
        for i in range(6):   # the broken policy would raise at every one of these: never asked again
            serve(sh, f"more{i}", [10 + i, 20 + i])
    failed_hook = broken.calls[fail_from - 1]
    assert len(broken.calls) == fail_from            # not called after it raised
    assert sh.stats.policy_fallbacks == 1
    assert asdict(sh.stats)["policy_fallbacks"] == 1   # what the connector's stats()/stats_path report
    assert sh.policy.name == "lru" and ranked_by_current_policy(sh)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert failed_hook in errors[0].getMessage() and "broken-mru" in errors[0].getMessage()
    assert sh.stats.requests == 10
    sh.cache.check()


def test_before_the_fallback_the_broken_policy_ranks_and_after_it_lru_does():
    control = shadow()   # never raises: its own (MRU) order sends A to RAM
    a_then_b_then_a_then_c(control)
    assert (tier(control, [1, 2]), tier(control, [3, 4])) == (Tier.HOST, Tier.DEVICE)
    assert control.stats.policy_fallbacks == 0 and control.policy.name == "broken-mru"

    # raises at C's first hook (on_workflow_start), before C makes room: the existing nodes are
    # re-ranked by LRU and B, the least recently used, goes to RAM
    sh = shadow(fail_from=3 * HOOKS_PER_REQUEST + 1)
    broken = sh.policy
    a_then_b_then_a_then_c(sh)
    assert broken.calls[-1] == "on_workflow_start"
    assert (tier(sh, [1, 2]), tier(sh, [3, 4])) == (Tier.DEVICE, Tier.HOST)
    assert sh.stats.policy_fallbacks == 1


def run_and_snapshot(policy: str, fail_from: int) -> tuple:
    """Every plan of a short run, and where each block is after each request (device-to-RAM
    moves make no worker op, so the plans alone do not show the order)."""
    sh = shadow(policy, fail_from)
    plans, tiers = [], []
    for rid, keys, local in (("a", [1, 2], 0), ("b", [3, 4], 0), ("a2", [1, 2], 8), ("c", [5, 6], 0),
                             ("b2", [3, 4], 0), ("a3", [1, 2, 7], 4), ("d", [8, 9, 11], 0)):
        plans.append(serve(sh, rid, keys, local))
        tiers.append(sorted((tuple(n.blocks), n.tier) for n in sh.tree.iter_nodes()))
    return plans, tiers, sh.stats.policy_fallbacks


def test_a_policy_failing_at_once_serves_exactly_as_lru():
    lru = run_and_snapshot("lru", NEVER)
    assert run_and_snapshot(BROKEN, 1) == (*lru[:2], 1)
    assert run_and_snapshot(BROKEN, NEVER)[1] != lru[1]   # the broken policy's own order differs


def test_without_a_fallback_the_hook_error_propagates():
    sh = shadow(fail_from=1, fallback=None)
    with pytest.raises(IndexError, match="on_workflow_start"):
        serve(sh, "a", [1, 2])
    assert sh.stats.policy_fallbacks == 0 and sh.policy.name == "broken-mru"


def test_a_healthy_policy_never_falls_back():
    sh = shadow("lru")
    a_then_b_then_a_then_c(sh)
    assert sh.stats.policy_fallbacks == 0
    assert (tier(sh, [1, 2]), tier(sh, [3, 4])) == (Tier.DEVICE, Tier.HOST)
