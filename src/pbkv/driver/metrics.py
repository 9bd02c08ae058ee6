"""What a run measured: per-call and per-workflow records, summarised into one flat record.

Hit rates are fractions of prompt tokens by where their KV came from when the call was served:
device (already resident, prefetched included), host, disk, and (the real engine with a shared
directory) shared; the rest was recomputed. They are counted when the engine admits the call for
its prefill, so a prefix the call loaded and then lost while it waited counts as recomputed.

A call the engine ended with "error" (the real engine: its own forward pass raised) is counted in
`failed` (`first_error` says why) and left out of every other per-call figure: it produced no
first token, so its TTFT, latency and hit/recompute counts mean nothing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pbkv.engine.request import Request
from pbkv.engine.sampling import ERROR


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Recorder:
    """Per-call and per-workflow figures of one replay. `makespan_s` runs from the first
    workflow's start to the last one's end: an open-loop trace whose first arrival is at
    t = 1000 s does not count the 1000 idle seconds before it (throughput, workflows /
    makespan, would be diluted by them)."""

    ttft: list[float] = field(default_factory=list)
    call_latency: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    disk_hit: int = 0
    shared_hit: int = 0
    recomputed: int = 0
    calls: int = 0
    starts: dict[int, float] = field(default_factory=dict)
    latency: list[float] = field(default_factory=list)
    end_time: float = 0.0
    first_start: float | None = None   # the earliest workflow start (None: none started)
    failed: int = 0                    # calls ended with "error" (counted in `calls` too)
    first_error: str | None = None     # the first failed call's `Request.error`

    def workflow_started(self, i: int, workflow_id: str, now: float) -> None:
        self.starts[i] = now
        if self.first_start is None or now < self.first_start:
            self.first_start = now

    def workflow_finished(self, i: int, now: float) -> None:
        self.latency.append(now - self.starts.pop(i))
        self.end_time = max(self.end_time, now)

    def call_finished(self, req: Request) -> None:
        self.calls += 1
        if req.finish_reason == ERROR:
            self.failed += 1
            if self.first_error is None:
                self.first_error = f"{req.call.workflow_id} step {req.call.step}: " + " ".join(str(req.error).split())
            return
        self.ttft.append(req.first_token - req.arrival)
        self.call_latency.append(req.finished - req.arrival)
        self.prompt_tokens += req.call.input_length
        self.device_hit += req.device_hit
        self.host_hit += req.host_hit
        self.disk_hit += req.disk_hit
        self.shared_hit += req.shared_hit
        self.recomputed += req.recomputed

    def summary(self) -> dict:
        n = max(1, self.prompt_tokens)
        return {
            "workflows": len(self.latency),
            "calls": self.calls,
            "mean_workflow_latency_s": sum(self.latency) / max(1, len(self.latency)),
            "p99_workflow_latency_s": percentile(self.latency, 99) if self.latency else 0.0,
            "mean_ttft_s": sum(self.ttft) / max(1, len(self.ttft)),
            "p99_ttft_s": percentile(self.ttft, 99) if self.ttft else 0.0,
            "device_hit_rate": self.device_hit / n,
            "host_hit_rate": self.host_hit / n,
            "disk_hit_rate": self.disk_hit / n,
            "shared_hit_rate": self.shared_hit / n,
            "recomputed_tokens": self.recomputed,
            "prompt_tokens": self.prompt_tokens,
            "makespan_s": self.makespan(),
        }

    def makespan(self) -> float:
        """Seconds from the first workflow's start to the last finish (0 when none finished)."""
        if not self.latency or self.first_start is None:
            return 0.0
        return self.end_time - self.first_start
