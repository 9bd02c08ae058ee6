"""PBKV: prediction-based eviction, admission and prefetch, used conservatively, with feedback.

Eviction order, the same on the device, on host and on disk (the cache never evicts a locked
node):
  1. retired nodes (cache private to workflows that all ended), LRU among them;
  2. predicted-dead nodes: no active workflow is predicted to read them within the horizon
     (reuse probability < DEAD_P), LRU among them;
  3. the rest by predicted next use (`next_use.py`), farthest first (Belady's rule with
     predictions: expected next-use time, in seconds, from the K-step agent distributions,
     survival, and per-agent call durations and tool waits learned online; cache is discounted
     by how often a call reading its agent's cache read cache in the same state,
     `staleness.py`), ties by LRU.
Admission (`keep_on_evict`, `admission.py`): an evicted node fills free space below; when the
tiers below are full it goes down only if it outranks what the write would finally push out of
the cache (the lowest-ranked victim of the cascade), so retired and predicted-dead nodes never
displace anything live, and a live node is not dropped while retired cache sits below.
Why one rule at every tier: with a host tier under pressure, what the host keeps and drops
decides most of the hit rate (issue 11: LRU below the device lost the oracle's gain).
Prefetch: queued calls' prefixes first, evicting only what ranks below them, then predicted
loads into free + retired space: candidates, space and floors in `pbkv_prefetch.py`, the choice
of predicted loads in `conservative_prefetch.py`.
Predictions are refreshed at every call.

Feedback (`pbkv.predict.monitor`): the predictor's next-event accuracy is compared online with a
Markov baseline learned from the same stream. As trust falls, next-use times are quantised ever
more coarsely, so more nodes tie and LRU decides; below DEAD_MIN_LEVEL no node is called dead;
at trust 0 the order is plain LRU (after retired), every evicted node is written down a tier
and prefetch stops. When retired cache turns out to be reused by new workflows, retired-first
(and dropping retired nodes) is switched off. With an online learner, finished workflows
retrain the predictor.

Context signal: with a predictor that reads the serving model's hidden state (its config has
`context_dim > 0`), a real engine's `on_prefill` event (the hidden state at the call's last
prompt token) replaces the prediction made at call start, which had no hidden state yet; the
latest hidden state of each workflow is kept and passed to later predictions of that workflow.
Predictors without `context_dim` ignore it (they read the call's `context` text instead).

Variants (ablations, `pbkv_variants.py`): `pbkv-retired` (retired first, then LRU),
`pbkv-noprefetch`, `pbkv-history` (history-only predictor), `pbkv-context` (context-only
predictor).
"""

from __future__ import annotations

import math

from pbkv.cache import Node, Tier
from pbkv.policy import admission
from pbkv.policy.base import CallEvent, Policy, PolicyContext, PrefetchRequest
from pbkv.policy.next_use import NextUse
from pbkv.policy.pbkv_prefetch import PrefetchCandidates
from pbkv.policy.reuse_score import ReuseScores
from pbkv.predict.monitor import END, QualityMonitor

TRUST_STEPS = 10          # trust is acted on in tenths
PREFETCH_MIN_TRUST = 0.5  # below this, no loads ahead (waiting calls' prefixes included)
# Reuse probability within the horizon below which a node is "dead". Swept 0.02-0.35 on the 18
# real-trace cells and the default bench (docs/benchmarks.md, "Which of pbkv's rules carry the
# gain, and the dead threshold"): 0.1 closes more of chatdev's device gap but loses latency on
# bfcl and tau and share on hover; no value wins everywhere, so the value stays.
DEAD_P = 0.05
DEAD_MIN_LEVEL = 5        # below this trust level no node is called dead (LRU decides)
FINE_BUCKETS = 64         # at full trust, next-use times are compared to 1/64 of a mean step
SPECULATIVE_FLOOR = (1,)  # a predicted (not queued) load may evict only retired nodes


class PBKVPolicy(Policy):
    name = "pbkv"
    variant = "fused"            # which trained predictor (PolicyContext.predictors key)
    use_scores = True
    use_prefetch = True
    allow_evict_for_prefetch = True  # only below `prefetch_floor`: retired for predicted loads
    dead_p = DEAD_P              # a class attribute so ablations can move it (examples/ablation_policies.py)

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        needs = self.use_scores or self.use_prefetch
        self.predictor = ctx.predictors.get(self.variant) if needs else None
        if self.predictor is None and needs:
            raise ValueError(f"policy {self.name!r} needs a trained {self.variant} predictor "
                             f"(pbkv bench: --train FILE or --predictor DIR)")
        horizon = int(ctx.horizon or (self.predictor.horizon if self.predictor else 1))
        if self.predictor is not None and horizon > self.predictor.horizon:
            raise ValueError(f"--horizon {horizon} exceeds the predictor's horizon {self.predictor.horizon}")
        self.scores = ReuseScores(gamma=float(ctx.gamma), horizon=horizon)
        self.next_use = NextUse(self.scores, horizon)
        self.bucket = None        # seconds per next-use bucket (None: exact), set with the level
        self.monitor = QualityMonitor()
        self.learner = ctx.online_learner
        self.history: dict[int, list[str]] = {}
        self.contexts: dict[int, list[str | None]] = {}
        self.hiddens: dict[int, object] = {}      # workflow -> hidden state of its latest prefill
        self.predictions: dict = {}               # workflow -> its latest Prediction
        self.version: dict[int, int] = {}         # workflow -> count of its predictions
        cfg = getattr(self.predictor, "cfg", None) or getattr(getattr(self.predictor, "inner", None), "cfg", None)
        self.reads_hidden = bool(cfg is not None and cfg.uses_context and cfg.context_dim > 0)
        self.expected: dict[int, tuple[str, dict[str, float]]] = {}  # workflow -> (agent, next event)
        self.ahead = PrefetchCandidates(self.scores, self.next_use.stale, self.version)
        self.common: dict[int, Node] = {}        # common nodes seen on matched paths
        self.level = TRUST_STEPS

    def bind(self, cache, clock=None) -> None:
        super().bind(cache, clock)
        self.scores.bind(cache.tree.agent_ids)
        self.ahead.bind(cache.tree)

    # ---------------------------------------------------------------- ranking

    def priority(self, node: Node) -> tuple:
        if self._retired(node):
            return (0, 0, node.last_access)
        if not self.use_scores or self.level == 0:
            return (1, 0, node.last_access)
        when, p = self.next_use.of(node)
        return self._rank(when, p, node.last_access)

    def _rank(self, when: float, p: float, last_access: float) -> tuple:
        """The key of a live node next used at `when` with probability `p` (see the docstring)."""
        if p < self.dead_p and self.level >= DEAD_MIN_LEVEL:
            return (1, 0, last_access)
        if self.bucket is not None and when != math.inf:
            when = math.floor(when / self.bucket)
        return (2, -when, last_access)

    def prefetch_floor(self, node: Node) -> tuple:
        """A queued prefix (`pbkv_prefetch.py`) may displace nodes ranked below a read at its
        call's arrival; a speculative load only retired nodes, keyed (0, ...)."""
        at = self.ahead.arrival_on(node)
        if at is None:
            return SPECULATIVE_FLOOR
        return self._rank(at, 1.0, node.last_access)

    def keep_on_evict(self, node: Node) -> bool:
        """Write `node` down a tier unless what the write finally pushes out of the cache
        outranks it (`admission.py`): retired and predicted-dead nodes never displace live
        ones, and a live node is dropped only when everything it would displace is worth more."""
        if not self.use_scores or self.level == 0:
            return True
        return admission.worth_writing(self.cache, node, self.priority)

    def on_evict(self, node: Node, src: Tier, dst: Tier | None) -> None:
        self.ahead.evicted(node, dst)

    def _retired(self, node: Node) -> bool:
        return self.monitor.retired_first and self.scores.is_retired(node)

    # ---------------------------------------------------------------- events

    def on_workflow_start(self, workflow: int, workflow_id: str) -> None:
        self.history[workflow] = []
        self.contexts[workflow] = []
        self.scores.workflows_seen += 1

    def on_call_start(self, event: CallEvent) -> None:
        w, agent = event.workflow, event.agent
        self._observe(w, agent)
        self._observe_match(event.node)
        self.ahead.arrived(w, event.now, event.node)
        self.next_use.timing.call_start(w, agent, event.now)
        self.next_use.stale.call(w, agent, _prompt_blocks(event))
        self.history[w].append(agent)
        self.contexts[w].append(event.call.context if event.call is not None else None)
        self._predict(w, agent, self.hiddens.get(w), event.now)

    def on_call_end(self, event: CallEvent) -> None:
        """The call has read its cache: its agent's next use is now the predicted one."""
        w = event.workflow
        self.ahead.served(w)
        self.next_use.timing.call_end(w, event.agent, event.now)
        if getattr(event.call, "hash_ids", None) is None:
            # no prompt at call start (vLLM's shadow): the call's path, now inserted
            self.next_use.stale.add(w, event.agent, _prompt_blocks(event))
        pred = self.predictions.get(w)
        if pred is None:
            return
        moved = self.next_use.update(w, event.agent, event.now, pred.probs, pred.survival, pending=False)
        # Every class the ended call read moves (from "now", while it was pending, to its
        # predicted next read), and the index keys must follow whether or not the class's
        # extremes over workflows moved: re-key all of the workflow's nodes, as at call start.
        # (Re-keying only the ended agent's class, and only when its extremes moved, left nodes
        # the call had read ranked "read now" through the tool wait: swe, device only, 0.36 ->
        # 0.69 of the oracle's gain.)
        self._rerank(w, moved)

    def on_prefill(self, event: CallEvent) -> None:
        if not self.reads_hidden or event.hidden is None or event.workflow not in self.history:
            return
        self.hiddens[event.workflow] = event.hidden
        self._predict(event.workflow, event.agent, event.hidden, event.now)

    def _predict(self, w: int, agent: str, hidden, now: float, pending: bool = True) -> None:
        """Predict workflow w's next calls after its latest call (of `agent`; `pending`: that call
        has not ended) and re-rank what the prediction moved."""
        if self.predictor is None:
            return
        pred = self._prediction(w, hidden)
        moved = self.scores.update(w, pred.agents, pred.probs, pred.survival)
        self.predictions[w] = pred
        self.version[w] = self.version.get(w, 0) + 1
        moved = sorted(set(moved) | set(self.next_use.update(w, agent, now, pred.probs, pred.survival,
                                                             pending=pending)))
        s1 = float(pred.survival[0])
        nxt = {a: s1 * float(p) for a, p in zip(pred.agents, pred.probs[0])}
        nxt[END] = 1.0 - s1
        self.expected[w] = (agent, nxt)
        self._rerank(w, moved)

    def _prediction(self, w: int, hidden):
        """The predictor's answer for workflow w after its latest call."""
        if self.reads_hidden and hidden is not None:
            return self.predictor.predict(self.history[w], self.contexts[w][-1], hidden)
        return self.predictor.predict(self.history[w], self.contexts[w][-1])

    def reuse_probability(self, workflow: int) -> float | None:
        """P(call t+1 | call t) from the latest prediction (made at call t-1: survival[0] is
        P(call t), survival[1] P(call t+1)); None before the workflow's first prediction here."""
        pred = self.predictions.get(workflow)
        if pred is None or len(pred.survival) < 2 or float(pred.survival[0]) <= 0.0:
            return None
        return min(1.0, float(pred.survival[1]) / float(pred.survival[0]))

    def on_workflow_end(self, workflow: int, nodes: list[Node]) -> None:
        self._observe(workflow, END)
        self.expected.pop(workflow, None)
        self.ahead.served(workflow)
        moved = sorted(set(self.scores.remove(workflow)) | set(self.next_use.remove(workflow)))
        if self.learner is not None:
            self._learn(workflow)
        self.history.pop(workflow, None)
        self.contexts.pop(workflow, None)
        self.hiddens.pop(workflow, None)
        self.predictions.pop(workflow, None)
        self.version.pop(workflow, None)
        self.ahead.ended(workflow, nodes)
        for node in nodes:
            if node.tier == Tier.DEVICE and self.scores.is_retired(node):
                self.ahead.retire(node)
            self.cache.refresh(node)
        self._rerank(None, moved)

    def prefetch(self, request: PrefetchRequest) -> list[Node]:
        if not self.use_prefetch or self.monitor.trust < PREFETCH_MIN_TRUST:
            return []
        return self.ahead.plan(request)

    # ---------------------------------------------------------------- feedback

    def _observe(self, workflow: int, actual: str) -> None:
        expected = self.expected.get(workflow)
        if expected is not None:
            self.monitor.record(expected[0], expected[1], actual)
            self._apply_trust()

    def _observe_match(self, node: Node) -> None:
        """Record whether the call's cached path reused retired cache; when that switches
        retired-first off or back on, every candidate's class changes: re-rank all tiers."""
        was = self.monitor.retired_first
        retired = 0
        root = self.cache.tree.root
        while node is not root:
            if self.scores.is_retired(node):
                retired += node.tokens
            elif node.id not in self.common and self.scores.is_common(node):
                self.common[node.id] = node
            node = node.parent
        self.monitor.record_match(retired)
        if self.monitor.retired_first != was:
            self._refresh_all()

    def _apply_trust(self) -> None:
        level = round(self.monitor.trust * TRUST_STEPS)
        if level != self.level:
            self.level = level
            fine = self.next_use.timing.step / FINE_BUCKETS
            self.bucket = None if level == TRUST_STEPS else fine * 2 ** (TRUST_STEPS - level)
            self._refresh_all()

    def _refresh_all(self) -> None:
        """Re-rank every eviction candidate of every tier (a ranking rule changed)."""
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            for node in self.cache.candidates(tier):
                self.cache.refresh(node)

    def _learn(self, workflow: int) -> None:
        self.learner.add(self.history[workflow], self.contexts[workflow])
        updated = self.learner.poll()
        if updated is None:
            return
        before, self.predictor = self.predictor, updated
        if list(updated.agents) != list(getattr(before, "agents", ())):
            self._predict_all_again(skip=workflow)

    def _predict_all_again(self, skip: int) -> None:
        """The retrained predictor knows other agent classes: every stored prediction is indexed
        by the old ones (a call that ended under it read them by the new indices: IndexError,
        and the server failed every call in flight). Predict every active workflow again (but
        `skip`, which is ending), its call in progress still pending."""
        now = self.clock()
        for w in [w for w in self.predictions if w != skip]:
            self._predict(w, self.history[w][-1], self.hiddens.get(w), now, pending=w in self.ahead.queued)

    # ---------------------------------------------------------------- bookkeeping

    def _rerank(self, workflow: int | None, moved_classes: list[int]) -> None:
        """New predictions change the scores of the workflow's nodes and of common nodes whose
        agents' totals moved; re-rank those that are eviction candidates."""
        cache = self.cache
        if workflow is not None:
            for node in cache.tree.workflow_nodes.get(workflow, {}).values():
                if node.alive:
                    cache.refresh(node)
        if moved_classes:
            mask = self.scores.agent_bits_of(moved_classes)
            for node_id, node in list(self.common.items()):
                if not node.alive:
                    del self.common[node_id]
                elif node.agent_mask & mask:
                    cache.refresh(node)


def _prompt_blocks(event: CallEvent) -> list[int]:
    """The call's prompt blocks: its hash ids, else the blocks of the path ending at its node."""
    ids = getattr(event.call, "hash_ids", None)
    if ids is not None:
        return ids
    return [b for node in event.node.path() for b in node.blocks]
