"""Turn a foreign trace's block ids into chained pbkv ids, at the block size the replay wants.

Foreign ids (Mooncake, Qwen-Bailian, Dynamo) name the content of one block of `source` tokens;
whether an id also implies the blocks before it differs between traces. pbkv's format needs
chained ids (`hash_ids[i]` names blocks 0..i), so ids are first chained by the whole prefix:
a chain id stands for the tuple `raw[0..i]`. Two prompts share chain id `i` exactly when their
raw ids agree at every position up to `i`, which is what prefix caching can reuse.

Output block `j` covers tokens `[j*B, min((j+1)*B, L))`. It is named by the chain id of the
source block holding its last token, its index `j` and its token count. Hence two prompts get the
same output id at `j` exactly when every source block that output block touches is shared and
the block holds as many tokens in both, i.e. the sharing the source ids prove. A partial last
block so never shares an id with a full one: their contents differ (as a real hash of a partial
block differs from the full block's), and pbkv's cache cannot extend a partial block.

- B == S, or B divides S (split), or S divides B (merge): block-exact, nothing lost or invented;
- sizes that do not divide: an output block that crosses from a shared source block into the
  first differing one counts as not shared (its first tokens may truly be shared, but the source
  ids cannot tell), so sharing is a lower bound, short by at most one output block per prompt.

Chain ids are numbered 0, 1, 2, ... in order of first appearance, and an output id is computed
from (chain id, position, token count) without a table of output ids, so converting to small
blocks stays cheap in memory; the ids are sparse, and the same on every run.
"""

from __future__ import annotations


class Rechainer:
    """Maps raw ids of `source`-token blocks to chained ids of `block_size`-token blocks.

    Invariant: an output id fixes its position and its predecessor (it is chained in the sense of
    TRACE_FORMAT.md), and equal output ids mean equal raw-id prefixes."""

    def __init__(self, source: int, block_size: int):
        if source < 1 or block_size < 1:
            raise ValueError(f"block sizes must be >= 1, got source {source} and target {block_size}")
        self.source, self.block_size = source, block_size
        self._chain: dict[tuple[int, int], int] = {}  # (parent chain id, raw id) -> chain id
        # output blocks whose last token lies in one source block: at most this many
        self._span = (source - 1) // block_size + 2

    def convert(self, raw: list[int], input_length: int) -> list[int]:
        """Output ids for one prompt; `raw` must hold `ceil(input_length / source)` ids."""
        chained, parent = [], -1
        for h in raw:
            parent = self._chain.setdefault((parent, h), len(self._chain))
            chained.append(parent)
        source, size, span = self.source, self.block_size, self._span
        n = -(-input_length // size)
        # block j of a full size ends in source block i = ((j+1)*size - 1) // source; the last may be partial
        ends = [((j + 1) * size - 1) // source for j in range(n - 1)] + [(input_length - 1) // source]
        tokens = [size] * (n - 1) + [input_length - (n - 1) * size]
        # (chain id of i, j, tokens) as one int: the chain id fixes i, and j - (first j ending in block i) < span
        return [((chained[i] * span + j - i * source // size) * size + t - 1)
                for j, (i, t) in enumerate(zip(ends, tokens))]
