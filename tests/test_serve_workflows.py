"""Workflow hints on the real server: what the policy hears and in which order, ending by
`workflow_done`, by the end endpoint and by idling (injected clock), the recorded traces, and
online learning saved to / loaded from `--predictor`."""

import httpx
import openai
import pytest

from pbkv.engine.hf.tokens import block_hashes
from pbkv.predict.store import live_dir
from pbkv.trace import read_trace
from serve_helpers import FakeClock, on_engine, start_server, torch_threads  # noqa: F401


@pytest.fixture(scope="module")
def srv(torch_threads, tmp_path_factory):  # noqa: F811
    clock = FakeClock()
    rec = tmp_path_factory.mktemp("rec")
    server = start_server(clock=clock, record=str(rec), policy="pbkv")
    server.clock, server.rec = clock, rec
    server.events = []
    policy = server.state.setup.policy

    def spy(name):  # record every lifecycle hook the engine calls, then run the real one
        real = getattr(policy, name)

        def hook(*args):
            ev = args[0]
            server.events.append((name, ev if isinstance(ev, int) else ev.workflow,
                                  None if isinstance(ev, int) else (ev.step, ev.agent)))
            return real(*args)
        return hook
    on_engine(server, lambda: [setattr(policy, n, spy(n)) for n in
                               ("on_workflow_start", "on_call_start", "on_call_end", "on_workflow_end")])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, text, **extra):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          max_tokens=3, temperature=0, extra_body=extra or None)


def events_of(srv, wf):
    return [(name, detail) for name, w, detail in srv.events if w == wf]


def wf_of(srv, key):
    return on_engine(srv, lambda: srv.state.worker.table.by_id[key].workflow)


def test_hinted_workflow_events_in_driver_order(srv, client):
    ask(client, "plan the trip", workflow_id="trip", agent="planner")
    wf = wf_of(srv, "trip")
    ask(client, "book it", workflow_id="trip", agent="booker")
    httpx.post(srv.url + "/v1/chat/completions", headers={"X-Workflow-Id": "trip", "X-Agent": "planner"},
               json={"model": "tiny", "messages": [{"role": "user", "content": "check"}], "max_tokens": 2})
    r = httpx.post(srv.url + "/v1/workflows/trip/end")
    assert r.status_code == 200 and r.json()["ended"] is True
    assert events_of(srv, wf) == [
        ("on_workflow_start", None),
        ("on_call_start", (0, "planner")), ("on_call_end", (0, "planner")),
        ("on_call_start", (1, "booker")), ("on_call_end", (1, "booker")),
        ("on_call_start", (2, "planner")), ("on_call_end", (2, "planner")),
        ("on_workflow_end", None)]
    assert httpx.post(srv.url + "/v1/workflows/trip/end").status_code == 404  # ended once only


def test_done_flag_and_unhinted_calls_end_their_workflows(srv, client):
    ask(client, "first", workflow_id="short", agent="a")
    wf = wf_of(srv, "short")
    ask(client, "last", workflow_id="short", agent="b", workflow_done=True)
    assert [n for n, _ in events_of(srv, wf)][-2:] == ["on_call_end", "on_workflow_end"]
    before = len(srv.events)
    ask(client, "no hints at all")
    names = [n for n, _, _ in srv.events[before:]]
    assert names == ["on_workflow_start", "on_call_start", "on_call_end", "on_workflow_end"]
    assert len({w for _, w, _ in srv.events[before:]}) == 1


def test_idle_workflows_end_by_the_injected_clock(srv, client):
    ask(client, "then nothing", workflow_id="idle-one", agent="a")
    worker = srv.state.worker
    assert worker.expire_idle().result(30) == 0          # no time has passed
    srv.clock.t += 59
    assert worker.expire_idle().result(30) == 0          # 59 s < the 60 s timeout
    srv.clock.t += 2
    worker.expire_idle().result(30)  # (the engine thread's own periodic check may have ended it first)
    assert on_engine(srv, lambda: "idle-one" not in worker.table.by_id)
    assert httpx.post(srv.url + "/v1/workflows/idle-one/end").status_code == 404
    assert 'pbkv_workflows_ended_total{reason="idle"}' in httpx.get(srv.url + "/metrics").text


def test_recorded_traces_are_valid_and_match_the_prompts(srv, client):
    msgs = []
    for step, agent in enumerate(["router", "coder", "router"]):
        msgs.append({"role": "user", "content": f"turn {step}"})
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                           extra_body={"workflow_id": "rec/../../etc", "agent": agent,
                                                       "workflow_done": step == 2, "ignore_eos": True})
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    files = sorted(srv.rec.iterdir())
    assert files and all(f.name.startswith("calls-") and f.suffix == ".jsonl" for f in files)  # no client path
    calls = [c for f in files for c in read_trace(f).calls]
    mine = [c for c in calls if [x.agent for x in calls if x.workflow_id == c.workflow_id] == ["router", "coder", "router"]]
    assert [c.step for c in mine] == [0, 1, 2] and mine[-1].done and mine[0].tool_wait is None
    tok = srv.state.tokenizer
    for c, n in zip(mine, (1, 3, 5)):
        ids = tok.chat(msgs[:n])
        assert c.input_length == len(ids) and c.hash_ids == block_hashes(ids, 16) and c.output_length == 4
    assert mine[1].hash_ids[:len(mine[0].hash_ids) - 1] == mine[0].hash_ids[:-1]  # prefix reuse is visible


def test_online_learning_saves_and_reloads_the_predictor(torch_threads, tmp_path):  # noqa: F811
    from pbkv.predict.history import read_history
    from pbkv.predict.predictor import NeuralPredictor, load_predictor
    model_dir = tmp_path / "predictor"
    srv = start_server(policy="pbkv", predictor_dir=str(model_dir), learn_every=4, learn_steps=40,
                       record=str(tmp_path / "rec"))
    try:
        assert not srv.state.setup.loaded
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for w in range(12):
            agents = ["router", "coder", "router"] if w % 2 else ["router", "writer", "reviewer", "router"]
            for i, agent in enumerate(agents):
                ask(client, f"wf {w} step {i}", workflow_id=f"L{w}", agent=agent, workflow_done=i == len(agents) - 1)
        for w in range(2):   # still open at the stop: cut short, not finished, so not learned
            for i in range(2):
                ask(client, f"cut {w} step {i}", workflow_id=f"X{w}", agent="router")
    finally:
        srv.stop()
    assert srv.state.setup.learner.cut == 2
    recorded = [c for f in sorted((tmp_path / "rec").iterdir()) for c in read_trace(f).calls]
    assert len({c.workflow_id for c in recorded}) == 12 and not any("cut" in (c.context or "") for c in recorded)
    live = live_dir(model_dir)
    assert (live / "config.json").is_file() and (live / "model.safetensors").is_file()
    again = start_server(policy="pbkv", predictor_dir=str(model_dir))
    try:
        setup = again.state.setup
        assert setup.loaded and isinstance(setup.policy.predictor, NeuralPredictor)
        assert {"router", "coder"} <= set(setup.policy.predictor.agents)
    finally:
        again.stop()
    assert [wf[0][0] for wf in read_history(model_dir)] == ["router"] * 12    # saved with it
    short = start_server(policy="pbkv", predictor_dir=str(model_dir), learn_every=4, learn_steps=40)
    try:   # a short session learns on top of the earlier ones: it keeps their agents
        assert len(short.state.setup.learner.window) == 12
        client = openai.OpenAI(base_url=short.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for w in range(5):
            for i in range(2):
                ask(client, f"chat {w} {i}", workflow_id=f"C{w}", agent="chat", workflow_done=i == 1)
    finally:
        short.stop()
    kept = load_predictor(model_dir)
    assert {"router", "coder", "chat"} <= set(kept.agents) and kept.info["workflows"] == 17
    assert len(read_history(model_dir)) == 17


def test_a_workflow_id_with_a_slash_can_be_ended(srv, client):
    ask(client, "step one", workflow_id="team/alpha", agent="a")
    r = httpx.post(srv.url + "/v1/workflows/team%2Falpha/end")    # the client quotes it; routing sees "/"
    assert r.status_code == 200 and r.json()["id"] == "team/alpha", r.text
    assert httpx.post(srv.url + "/v1/workflows/team/alpha/end").status_code == 404   # ended once only


def test_a_retrain_on_fewer_workflows_than_the_loaded_predictor_is_not_used():
    from types import SimpleNamespace

    from pbkv.serve.learning import TrafficLearner
    learner = TrafficLearner(every=1000)
    learner.floor = 60
    learner._ready = SimpleNamespace(info={"workflows": 12})      # a retrain on this session's 12
    assert learner.poll() is None
    learner._ready = SimpleNamespace(info={"workflows": 60})
    assert learner.poll().info["workflows"] == 60


def test_a_utf8_header_names_the_same_workflow_and_agent_as_the_body(srv, client):
    """Headers arrive decoded as Latin-1: "café" in X-Workflow-Id was another workflow than the
    body's "café" and its URL-quoted end answered 404."""
    ask(client, "step one", workflow_id="café", agent="rédacteur")
    wf = wf_of(srv, "café")
    httpx.post(srv.url + "/v1/chat/completions",
               headers={"X-Workflow-Id": "café".encode(), "X-Agent": "rédacteur".encode()},
               json={"model": "tiny", "messages": [{"role": "user", "content": "step two"}], "max_tokens": 2})
    r = httpx.post(srv.url + "/v1/workflows/caf%C3%A9/end")
    assert r.status_code == 200 and r.json()["id"] == "café", r.text
    assert [e for e in events_of(srv, wf) if e[0] == "on_call_start"] == [
        ("on_call_start", (0, "rédacteur")), ("on_call_start", (1, "rédacteur"))]



def test_an_overlong_id_on_the_end_route_gets_the_hint_error_code(srv):
    """As a too-long workflow_id hint does: code "invalid_value" (it was null)."""
    from pbkv.serve import schemas
    r = httpx.post(srv.url + "/v1/workflows/" + "w" * (schemas.MAX_HINT_CHARS + 1) + "/end")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
