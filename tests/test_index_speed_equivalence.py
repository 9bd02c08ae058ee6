"""The indexes and memos that make pbkv's per-batch work cheap agree with the plain computations
they replace: the dormant offloaded nodes of `PrefetchCandidates`, `Staleness.add` counting
groups once per call, and `NextUse._read` reusing readers' shares (correctness only)."""

import random
from collections import Counter

from pbkv.cache import RadixTree, Tier
from pbkv.policy.next_use import NextUse, effective_time, first_read
from pbkv.policy.pbkv_prefetch import PrefetchCandidates
from pbkv.policy.reuse_score import ReuseScores
from pbkv.policy.staleness import BUCKETS, Staleness, bucket

AGENTS = ["p", "r", "s"]


def _tree(rng: random.Random, prefixes: int, leaves: int) -> RadixTree:
    """Leaves of one or two blocks under shared prefixes (block ids chained by construction)."""
    tree = RadixTree(block_size=16)
    for i in range(leaves):
        head = rng.randrange(prefixes)
        tree.insert([head, 1000 + i] + ([10**6 + i] if rng.random() < 0.5 else []), 16, Tier.DEVICE, 0.0)
    return tree


def _scan(offloaded: dict, threshold: float) -> set[int]:
    """The plain scan: every node ever evicted below the device, checked now (and the ones that
    are gone for good forgotten, as the scan did before the index)."""
    found = set()
    for node_id, node in list(offloaded.items()):
        if not node.alive or node.tier == Tier.DEVICE:
            del offloaded[node_id]
        elif node.wf_agents or node.seen_workflows >= threshold:
            found.add(node_id)
    return found


def _run_candidates(seed: int, leaves: int, steps: int) -> None:
    rng = random.Random(seed)
    tree = _tree(rng, 8, leaves)
    scores = ReuseScores()
    ahead = PrefetchCandidates(scores, Staleness(), {})
    ahead.bind(tree)
    offloaded: dict = {}
    live = [1, 2, 3]
    now = 0.0
    nodes = list(tree.iter_nodes())                   # no node is added: pick, skip the dropped
    for _ in range(steps):
        node = rng.choice(nodes)
        op = rng.random()
        now += 1.0
        if not node.alive:
            continue
        if op < 0.3:                                  # evicted below the device (or from host)
            node.tier = rng.choice([Tier.HOST, Tier.DISK])
            ahead.evicted(node, node.tier)
            offloaded[node.id] = node
        elif op < 0.4:                                # loaded back
            node.tier = Tier.DEVICE
        elif op < 0.6:                                # a workflow reads it, wherever it lies
            tree.touch(node, now, rng.choice(live), rng.choice(AGENTS))
        elif op < 0.7:                                # a workflow ends (its id may come back)
            w = rng.choice(live)
            ahead.ended(w, tree.end_workflow(w))
            if rng.random() < 0.5:
                live[live.index(w)] = max(live) + 1
        elif op < 0.75:                               # dropped (told, or as part of a subtree: not)
            if not node.children and not node.lock:
                tree.remove(node)
                if rng.random() < 0.5:
                    ahead.evicted(node, None)
        elif op < 0.8:                                # the common threshold grows
            scores.workflows_seen += 1
        else:
            want = _scan(offloaded, scores.common_threshold())
            assert {n.id for n in ahead.candidates()} == want


def test_dormant_offloaded_nodes_agree_with_a_scan_of_every_offloaded_node():
    for seed in range(6):
        _run_candidates(seed, leaves=60, steps=1500)


def test_dormant_nodes_swept_past_the_threshold_still_agree():
    # enough nodes that `_park` sweeps the dormant table (over 1024 entries)
    _run_candidates(7, leaves=3000, steps=12000)


class PerBlock(Staleness):
    """`Staleness.add` as it was: every group count moved per block."""

    def add(self, workflow, agent, blocks):
        if not self.seq.get(workflow):
            self._count(workflow, agent)
        now = len(self.seq[workflow]) - 1
        then = self.agent_calls[workflow][agent]
        once, again = (now, then, (agent, 1)), (now, then, (agent, 2))
        seen = self.blocks.setdefault(workflow, {})
        groups = self.groups.setdefault(workflow, Counter())
        sent = self.sent.setdefault(workflow, Counter())
        origin = self.origin.setdefault(workflow, {})
        for b in blocks:
            last = seen.get(b)
            if last is None:
                seen[b] = once
                groups[once] += 1
                origin[b] = agent
                if self.shared.sent(workflow, b):
                    self.readers.shared(b)
            elif last[0] != now:
                first = origin[b]
                if first != agent and not self.shared.is_shared(b):
                    self.readers.read(b, first, agent)
                groups[last] -= 1
                if not groups[last]:
                    del groups[last]
                sent[last] += 1
                seen[b] = again
                groups[again] += 1


def _state(s: Staleness) -> tuple:
    r, sh = s.readers, s.shared
    return (s.blocks, {w: dict(g) for w, g in s.groups.items()}, {w: dict(g) for w, g in s.sent.items()},
            s.seq, s.agent_calls, s.origin, s.chances, s.reads,
            r.by_agent, dict(r.count), list(r.evidence.items()), r.version,
            sh.owner, list(sh.ended), list(sh.shared))


def test_staleness_add_counts_as_the_per_block_rule():
    for seed in range(5):
        rng = random.Random(seed)
        new, old = Staleness(), PerBlock()
        convo: dict[int, list[int]] = {}
        next_block = 100
        for _ in range(400):
            w = rng.randrange(6)
            if rng.random() < 0.1 and w in convo:
                new.end(w)
                old.end(w)
                del convo[w]
                assert _state(new) == _state(old)
                continue
            history = convo.setdefault(w, [1, 2, 3])        # a preamble every workflow sends
            keep = rng.randrange(len(history) + 1)
            added = list(range(next_block, next_block + rng.randrange(4)))
            next_block += len(added)
            prompt = history[:keep] + added
            convo[w] = prompt if rng.random() < 0.7 else history
            agent = rng.choice(AGENTS)
            if rng.random() < 0.2 and new.seq.get(w):
                agent = new.seq[w][-1]                      # a second look at the latest call
                new.add(w, agent, prompt)
                old.add(w, agent, prompt)
            else:
                new.call(w, agent, prompt)
                old.call(w, agent, prompt)
            assert _state(new) == _state(old)


def _plain_read(nu: NextUse, w: int, block: int, mask: int):
    """`NextUse._read` as it was: readers, scale and first use rebuilt at every call."""
    found = nu.stale.state(w, block)
    if found is None or w not in nu.plan:
        return None
    key, a0, c0 = found
    groups = nu._groups()
    readers = set()
    for c in nu.scores._classes_in(mask):
        readers.update(groups[c])
    own = nu.scores.class_of(key[0])
    table = nu.stale.table(key)
    plan, far = nu.plan[w]
    scale, calls = [], 0.0
    for k, (_, s, row) in enumerate(plan):
        scale.append(table[bucket(a0 + int(calls + 0.5)) * BUCKETS + bucket(c0 + k)])
        calls += s * row[own]
    when, p = first_read(plan, readers, scale)
    return effective_time(nu.at[w], when, p, far), p


def test_read_with_kept_shares_equals_the_plain_computation():
    rng = random.Random(3)
    classes = AGENTS + ["<unk>"]
    scores = ReuseScores(horizon=3)
    scores.bind({a: i for i, a in enumerate(AGENTS)})
    nu = NextUse(scores, horizon=3)
    sent: dict[int, list[int]] = {}
    now = 0.0
    for step in range(300):
        w = rng.randrange(4)
        agent = rng.choice(AGENTS)
        blocks = sent.setdefault(w, [])
        blocks += [1000 * w + step, 1000 * w + step + 500]
        nu.stale.call(w, agent, rng.sample(blocks, min(len(blocks), 6)))
        probs = [[rng.random() for _ in classes] for _ in range(3)]
        probs = [[x / sum(row) for x in row] for row in probs]
        survival = sorted((rng.random() for _ in range(3)), reverse=True)
        scores.update(w, classes, probs, survival)
        now += rng.random()
        nu.update(w, agent, now, probs, survival, pending=rng.random() < 0.5)
        scores._extend_bits()
        for _ in range(5):
            v = rng.choice(list(sent))
            block, mask = rng.choice(sent[v]), rng.randrange(1, 8)
            nu.reads.pop(v, None)                    # the per-state memo: asked afresh, shares kept
            assert nu._read(v, block, mask) == _plain_read(nu, v, block, mask)
