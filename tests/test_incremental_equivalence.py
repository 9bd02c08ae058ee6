"""Incremental bookkeeping and faster sums agree with the plain computations they replace, on
randomised runs: `RetiredSpace` (pbkv's retired device tokens, checked only where an event may
have changed a member), `QualityMonitor`'s running counts (means of its windows) and
`reader_shares` (bit for bit)."""

import math
import random

from hypothesis import given, settings, strategies as st

from pbkv.cache import RadixTree, Tier
from pbkv.predict.monitor import QualityMonitor
from pbkv.policy.next_use import reader_shares
from pbkv.policy.retired_space import RetiredSpace
from pbkv.policy.reuse_score import ReuseScores

AGENTS = ["p", "r", "s"]


def _plain(members: dict, threshold: float) -> int:
    """The scan `RetiredSpace` replaces: every member checked now, the failing ones dropped."""
    total = 0
    for node_id, node in list(members.items()):
        if (node.alive and node.tier == Tier.DEVICE and node.lock == 0 and node.seen_workflows > 0
                and not node.wf_agents and node.seen_workflows < threshold):
            total += node.tokens
        else:
            del members[node_id]
    return total


def _prompt(rng: random.Random) -> list[int]:
    """A prompt of chained block ids: one of a few heads, then a random walk of a few blocks
    (ids name their whole prefix, so a shorter or diverging prompt splits nodes)."""
    ids, head = [], rng.randrange(4)
    for depth in range(rng.randint(1, 5)):
        head = head * 7 + rng.randrange(2) + 1
        ids.append(head * 10 + depth)
    return ids


def _run_retired(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    tree = RadixTree(block_size=16)
    scores = ReuseScores()
    space = RetiredSpace(scores)
    space.bind(tree)
    shadow: dict = {}                                # members as the plain rule keeps them
    live, locks, now = [1, 2, 3], [], 0.0
    for _ in range(steps):
        op, now = rng.random(), now + 1.0
        nodes = [n for n in tree.iter_nodes() if n is not tree.root]
        if op < 0.25:                                # a call: insert (maybe splitting) and tag
            ids = _prompt(rng)
            leaf, _ = tree.insert(ids, 16, max(Tier.DEVICE, tree.match(ids)[0].tier), now)
            tree.touch(leaf, now, rng.choice(live), rng.choice(AGENTS))
        elif op < 0.35 and nodes:                    # a workflow ends: its retired nodes join
            w = rng.choice(live)
            ended = tree.end_workflow(w)
            space.ended(w, ended)
            for node in ended:
                if node.tier == Tier.DEVICE and scores.is_retired(node):
                    space.add(node)
                    shadow[node.id] = node
            if rng.random() < 0.5:
                live[live.index(w)] = max(live) + 1
        elif op < 0.45 and nodes:                    # a path pinned (a run, a load) ...
            node = rng.choice(nodes)
            tree.lock(node)
            locks.append(node)
        elif op < 0.55 and locks:                    # ... and released
            tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op < 0.62 and nodes:                    # evicted below the device
            node = rng.choice(nodes)
            if (node.tier == Tier.DEVICE and not node.lock
                    and all(c.tier != Tier.DEVICE for c in node.children.values())):
                node.tier = Tier.HOST
                space.drop(node)
                shadow.pop(node.id, None)
        elif op < 0.7 and nodes:                     # dropped (told, or as part of a subtree: not)
            node = rng.choice(nodes)
            if not node.children and not node.lock:
                tree.remove(node)
                if rng.random() < 0.5:
                    space.drop(node)
                    shadow.pop(node.id, None)
        elif op < 0.75:                              # the common threshold grows
            scores.workflows_seen += rng.randint(1, 30)
        else:                                        # a reading
            assert space.tokens() == _plain(shadow, scores.common_threshold())
            assert space.members.keys() == shadow.keys()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_retired_space_agrees_with_a_scan_of_every_member(seed):
    _run_retired(seed, steps=400)


def test_retired_space_unbound_is_the_plain_scan():
    tree = RadixTree(block_size=16)
    leaf, _ = tree.insert([1, 2], 16, Tier.DEVICE, 0.0)
    tree.touch(leaf, 0.0, 1, "p")
    tree.end_workflow(1)
    space = RetiredSpace(ReuseScores())             # never bound: scans
    space.add(leaf)
    assert space.tokens() == leaf.tokens
    tree.lock(leaf)
    assert space.tokens() == 0 and not space.members   # failed once: out for good
    tree.unlock(leaf)
    assert space.tokens() == 0


def _plain_means(m: QualityMonitor) -> tuple:
    n = max(1, len(m.outcomes))
    return (sum(o[0] for o in m.outcomes) / n, sum(o[1] for o in m.outcomes) / n,
            sum(m.retired) / len(m.retired) if m.retired else 0.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 20), st.integers(1, 20))
def test_monitor_running_counts_agree_with_a_scan_of_the_window(seed, window, retired_window):
    rng = random.Random(seed)
    m = QualityMonitor(window=window, min_samples=3, retired_window=retired_window)
    for _ in range(120):
        if rng.random() < 0.5:
            probs = {a: rng.random() for a in AGENTS + ["<end>"]}
            m.record(rng.choice(AGENTS), probs, rng.choice(AGENTS + ["<end>"]))
        else:
            m.record_match(rng.choice([0, 0, 16, 32]))
        assert (m.accuracy, m.baseline_accuracy, m.retired_reuse) == _plain_means(m)
        assert m.trust == (1.0 if len(m.outcomes) < m.min_samples else
                           min(1.0, max(0.0, 1.0 + (_plain_means(m)[0] - _plain_means(m)[1]) / m.margin)))
    if m.outcomes:
        assert math.isclose(m.log_loss, sum(o[2] for o in m.outcomes) / len(m.outcomes))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(-1.0, 1.0), min_size=6, max_size=6), min_size=0, max_size=4),
       st.lists(st.integers(0, 5), max_size=6), st.booleans())
def test_reader_shares_are_bit_identical_to_the_plain_sums(rows, readers, as_set):
    plan = [(float(k), 1.0, row) for k, row in enumerate(rows)]
    readers = set(readers) if as_set else readers
    plain = [sum([row[b] for b in readers]) for _, _, row in plan]
    got = reader_shares(plan, readers)
    assert [repr(x) for x in got] == [repr(x) for x in plain]   # repr: -0.0 and 0.0, 0 and 0.0 differ


def test_reader_shares_of_one_reader_add_to_the_int_zero_as_sum_does():
    plan = [(0.0, 1.0, [-0.0, 0.25])]
    assert repr(reader_shares(plan, [0])[0]) == repr(sum([-0.0])) == "0.0"
