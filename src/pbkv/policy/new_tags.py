"""The node ids each live workflow's tags gained since the last look: lets an index revisit only
what a prediction changed, not every tagged node (`retired_space`, `pbkv_prefetch`)."""

from __future__ import annotations

from itertools import islice
from typing import Iterator


def new_tags(tags: dict, marks: dict) -> Iterator[Iterator[int]]:
    """Per workflow of `tags` (workflow -> its tag dict, node id -> ..., insertion-ordered), the
    node ids added since the last call with the same `marks` (workflow -> (its tag dict, entries
    seen), updated here). A workflow id used again gets a new dict and is seen from its start.
    Invariant: every entry is yielded once per `marks`, as long as entries are only appended."""
    for workflow, nodes in tags.items():
        mark = marks.get(workflow)
        seen = mark[1] if mark is not None and mark[0] is nodes else 0
        if len(nodes) != seen:
            marks[workflow] = (nodes, len(nodes))
            yield islice(nodes, seen, None)
