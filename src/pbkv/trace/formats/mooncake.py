"""Mooncake FAST'25 traces (kvcache-ai/Mooncake, `FAST25-release/traces/*.jsonl`).

What the release documents (its README and the rows themselves): one request per line with
`timestamp` (arrival in milliseconds from the trace start), `input_length` and `output_length`
(tokens) and `hash_ids`, remapped ids of 512-token prompt blocks, `ceil(input_length / 512)` of
them (the last block partial). Requests carry no session or agent, so each becomes a one-call
workflow `mooncake-<line>` of agent `chat`, with `t` = timestamp / 1000 seconds.
"""

from __future__ import annotations

from pbkv.trace.call import Call
from pbkv.trace.formats.base import ImportReport, Row, lengths_and_ids, number

BLOCK_SIZE = 512


def read(rows: list[Row], block_size: int, report: ImportReport) -> list[Call]:
    """One workflow per row, in file order (ids still raw: the caller re-chains them)."""
    calls = []
    for row in rows:
        timestamp = number(row.chk, "timestamp", required=True)
        input_length, output_length, ids = lengths_and_ids(row.chk, block_size)
        calls.append(Call(workflow_id=f"mooncake-{row.line}", step=0, agent="chat", workload="mooncake",
                          input_length=input_length, output_length=output_length, hash_ids=ids,
                          t=timestamp / 1000.0, done=True))
    return calls
