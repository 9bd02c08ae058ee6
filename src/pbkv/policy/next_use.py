"""Predicted next use of a cache node: when, in seconds, some active workflow will next read it.

For a running workflow w, predicted at the start of its call s (at time `now`), with P_k the
distribution of the agent of call s+k (given it happens) and s_k the probability it happens:

    u_k(a)  = s_k * sum_{b in R(a)} P_k[b]            (call s+k reads cache written by a)
    f_k(a)  = u_k(a) * prod_{j<k} (1 - u_j(a))        (the first such call is call s+k)
    p(a)    = sum_k f_k(a)                            (a's cache is read within the horizon K)
    t_k     = now + d(cur) + sum_{j<=k} g_j + sum_{j<k} d_j   (expected issue time of call s+k)
    E(a)    = now + (sum_k f_k(a) t_k / p(a) - now) / p(a)   (ranking time of a's cache; far if p = 0)

R(a), the readers of agent a's cache, is a itself plus every agent seen (online) sending again
a block that a's call was the first of its workflow to send (`Staleness.readers`): a workflow
whose prompts all extend one conversation (tool-calling agents) has every agent read every
other's cache, while agents with their own prompts (a planner, a verifier) read only their own.
d and g are per-agent call durations (call arrival to end, queueing included) and tool waits
(end of a workflow's call to its next call's arrival), learned online from the call events
(`Timing`); d_j, g_j are their expectations under P_j. E(a) is the expected wait given a read
within the horizon, stretched by 1 / p(a) (`effective_time`): ranking by it is ranking by reads
per second of holding the node, and with p in {0, 1} it is Belady's order. `far` stands for
"not within the horizon": one mean step past it, stretched by 1 / s_K (a node of a dying
workflow is as good as dead).

Staleness (`staleness.py`): the predictions are per agent, but an agent's workflow may not read
all of that agent's cache again (an old conversation, a re-rendered prompt tail). Per workflow,
a node that carries staleness evidence (its first block was sent by an earlier call: if that
block is read, the node is, at least in part) is ranked by its own first-read distribution:
as f_k(a) above, with each call's chance u_k scaled by Q, the learned chance that a call reading
its agent's cache reads a block in the state this one will be in at call s+k (calls of its
agent that passed it over, calls of the workflow since it was sent); p and E as above, p never
above the agent-level p(a) (`NextUse._read`).

A node's next use is the earliest over the (workflow, agent) pairs that may read it: the
active workflows that used it, with their agents; and for a *common* node
(`ReuseScores.is_common`), also every active workflow with the agents that ever used the node,
discounted by the node's share of workflows so far (share = workflows that used it / workflows
seen): the earliest such call reads it only with that probability, so its expected next use
is pushed back by (1/share - 1) mean steps and its probability scaled by share. A framework
preamble every workflow reads (share ~1) is next used at once; a prefix that a few workflows
happened to share is not treated as if every running workflow were about to read it (issue
11, bfcl: prefixes shared by 3 of 51 workflows held device and host as "about to be read" and
live private cache was recomputed instead; LRU let them age out). Times are absolute (seconds on the
engine's clock), so keys computed at different moments stay comparable.

Invariant: a node's next use is never later than any descendant's (its tags contain theirs, and
a common node's ancestors are common with at least its share), so a prefix is never ranked
below its suffixes.
"""

from __future__ import annotations

import math
from operator import itemgetter

from pbkv.cache import Node
from pbkv.policy.extremes import Extremes
from pbkv.policy.reuse_score import ReuseScores, bits
from pbkv.policy.staleness import BUCKETS, Staleness, bucket

INF = math.inf


class Timing:
    """Per-agent call durations and tool waits, as running means learned from call events."""

    def __init__(self, alpha: float = 0.05, default: float = 1.0):
        self.alpha, self.default = alpha, default
        self.duration: dict[str, float] = {}
        self.wait: dict[str, float] = {}
        self.started: dict[int, float] = {}   # workflow -> arrival of its running call
        self.ended: dict[int, float] = {}     # workflow -> end of its last call
        self.mean_duration = self.mean_wait = None

    def call_start(self, workflow: int, agent: str, now: float) -> None:
        last = self.ended.pop(workflow, None)
        if last is not None:
            self.mean_wait = self._learn(self.wait, agent, now - last, self.mean_wait)
        self.started[workflow] = now

    def call_end(self, workflow: int, agent: str, now: float) -> None:
        start = self.started.pop(workflow, None)
        if start is not None:
            self.mean_duration = self._learn(self.duration, agent, now - start, self.mean_duration)
        self.ended[workflow] = now

    def forget(self, workflow: int) -> None:
        self.started.pop(workflow, None)
        self.ended.pop(workflow, None)

    def of(self, table: dict[str, float], agent: str) -> float:
        value = table.get(agent)
        if value is not None:
            return value
        mean = self.mean_duration if table is self.duration else self.mean_wait
        return mean if mean is not None else (self.default if table is self.duration else 0.0)

    @property
    def step(self) -> float:
        """Mean seconds between two calls of a workflow (one duration plus one wait)."""
        return (self.mean_duration or self.default) + (self.mean_wait or 0.0)

    def _learn(self, table: dict[str, float], agent: str, x: float, mean: float | None) -> float:
        x = max(0.0, x)
        old = table.get(agent)
        table[agent] = x if old is None else old + self.alpha * (x - old)
        return x if mean is None else mean + self.alpha * (x - mean)


def effective_time(now: float, weighted: float, p: float, far: float = INF) -> float:
    """A node's ranking time from its first-use distribution within the horizon: `weighted`
    = sum_k f_k t_k, `p` = sum_k f_k. The expected wait given a use, (weighted / p - now), is
    stretched by 1 / p: ranking by it is ranking by p / wait, the expected reads per second
    of holding the node (as LHD's hit density), and for p in {0, 1} it is Belady's order.
    The earlier rule, E = sum_k f_k t_k + (1 - p) far with `far` one step past the horizon,
    ranked a node read with probability .1 next call almost level with one read surely three
    calls later. Measured gain is small (issue 11, host tier under pressure: share of the
    oracle's gain hover .85 -> .85, swe .78 -> .80 and .75 -> .79; real traces unchanged).
    Never read within the horizon (p = 0): `far` (such nodes are "dead" at full trust; below
    it they keep a finite time, so that coarser buckets can tie them with live ones and LRU
    decides, as trust falls)."""
    if p <= 0.0:
        return far
    return now + (weighted / p - now) / p


def first_read(plan: list[tuple], readers, scale: list[float] | None = None) -> tuple[float, float]:
    """(sum_k f_k t_k, p = sum_k f_k) of the first call in `plan` ([(t_k, s_k, P_k)]) whose agent
    is one of `readers`: f_k = (1 - p before k) * s_k * sum_{b in readers} P_k[b], each chance
    times scale[k] when given (staleness at call k, `NextUse._read`)."""
    return first_read_of(plan, reader_shares(plan, readers), scale)


def reader_shares(plan: list[tuple], readers) -> list[float]:
    """Per call k of `plan`: sum_{b in readers} P_k[b], summed in the order `readers` iterates.

    Bit-identical to `sum([row[b] for b in readers])` per row (asked per ranked node and per
    class at every prediction: policy time): `sum` adds left to right from the int 0, which is
    what `sum` of an `itemgetter` tuple does, and for one reader `0 + row[b]` (0 + -0.0 is 0.0
    in both)."""
    if len(readers) == 1:
        (b,) = readers
        return [0 + row[b] for _, _, row in plan]
    if not readers:
        return [0 for _ in plan]
    get = itemgetter(*readers)
    return [sum(get(row)) for _, _, row in plan]


def first_read_of(plan: list[tuple], shares: list[float], scale: list[float] | None = None) -> tuple[float, float]:
    """`first_read` with the readers' shares of each call (`reader_shares`) given: `_read` asks
    for the same readers at many staleness states (the same float operations, in the same order)."""
    none, weighted, p = 1.0, 0.0, 0.0
    for k, (issue, s, _) in enumerate(plan):
        f = none * s
        if scale is not None:
            f *= scale[k]
        f *= shares[k]
        weighted += f * issue
        p += f
        none -= f
    return weighted, p


class NextUse:
    """Expected next-use time and reuse probability of nodes, per agent class and workflow."""

    def __init__(self, scores: ReuseScores, horizon: int):
        self.scores = scores            # agent classes, tree bits, common/retired rules
        self.horizon = horizon
        self.timing = Timing()
        self.when: dict[int, list[float]] = {}   # workflow -> E(a) per class
        self.prob: dict[int, list[float]] = {}   # workflow -> p(a) per class
        self.extremes = Extremes()               # per class: earliest E(a), largest p(a)
        self.stale = Staleness()                 # which of an agent's cache its workflow still reads; readers
        self.at: dict[int, float] = {}           # workflow -> time of its latest prediction
        self.plan: dict[int, tuple] = {}         # workflow -> ([(t_k, s_k, P_k)], far) of it
        # workflow -> memo of `_read` until its next prediction (at most one call away); the
        # staleness tables and readers it read may move meanwhile with other workflows' calls,
        # which a node's key then follows one call late (policy time: `_read` runs per key)
        self.reads: dict[int, dict] = {}
        # workflow -> what `_read` derives from its plan alone, by node mask (the readers'
        # shares) and by the block's agent class (its expected calls); dropped with `reads`
        self.shares: dict[int, tuple[dict, dict]] = {}
        self._groups_memo = None                 # (classes list, readers' version, _groups() of it)

    def _groups(self) -> list[list[int]]:
        """Per class: the classes whose calls read its cache (itself first). Memoised until a
        reader is added or taken back (`Readers.version`) or the classes change (it is read at
        every prediction: policy time)."""
        names = self.scores.classes
        readers = self.stale.readers
        version = readers.version
        memo = self._groups_memo
        if memo is not None and memo[0] is names and memo[1] == version:
            return memo[2]
        index = {name: i for i, name in enumerate(names)}
        groups = [[a] + [index[r] for r in sorted(readers.of(name)) if r in index]
                  for a, name in enumerate(names)]
        self._groups_memo = (names, version, groups)
        return groups

    def update(self, workflow: int, agent: str, now: float, probs, survival, pending: bool) -> list[int]:
        """Store workflow's new prediction (classes as in `scores.classes`, which `ReuseScores.
        update` set first); return the classes whose earliest next use moved.

        `pending`: the call of `agent` that the prediction follows has arrived but not ended:
        it still has to read its prompt's cache (it may wait in the queue), so its agent's next
        use is now; once it ended (`pending` False) the horizon starts at `now`."""
        classes = self.scores.classes
        timing = self.timing
        dur = [timing.of(timing.duration, c) for c in classes]
        wait = [timing.of(timing.wait, c) for c in classes]
        n = len(classes)
        groups = self._groups()
        t = now
        current = None
        if pending:
            t += timing.of(timing.duration, agent)       # expected end of the running call
            current = self.scores.class_of(agent)
        steps = min(self.horizon, len(survival))
        plan = []
        for k in range(steps):
            row, s = [float(x) for x in probs[k]], float(survival[k])   # floats once, not per use
            issue = t + sum([row[a] * wait[a] for a in range(n)])   # lists: faster than generators, same sums
            plan.append((issue, s, row))
            t = issue + sum([row[a] * dur[a] for a in range(n)])
        last = float(survival[steps - 1]) if steps else 0.0
        far = t + timing.step / max(last, 0.05)   # "not within the horizon" (a dying workflow: later)
        when, prob = [0.0] * n, [0.0] * n
        for a in range(n):
            if current is not None and current in groups[a]:
                when[a], prob[a] = now, 1.0              # the running call reads it now
            else:
                when[a], prob[a] = first_read(plan, groups[a])
            when[a] = effective_time(now, when[a], prob[a], far)
        self.when[workflow], self.prob[workflow] = when, prob
        self.at[workflow] = now
        self.plan[workflow] = (plan, far)
        self.reads.pop(workflow, None)
        self.shares.pop(workflow, None)
        return self._refresh_classes(workflow)

    def remove(self, workflow: int) -> list[int]:
        self.timing.forget(workflow)
        self.stale.end(workflow)
        if self.when.pop(workflow, None) is None:
            return []
        self.prob.pop(workflow, None)
        self.at.pop(workflow, None)
        self.plan.pop(workflow, None)
        self.reads.pop(workflow, None)
        self.shares.pop(workflow, None)
        return self._refresh_classes(workflow)

    def of(self, node: Node) -> tuple[float, float]:
        """(expected next-use time, reuse probability within the horizon) of `node`;
        (inf, 0) when no active workflow may read it."""
        scores = self.scores
        if not scores.classes:
            return INF, 0.0
        scores._extend_bits()
        best, p = self._private(node)
        if scores.is_common(node):
            cls = scores._classes_in(node.agent_mask)
            if cls and len(self.first) == len(scores.classes):
                # any active workflow may read it, but only as often as workflows did so far
                share = min(1.0, node.seen_workflows / max(1, scores.workflows_seen))
                when = min(self.first[c] for c in cls) + (1.0 / share - 1.0) * self.timing.step
                best, p = min(best, when), max(p, share * max(self.pmax[c] for c in cls))
        return best, p

    def _private(self, node: Node) -> tuple[float, float]:
        """Next use and reuse probability over the active workflows that used `node`. Per
        workflow, a node with staleness evidence takes its own first-read distribution
        (`_read`) where it is below the agent-level one."""
        scores = self.scores
        best, p = INF, 0.0
        n = len(scores.classes)
        for w, mask in node.wf_agents.items():
            when = self.when.get(w)
            if when is None or len(when) != n:
                continue
            prob = self.prob[w]
            wbest, wp = INF, 0.0
            for c in scores._classes_in(mask):
                if when[c] < wbest:
                    wbest = when[c]
                if prob[c] > wp:
                    wp = prob[c]
            read = self._read(w, node.blocks[0], mask)
            if read is not None and read[1] < wp:
                wbest, wp = read
            if wbest < best:
                best = wbest
            if wp > p:
                p = wp
        return best, p

    def _read(self, w: int, block: int, mask: int) -> tuple[float, float] | None:
        """(ranking time, probability) that one of workflow w's predicted calls reads its cache
        from `block` on, for a node its agents `mask` used: as p(a) and E(a), with each call's
        chance scaled by the block's staleness in the state the block will be in at that call
        (call s+k: c + k calls since its sender, a + the expected calls of its agent among the
        k before). None when the block carries no staleness evidence (`Staleness.state`).

        Why each call's own state, not the state now (the previous rule capped p(a) by Q now):
        ChatDev's review loop alternates Code Reviewer and Programmer, and the Programmer reads
        its own conversation of two calls back; at its next Programmer call the block is in
        state (a=1, c=3) and read, while in state (1, 2), between, the next call is the
        Reviewer's, which never reads it: Q(1, 2) ~ 0 called the live conversation dead."""
        found = self.stale.state(w, block)
        if found is None or w not in self.plan:
            return None
        memo = self.reads.setdefault(w, {})
        hit = memo.get((found, mask))
        if hit is not None:
            return hit
        key, a0, c0 = found
        plan, far = self.plan[w]
        table = self.stale.table(key)
        by_mask, by_own = self.shares.setdefault(w, ({}, {}))
        passed = self._own_calls(by_own, plan, self.scores.class_of(key[0]))
        scale = [table[bucket(a0 + passed[k]) * BUCKETS + bucket(c0 + k)] for k in range(len(plan))]
        when, p = first_read_of(plan, self._mask_shares(by_mask, plan, mask), scale)
        result = memo[(found, mask)] = (effective_time(self.at[w], when, p, far), p)
        return result

    def _mask_shares(self, by_mask: dict, plan: list[tuple], mask: int) -> list[float]:
        """`reader_shares` of the readers of the classes in `mask`, kept in `by_mask` while the
        readers and the mask's classes are the same objects (the set is then built, and so
        iterated, exactly as anew)."""
        groups = self._groups()
        classes = self.scores._classes_in(mask)
        kept = by_mask.get(mask)
        if kept is not None and kept[0] is groups and kept[1] is classes:
            return kept[2]
        readers = set()
        for c in classes:
            readers.update(groups[c])
        shares = reader_shares(plan, readers)
        by_mask[mask] = (groups, classes, shares)
        return shares

    @staticmethod
    def _own_calls(by_own: dict, plan: list[tuple], own: int) -> list[int]:
        """Per call k of `plan`: the expected calls of class `own` among the k before, rounded
        (kept in `by_own`)."""
        kept = by_own.get(own)
        if kept is None:
            kept, calls = [], 0.0
            for _, s, row in plan:
                kept.append(int(calls + 0.5))
                calls += s * row[own]
            by_own[own] = kept
        return kept

    @property
    def first(self) -> list[float]:
        """Per class: the earliest E(a) over active workflows."""
        return self.extremes.first

    @property
    def pmax(self) -> list[float]:
        """Per class: the largest p(a) over active workflows."""
        return self.extremes.pmax

    def _refresh_classes(self, changed: int) -> list[int]:
        """Keep `first` and `pmax` (over workflows, per class) after workflow `changed` moved
        (`extremes.py`); a new class count rebuilds them. Returns the classes that moved."""
        n = len(self.scores.classes)
        if len(self.extremes.first) != n:
            return self.extremes.reset(n, self.when, self.prob)
        when = self.when.get(changed)
        if when is None:
            return self.extremes.remove(changed)
        return self.extremes.set(changed, when, self.prob[changed])
