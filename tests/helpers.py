"""Small builders for hand-made cache tests: a prompt is a string, one character per block."""

from __future__ import annotations

from pbkv.cache import Capacities, RadixTree, TieredCache
from pbkv.policy import PolicyContext, make_policy

BLOCK = 4
_ids: dict[str, int] = {}


def ids(prompt: str) -> list[int]:
    """Chained block ids: equal prefixes give equal ids (as docs/trace-format.md requires)."""
    return [_ids.setdefault(prompt[: i + 1], len(_ids)) for i in range(len(prompt))]


def make_cache(device: int, host: int = 0, disk: int = 0, policy: str = "lru", ctx: PolicyContext | None = None):
    pol = make_policy(policy, ctx or PolicyContext(block_size=BLOCK))
    cache = TieredCache(RadixTree(BLOCK), Capacities(device, host, disk), pol)
    pol.bind(cache)
    return cache, pol


def put(cache: TieredCache, prompt: str, now: float, workflow: int | None = None, agent: str | None = None,
        tail: int = BLOCK):
    """Insert a prompt on the device the way an engine does: reserve, insert, touch."""
    h = ids(prompt)
    node, matched = cache.tree.match(h)
    assert cache.reserve(len(prompt) * BLOCK)
    leaf, added = cache.insert(h, tail, now)
    cache.release(len(prompt) * BLOCK - added)
    cache.tree.touch(leaf, now, workflow, agent)
    cache.refresh(leaf)
    return leaf


def resident(cache: TieredCache) -> dict[str, list[str]]:
    """Tier name -> sorted list of node labels (the prompt prefix up to each node's end)."""
    label = {v: k for k, v in _ids.items()}
    out: dict[str, list[str]] = {}
    for n in cache.tree.iter_nodes():
        out.setdefault(n.tier.name, []).append(label[n.blocks[-1]])
    return {k: sorted(v) for k, v in out.items()}


def lost_load_calls(bs: int) -> list:
    """Open-loop calls (block size `bs`, for a device of 25 blocks and a host of 6) in which B loads
    its prefix and loses it before it is served. P (1 block) and Q (4) go to the host under a
    24-block call; X (4) comes after. At t=5 A (P + 19 blocks, 2 * bs outputs) and B (Q + 1) both
    load their prefix. A then cannot fit while B pins Q and nothing runs, so B's pin is released;
    A's room evicts Q (the oldest) to the host, then X, whose room there pushes Q out: B
    recomputes its whole prompt, 5 blocks (A reuses P's block, loaded from the host)."""
    from pbkv.trace import Call

    def call(name, prompt, outputs, t):
        return Call(name, 0, "a", bs * len(prompt), outputs, ids(prompt), t=t)
    return [call("P", "p", 1, 0.0), call("Q", "qqqq", 1, 1.0), call("big", "b" * 24, 1, 2.0),
            call("X", "xxxx", 1, 3.0), call("A", "p" + "a" * 19, 2 * bs, 5.0), call("B", "qqqqr", 1, 5.0)]


class FakePredictor:
    """A predictor whose answers a test sets by hand: `table[last agent] = (probs, survival)`."""

    name = "fake"

    def __init__(self, agents, horizon, table=None, default=None):
        import numpy as np
        self.agents = list(agents)
        self.horizon = horizon
        self.table = table or {}
        k, c = horizon, len(agents) + 1
        self.default = default or (np.full((k, c), 1.0 / c), np.ones(k))
        self.calls = []

    def predict(self, history, context=None, hidden=None):
        import numpy as np
        from types import SimpleNamespace
        self.calls.append((list(history), context))
        key = context if context in self.table else (history[-1] if history else None)
        probs, surv = self.table.get(key, self.default)
        return SimpleNamespace(agents=self.agents + ["<unk>"], probs=np.asarray(probs, float),
                               survival=np.asarray(surv, float))

    def predict_batch(self, items):
        return [self.predict(h, c) for h, c in items]


def invoke(*args):
    """`pbkv ARGS...` through typer's runner (arguments as strings)."""
    from typer.testing import CliRunner
    from pbkv.cli import app
    return CliRunner().invoke(app, [str(a) for a in args])


def flat(output: str) -> str:
    """`output` with rich's panel borders and line wrapping taken out (one line, single spaces)."""
    return " ".join(output.replace("│", " ").split())
