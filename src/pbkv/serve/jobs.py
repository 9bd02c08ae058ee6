"""One generation as the server sees it: a `Job`, from the HTTP layer to the engine thread and back.

The HTTP layer sets what the client asked for (prompt, sampling, hints, stop strings, context);
`EngineWorker.submit` gives the job its event queue on the event loop; the engine thread sets the
rest when it turns the job into the engine's `Request` (one request per job, `EngineWorker.jobs`
maps back). The job's queue receives text pieces (`str`) zero or more times, then exactly one
`Done`, always from the engine thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pbkv.engine.hf import CANCELLED, ERROR, Sampling
from pbkv.serve.workflows import Hints

if TYPE_CHECKING:
    from pbkv.engine.request import Request
    from pbkv.serve.tokenizer import Detokenizer
    from pbkv.serve.workflows import Run

__all__ = ["CANCELLED", "ERROR", "Done", "HeldText", "Job"]


class HeldText(str):
    """A text piece handed on later than it came: the ingress of `pbkv serve --replicas` holds a
    plain answer's text until its `Done` (to retry the call if its replica is lost). `arrived` is
    when it came from the engine (`time.perf_counter()`): the time to first token the server
    reports, as in one process."""

    arrived: float

    def __new__(cls, text: str, arrived: float):
        piece = super().__new__(cls, text)
        piece.arrived = arrived
        return piece


@dataclass(frozen=True)
class Done:
    """A job's last event: why it ended ("stop" | "length" | "cancelled" | "error") and its usage."""

    reason: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens whose KV came from each tier
    error: str | None = None     # with reason "error": what failed
    code: str = "engine_error"   # with reason "error": the OpenAI error code the client gets


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    sampling: Sampling                     # max_new_tokens set (the server's max_tokens)
    hints: Hints = field(default_factory=Hints)
    stops: list[str] = field(default_factory=list)
    context: str | None = None             # the latest message, for the predictor
    streamed: bool = False                 # the client reads text as it comes (SSE): a replica lost
                                           # after the first piece cannot be retried (pbkv.scale)
    # the event loop's side (`EngineWorker.submit`)
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    # the engine thread's side (`EngineWorker._submit`)
    req: Request | None = None             # set once the engine holds it
    run: Run | None = None
    detok: Detokenizer | None = None
    arrival: float = 0.0
    error: str | None = None               # why the engine ended it with "error"

    def put(self, event: str | Done) -> None:
        """Hand `event` to the event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
            pass
