"""pbkv fed the best predictions a predictor could make: diagnostics that bound how much of
pbkv's gap to the oracle better predictions could close (docs/benchmarks.md, "What limits pbkv:
the predictions").

For generated workloads only: they read the workload's spec (its transition probabilities and
the hidden task variables' words). Run them beside the built-ins by `module:Class` name:

    PYTHONPATH=examples pbkv bench --workload hover,swe --samples 3 \\
        --policies lru,pbkv,bayes_policies:FromWords,bayes_policies:FromTask,pbkv-perfect,oracle

- `FromWords`: the Bayes-optimal prediction from what a trace shows: a posterior over the task
  variables (prior weights x the likelihood of the context's noisy words x the likelihood of the
  agents called so far), mixed over the spec's exact transition probabilities. No predictor that
  sees only the trace can do better on average.
- `FromTask`: the same transitions given the workflow's true task variables (drawn again from the
  generator): what a predictor could do if the context named the hidden task exactly; what is
  left is the flow's own coin flips (will the tests pass, another hop).
- `pbkv-perfect` (built in) knows the coin flips too: the true next agents.

One replay must be one built-in generated workload (ids `<spec>-<seed>-<index>`, that spec's
agents): anything else (workloads mixed in one trace, a spec file's workload, a recorded trace) is
refused when the policy is built (`replay_spec`: one line naming the workflow id and why).

Turn variables (re-drawn during a workflow, as dialogue's topics) are not modelled: use these on
workloads whose flow depends on task variables only (hover, swe, finance).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from pbkv.policy.pbkv import PBKVPolicy
from pbkv.predict.base import UNK, Prediction
from pbkv.workloads import load_spec, runs
from pbkv.workloads.generate import transition_weights
from pbkv.workloads.spec import END


class SpecBayes:
    """Next-K agent distributions from a spec's flow, given or inferred task variables."""

    name = "spec-bayes"

    def __init__(self, spec_name: str, horizon: int):
        self.spec = load_spec(spec_name)
        self.horizon = horizon
        self.agents = sorted(self.spec.agents)
        self.classes = self.agents + [UNK]
        self.index = {a: i for i, a in enumerate(self.classes)}
        self.trans = {a: [(t.to, self.spec.compile_p(t.p)) for t in self.spec.flow.transitions.get(a, [])]
                      for a in self.spec.agents}
        self.vars = list(self.spec.task.vars.items())
        self._tasks: dict[str, dict] = {}

    # ---------------------------------------------------------------- the flow

    def next_agents(self, last: str, visits: dict, step: int, task: dict) -> dict[str, float]:
        """P(next agent | state), as the generator draws it (`transition_weights` normalised);
        END when every weight is 0 or the flow has no transitions."""
        items = self.trans.get(last) or []
        env = {"task": task, "turn": {}, "visits": visits, "step": step, "last": last}
        ps = transition_weights(items, env, f"flow.transitions.{last}")
        total = sum(ps)
        if total <= 0:
            return {END: 1.0}
        out: dict[str, float] = {}
        for (to, _), p in zip(items, ps):
            if p > 0:
                out[to] = out.get(to, 0.0) + p / total
        return out

    def given(self, task: dict, history: list[str]) -> Prediction:
        """The exact next-K distributions and survival after `history`, given the task."""
        visits = dict.fromkeys(self.spec.agents, 0)
        for a in history:
            visits[a] += 1
        states = {(history[-1], tuple(sorted(visits.items())), len(history)): 1.0}
        n = len(self.classes)
        probs, survival = np.zeros((self.horizon, n)), np.zeros(self.horizon)
        for k in range(self.horizon):
            nxt: dict[tuple, float] = {}
            for (last, vis, step), mass in states.items():
                if step >= self.spec.flow.max_steps:
                    continue
                for to, p in self.next_agents(last, dict(vis), step, task).items():
                    if to == END:
                        continue
                    v = dict(vis)
                    v[to] += 1
                    key = (to, tuple(sorted(v.items())), step + 1)
                    nxt[key] = nxt.get(key, 0.0) + mass * p
                    probs[k, self.index[to]] += mass * p
            survival[k] = sum(nxt.values())
            if survival[k] > 0:
                probs[k] /= survival[k]
            else:
                probs[k, -1] = 1.0
            states = nxt
        return Prediction(self.classes, probs, survival)

    # ---------------------------------------------------------------- the task

    def true_task(self, workflow_id: str) -> dict:
        """The hidden task of a generated workflow `<spec>-<seed>-<index>`, from the generator run
        again with that seed (each workflow draws its task from its own random stream)."""
        task = self._tasks.get(workflow_id)
        if task is None:
            _, seed, i = workflow_id.rsplit("-", 2)
            for run in runs(self.spec, max(int(i) + 1, 2 * len(self._tasks)), int(seed)):
                self._tasks[run.calls[0].workflow_id] = run.task
            task = self._tasks[workflow_id]
        return task

    def posterior(self, context: str | None, history: list[str]) -> list[tuple[float, dict]]:
        """P(task | the context's words, the agents called so far), over every combination of
        task values (the generator writes one word per variable that has words, in order)."""
        words = []
        if context and "(" in context and ")" in context:
            words = context[context.index("(") + 1:context.index(")")].split("; ")
        out = []
        for combo in itertools.product(*[range(len(v.values)) for _, v in self.vars]):
            weight, task, w = 1.0, {}, iter(words)
            for (name, var), idx in zip(self.vars, combo):
                weights = var.weights or [1.0] * len(var.values)
                weight *= weights[idx] / sum(weights)
                task[name] = var.values[idx]
                if var.words is not None:
                    weight *= self._word_likelihood(var, idx, next(w, None))
            visits = dict.fromkeys(self.spec.agents, 0)
            for s, agent in enumerate(history):
                if s:
                    weight *= self.next_agents(history[s - 1], dict(visits), s, task).get(agent, 0.0)
                visits[agent] += 1
            out.append((weight, task))
        z = sum(w for w, _ in out)
        return [(w / z, t) for w, t in out if w > 0] if z > 0 else [(1.0 / len(out), t) for _, t in out]

    @staticmethod
    def _word_likelihood(var, idx: int, word: str | None) -> float:
        if word is None:
            return 1.0
        n = len(var.values)
        p = (1 - var.noise) / len(var.words_for(var.values[idx])) if word in var.words_for(var.values[idx]) else 0.0
        for j in range(n):
            other = var.words_for(var.values[j])
            if j != idx and word in other:
                p += var.noise / (n - 1) / len(other)
        return p

    def from_words(self, context: str | None, history: list[str]) -> Prediction:
        """The posterior mixture of `given` (mixing P(agent, alive) per step, then normalising)."""
        n = len(self.classes)
        joint, survival = np.zeros((self.horizon, n)), np.zeros(self.horizon)
        for weight, task in self.posterior(context, history):
            p = self.given(task, history)
            joint += weight * p.probs * p.survival[:, None]
            survival += weight * p.survival
        probs = joint / np.maximum(survival[:, None], 1e-12)
        probs[survival <= 0] = 0.0
        probs[survival <= 0, -1] = 1.0
        return Prediction(self.classes, probs, survival)


class SpecMismatch(ValueError):
    """The replay is not one built-in generated workload: these policies cannot read its spec."""


def replay_spec(workflows) -> str:
    """The one built-in spec that generated every replayed workflow (ids `<spec>-<seed>-<index>`,
    agents of that spec), checked before any prediction; else `SpecMismatch`, one line naming
    bayes_policies, the workflow id and the reason."""
    from pbkv.workloads.spec_files import builtin_names
    names = builtin_names()
    spec_name, agents = None, None
    for calls in workflows:
        if not calls:
            continue
        wid = calls[0].workflow_id
        parts = str(wid).rsplit("-", 2)
        why = None
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            why = "not a generated workflow id <spec>-<seed>-<index>"
        elif parts[0] not in names:
            why = (f"{parts[0]!r} is not a built-in workload ({', '.join(names)}); a workload generated from a "
                   f"spec file or a recorded trace has no spec these policies can read")
        elif spec_name is not None and parts[0] != spec_name:
            why = (f"from workload {parts[0]!r}, but the replay began with {spec_name!r}; one replay must be "
                   f"one generated workload")
        else:
            if spec_name is None:
                spec_name, agents = parts[0], set(load_spec(parts[0]).agents)
            unknown = sorted({c.agent for c in calls} - agents)
            if unknown:
                why = f"calls agent(s) {', '.join(unknown)} that spec {spec_name!r} does not have"
        if why:
            raise SpecMismatch(f"bayes_policies: workflow {wid!r}: {why}")
    if spec_name is None:
        raise SpecMismatch("bayes_policies: the replay has no workflow")
    return spec_name


class _SpecPolicy(PBKVPolicy):
    reads_future = True   # for the workflow ids' spec name; the predictions read no future call

    def __init__(self, ctx):
        bayes = SpecBayes(replay_spec(ctx.future.workflows), int(ctx.horizon or 3))
        super().__init__(replace(ctx, predictors={**ctx.predictors, self.variant: bayes}))
        self.ids: dict[int, str] = {}

    def on_workflow_start(self, workflow: int, workflow_id: str) -> None:
        self.ids[workflow] = workflow_id
        super().on_workflow_start(workflow, workflow_id)

    def on_workflow_end(self, workflow: int, nodes) -> None:
        super().on_workflow_end(workflow, nodes)
        self.ids.pop(workflow, None)


class FromWords(_SpecPolicy):
    """pbkv with the Bayes-optimal prediction from the trace's context words and agent history."""

    name = "pbkv-bayes-words"

    def _prediction(self, w: int, hidden):
        return self.predictor.from_words(self.contexts[w][-1], self.history[w])


class FromTask(_SpecPolicy):
    """pbkv with the exact prediction given the workflow's true task variables."""

    name = "pbkv-bayes-task"

    def _prediction(self, w: int, hidden):
        return self.predictor.given(self.predictor.true_task(self.ids[w]), self.history[w])
