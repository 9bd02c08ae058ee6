"""The commands the event loop puts on the engine thread's queue (`worker.py`), served FCFS.

`Submit` a job, `Cancel` one, `Invoke` a function on the engine thread (its result or error
into `future`: /metrics snapshots, routing stats, workflow ends), `Stop` the thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from pbkv.serve.jobs import Job


@dataclass
class Submit:
    job: Job


@dataclass
class Cancel:
    job: Job


@dataclass
class Invoke:
    fn: Callable[[], object]
    future: Future


@dataclass
class Stop:
    pass
