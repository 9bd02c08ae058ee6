"""examples/multi_agent.py, langgraph_agents.py, vllm_client.py without a server: Ctrl-C, a server
that is down, bad arguments, and the early end of a LangGraph workflow (langgraph stood in for)."""

import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def ma(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import multi_agent
    return multi_agent


def test_ctrl_c_cancels_the_queued_workflows_and_keeps_the_completed(ma):
    started = []

    def work(i, stop):
        started.append(i)
        if i == 1:
            raise KeyboardInterrupt       # as Ctrl-C reaches run_pool's wait
        if i >= 2:                        # at most one more starts before the queue is cancelled
            stop.wait(10)
            raise ma.Stopped(i)
        return f"w{i}"

    with pytest.raises(ma.Interrupted) as e:
        ma.run_pool(work, 10, 1)
    assert (e.value.results, e.value.completed, e.value.total) == (["w0"], 1, 10)
    assert started in ([0, 1], [0, 1, 2])          # not the 10 (the executor's exit ran every one)


def test_a_workflow_stops_before_its_next_call_once_stopped(ma):
    calls = []
    stop = threading.Event()

    def create(**kw):
        calls.append(kw["extra_body"]["agent"])
        stop.set()                                   # Ctrl-C during the first call
        return SimpleNamespace(usage=SimpleNamespace(prompt_tokens=1, completion_tokens=1),
                               choices=[SimpleNamespace(message=SimpleNamespace(content="x"))])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)), api_key="k")
    with pytest.raises(ma.Stopped):
        ma.run_workflow(client, "tiny", 0, stop=stop)
    assert calls == ["router"]


def test_multi_agent_ctrl_c_prints_what_completed(ma, monkeypatch, capsys):
    def run_many(*a, **k):
        raise ma.Interrupted([ma.CallResult("w", "router", 0.1, 1, 1)] * 3, 1, 5)

    monkeypatch.setattr(ma, "run_many", run_many)
    monkeypatch.setattr(sys, "argv", ["multi_agent.py", "--workflows", "5"])
    with pytest.raises(SystemExit) as e:
        ma.main()
    out = capsys.readouterr()
    assert e.value.code == 130
    assert out.err == "interrupted: 1 of 5 workflows completed\n"
    assert out.out.startswith("1 workflows, 3 calls in ")


@pytest.mark.parametrize("argv, err", [
    (["--base-url", "http://127.0.0.1:9/v1"],
     "multi_agent.py: cannot reach the server at http://127.0.0.1:9/v1: Connection error.\n"),
    (["--concurrency", "0"], "multi_agent.py: error: argument --concurrency: 0: must be at least 1\n"),
    (["--workflows", "x"], "multi_agent.py: error: argument --workflows: invalid int value: 'x'\n"),
])
def test_multi_agent_errors_are_one_line(ma, monkeypatch, capsys, argv, err):
    def down(*a, **k):
        raise openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions"))

    monkeypatch.setattr(ma, "run_workflow", down)
    monkeypatch.setattr(sys, "argv", ["multi_agent.py", *argv])
    with pytest.raises(SystemExit) as e:
        ma.main()
    assert e.value.code in (1, 2)
    assert capsys.readouterr().err == err


def test_vllm_client_server_down_is_one_line(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import vllm_client

    def down(self, **kw):
        raise openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions"))

    monkeypatch.setattr(openai.resources.chat.completions.Completions, "create", down)
    monkeypatch.setattr(sys, "argv", ["vllm_client.py", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"])
    with pytest.raises(SystemExit) as e:
        vllm_client.main()
    assert e.value.code == "vllm_client.py: cannot reach the server at http://127.0.0.1:9/v1: Connection error."


class FakeGraph:
    """The little of langgraph's StateGraph the example uses: nodes, edges, conditional edges."""

    def __init__(self, state_type):
        self.nodes, self.edges, self.cond = {}, {}, {}

    def add_node(self, name, fn):
        self.nodes[name] = fn

    def add_edge(self, a, b):
        self.edges[a] = b

    def add_conditional_edges(self, a, pick, targets):
        self.cond[a] = pick

    def compile(self):
        return self

    def invoke(self, state, config=None):
        state, node = dict(state), self.edges["__start__"]
        while node != "__end__":
            state.update(self.nodes[node](state))
            node = self.cond[node](state) if node in self.cond else self.edges[node]
        return state


@pytest.fixture
def lg(monkeypatch):
    graph = types.ModuleType("langgraph.graph")
    graph.END, graph.START, graph.StateGraph = "__end__", "__start__", FakeGraph
    monkeypatch.setitem(sys.modules, "langgraph", types.ModuleType("langgraph"))
    monkeypatch.setitem(sys.modules, "langgraph.graph", graph)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("langgraph_agents", None)
    import langgraph_agents
    yield langgraph_agents
    sys.modules.pop("langgraph_agents", None)


def test_langgraph_ends_a_workflow_its_router_says_done_early(lg, monkeypatch):
    """multi_agent.py posts /v1/workflows/{id}/end when the router answers DONE before the planned
    last call (no call said workflow_done); langgraph_agents.py left the workflow live."""
    sent, posted = [], []

    def create(**kw):
        agent = kw["extra_body"]["agent"]
        sent.append((agent, kw["extra_body"]["workflow_done"]))
        answer = "DONE" if agent == "router" and len(sent) > 1 else "ok"
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=answer))])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)), api_key="k",
                             base_url=httpx.URL("http://fake:8000/v1/"))
    monkeypatch.setattr(lg.httpx, "post", lambda url, **kw: posted.append((url, kw["headers"])))
    assert lg.run_one(lg.build_graph(client, "tiny", 4), 0, 0) == 3
    assert [done for _, done in sent] == [False, False, False]
    assert posted == [("http://fake:8000/v1/workflows/lg-0-0/end", {"Authorization": "Bearer k"})]
