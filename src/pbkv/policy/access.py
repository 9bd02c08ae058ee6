"""Access counts per node for frequency-aware peers (SLRU, ARC), kept in `node.policy_data`.

A call's prompt is one access of every node on its path: the matched prefix counts when the
call starts (a hit; a node the prompt leaves midway is not counted, only its matched front,
which a split will cut off), the nodes the call inserted count once when it ends (their first
access). Counts survive tier moves. A split's new upper part starts without a count: when the
call that split it ends, it gets 1 + the largest count below it (whatever used a lower part
used the upper part too, and so did this call).
"""

from __future__ import annotations

from pbkv.cache import Node, RadixTree


def count(node: Node) -> int:
    return node.policy_data or 0


def on_hit(tree: RadixTree, node: Node, hash_ids: list[int] | None) -> list[Node]:
    """A call whose prompt matched the path ending at `node` (its blocks `hash_ids`, when
    known) starts: one more access each. Returns the nodes whose count reached 2 (they just
    became "frequent")."""
    if hash_ids is not None:
        node, matched = tree.match(hash_ids)
        if matched and node.end > matched:
            node = node.parent  # only the front of this node matched
    promoted = []
    below = 0
    while node is not tree.root:
        n = node.policy_data if node.policy_data is not None else max(below, 1)
        node.policy_data = n + 1
        if n + 1 == 2:
            promoted.append(node)
        below = n
        node = node.parent
    return promoted


def on_insert(tree: RadixTree, node: Node) -> None:
    """A call ended at `node`: its path's nodes without a count were created by it (inserted:
    one access; split off above an older node: one more than the most used part below)."""
    deepest = node
    while node is not tree.root:
        if node.policy_data is None:
            below = max((count(c) for c in node.children.values()), default=0)
            node.policy_data = 1 if node is deepest else below + 1
        node = node.parent
