"""PBKV's conservative prefetch: load ahead only into space nobody needs.

Rules (docs/design.md, "Prefetch"):
- space: free device tokens + tokens of retired device nodes (dead cache); a prefetch never
  evicts a node some active workflow may still use;
- timing: only while the engine runs decode-only batches (the engine calls `prefetch` then);
- budget per call: min(that space, link bandwidth x decode-step time);
- ranking: the one-step value V1 (the next call's reuse), deeper nodes first among equals,
  because loading a node loads its whole non-resident path.
"""

from __future__ import annotations

from pbkv.cache import Node, Tier, TieredCache


def plan(candidates: list[tuple[float, Node]], budget_tokens: int, space_tokens: int,
         min_value: float = 0.05) -> list[Node]:
    """Pick nodes to load, best V1 first, within min(budget, space). Pure: touches nothing."""
    limit = min(budget_tokens, space_tokens)
    chosen: list[Node] = []
    taken: set[int] = set()
    worth = [vn for vn in candidates if vn[0] >= min_value]
    for value, node in sorted(worth, key=lambda vn: (-vn[0], -vn[1].start, vn[1].id)):
        if limit <= 0:
            break
        if node.lock or node.tier == Tier.DEVICE:
            continue
        need = [n for n in TieredCache.below_device(node) if n.id not in taken]
        tokens = sum(n.tokens for n in need)
        if not need or tokens > limit or any(n.lock for n in need):
            continue
        limit -= tokens
        taken.update(n.id for n in need)
        chosen.append(node)
    return chosen
