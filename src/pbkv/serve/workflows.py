"""Which workflow a served call belongs to, and when each workflow ends.

A call names its workflow with the hint `workflow_id` (body) or `X-Workflow-Id` (header), its
agent with `agent` / `X-Agent`, and its being the last with `workflow_done`: one `Hints` record,
built by the HTTP layer (`generate.prepare`). The table turns hints into workflow runs:
- the first call with an unknown id starts a run (the engine then tells the policy
  `on_workflow_start`, exactly as the simulator's driver does before a workflow's first call);
- later calls with that id join the run, with steps 0, 1, 2, ... in arrival order;
- a run ends (the policy hears `on_workflow_end`) once it has no call in flight and either a call
  said `workflow_done`, `POST /v1/workflows/{id}/end` asked for it, or it sat idle longer than
  `idle_timeout` seconds (`expired`, by the injected clock: nothing here sleeps or reads time);
- a call without a workflow id is a run of its own, ended right after the call.
Ending detaches the id at once: a call that arrives with the same id later starts a new run.

Names: `workflow_id` is always the client's string; `Run.workflow` is the server's own int id of
a run (what the engine, the cache and the policy call `workflow`); `Run.record_id` is the id the
policy's `on_workflow_start` hears and the recorder writes (never the client's string: it may be
anything). Agent names are client strings too: at most `max_agents` distinct ones are kept, later
new ones become `OTHER_AGENT`; a call without one is `DEFAULT_AGENT`'s.

Invariants: every run that starts ends exactly once; a run never ends while one of its calls is
in flight; runs get distinct `workflow` ids (ints, increasing) and distinct `record_id`s.

Not thread-safe on purpose: the engine worker thread owns the table (as it owns the engine).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pbkv.predict.base import RESERVED_AGENTS
from pbkv.trace import DEFAULT_AGENT

OTHER_AGENT = "other"   # the agent of every call whose new name exceeds `max_agents`


def _renamed(agent: str) -> bool:
    """A client agent name that `WorkflowTable._agent` wraps in parentheses: a reserved name or
    OTHER_AGENT, bare or already wrapped in any number of pairs (wrapping stays one-to-one)."""
    core = agent
    while core.startswith("(") and core.endswith(")"):
        core = core[1:-1]
    return core in (*RESERVED_AGENTS, OTHER_AGENT)


@dataclass(frozen=True)
class Hints:
    """What one call says about its workflow; every field optional."""

    workflow_id: str | None = None   # the client's workflow id; None: the call is a run of its own
    agent: str | None = None         # None: DEFAULT_AGENT
    done: bool = False               # this call is the workflow's last


@dataclass(eq=False)
class Run:
    """One workflow run. `calls` collects what the recorder writes when the run ends."""

    workflow: int                # the server's id of the run (the engine's and the policy's `workflow`)
    workflow_id: str | None      # the client's workflow id; None for a one-call run
    record_id: str               # the id the policy hears and traces get
    started: float
    last_active: float
    steps: int = 0
    in_flight: int = 0
    ending: str | None = None  # why it ends (done, endpoint, idle, single, shutdown), once nothing is in flight
    agents: list[str] = field(default_factory=list)
    contexts: list[str | None] = field(default_factory=list)
    calls: list = field(default_factory=list)
    last_finish: float | None = None


class WorkflowTable:
    def __init__(self, idle_timeout: float = 300.0, session: str | None = None, max_agents: int = 256):
        if idle_timeout <= 0:
            raise ValueError(f"idle timeout must be > 0 seconds, got {idle_timeout}")
        self.idle_timeout, self.max_agents = idle_timeout, max_agents
        self.session = session or secrets.token_hex(3)
        self.agents: set[str] = set()
        self.by_id: dict[str, Run] = {}     # client workflow id -> its live run
        self.live: dict[int, Run] = {}
        self._next = 0
        self.started = 0
        self.ended: dict[str, int] = {"done": 0, "endpoint": 0, "idle": 0, "single": 0, "shutdown": 0}

    def begin(self, hints: Hints, now: float, context: str | None = None) -> tuple[Run, int, bool]:
        """A call arrives: (its run, its step, whether the run is new)."""
        key = hints.workflow_id
        run = self.by_id.get(key) if key is not None else None
        new = run is None
        if new:
            run = Run(self._next, key, f"{self.session}-{self._next}", now, now)
            self._next += 1
            self.started += 1
            self.live[run.workflow] = run
            if key is not None:
                self.by_id[key] = run
        step = run.steps
        run.steps += 1
        run.in_flight += 1
        run.last_active = now
        run.agents.append(self._agent(hints.agent))
        run.contexts.append(context)
        if hints.done or key is None:
            self._detach(run, "done" if key is not None else "single")
        return run, step, new

    def _agent(self, agent: str | None) -> str:
        """The agent name a call gets: at most `max_agents` distinct client names are kept, and a
        name the predictor reserves ("<unk>", "<end>") is put in parentheses ("(<end>)"): as is,
        it would be the predictor's unknown class or the end of the workflow. So that no two
        client names become one, a name that already is a reserved or server-made name in
        parentheses ("(<end>)", "((other))") gets one more pair, and so does the client's own
        "other" (else it would merge with the calls past `max_agents`)."""
        if agent is None:
            return DEFAULT_AGENT
        if _renamed(agent):
            agent = f"({agent})"
        if agent not in self.agents:
            if len(self.agents) >= self.max_agents:
                return OTHER_AGENT
            self.agents.add(agent)
        return agent

    def finish(self, run: Run, now: float) -> bool:
        """A call of `run` completed (or failed); True when the run must end now."""
        run.in_flight -= 1
        run.last_active = run.last_finish = now
        return run.ending and run.in_flight == 0

    def request_end(self, workflow_id: str) -> Run | None:
        """`POST /v1/workflows/{workflow_id}/end`: the run to end now, or None (it ends when its
        calls in flight finish). Raises KeyError for an id with no live run."""
        run = self.by_id.get(workflow_id)
        if run is None:
            raise KeyError(workflow_id)
        self._detach(run, "endpoint")
        return run if run.in_flight == 0 else None

    def expired(self, now: float) -> list[Run]:
        """Runs idle (nothing in flight) for longer than the timeout: to end now."""
        out = [r for r in self.by_id.values() if r.in_flight == 0 and now - r.last_active > self.idle_timeout]
        for r in out:
            self._detach(r, "idle")
        return out

    def all_live(self) -> list[Run]:
        """Every run not yet ended (at shutdown: end them all)."""
        for r in list(self.live.values()):
            self._detach(r, "shutdown")
        return list(self.live.values())

    def remove(self, run: Run) -> None:
        """The run ended (the caller told the engine); forget it."""
        if self.live.pop(run.workflow, None) is not None:
            self.ended[run.ending] = self.ended.get(run.ending, 0) + 1

    def _detach(self, run: Run, reason: str) -> None:
        run.ending = run.ending or reason   # the first reason given is why it ends
        if run.workflow_id is not None and self.by_id.get(run.workflow_id) is run:
            del self.by_id[run.workflow_id]
