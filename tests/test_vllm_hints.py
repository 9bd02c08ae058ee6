"""The connector's workflow hints (`pbkv.integrations.vllm.hints`), without vLLM: never an error,
and read as the Ray Serve router reads them, so a call keeps its workflow on either path."""

import pytest

from pbkv.integrations.vllm.hints import DEFAULT_AGENT, MAX_HINT_CHARS, Hints, hint_label, parse_hints
from pbkv.scale import llm_hints
from pbkv.serve import schemas

LONG = "w" * (MAX_HINT_CHARS + 1)
LABELS = [True, False, 0, 7, -1, "t1", "  t1 ", "   ", "", "w" * MAX_HINT_CHARS, LONG, "  " + "w" * MAX_HINT_CHARS,
          10 ** (MAX_HINT_CHARS - 1), 10 ** MAX_HINT_CHARS, -10 ** (MAX_HINT_CHARS - 2), -10 ** (MAX_HINT_CHARS - 1),
          1.5, None, ["a"], {"a": 1}, b"t1"]


def short(value) -> str:
    """A test id: pytest's own would print a 5000-digit int (which raises) or a megabyte string."""
    return f"{type(value).__name__}-{len(value) if isinstance(value, str) else ''}"


def test_the_length_bound_is_the_servers_and_the_routers():
    assert MAX_HINT_CHARS == schemas.MAX_HINT_CHARS == llm_hints.MAX_HINT_CHARS


@pytest.mark.parametrize("value", LABELS, ids=short)
def test_labels_are_read_as_the_router_reads_them(value):
    assert hint_label(value) == llm_hints._label(value)


@pytest.mark.parametrize("wf", [True, False, "   ", "", LONG, 10 ** 5000, -10 ** 5000, 1.5, ["a"]], ids=short)
def test_a_malformed_workflow_id_is_no_hint(wf):
    h = parse_hints({"workflow_id": wf, "agent": "planner"})
    assert (h.workflow_id, h.hinted, h.done, h.agent) == (None, False, True, "planner")


def test_ids_are_trimmed_and_kept_whole_up_to_the_bound():
    assert parse_hints({"workflow_id": "  t1\n"}).workflow_id == "t1"
    assert parse_hints({"workflow_id": 7}).workflow_id == "7"
    exact = "w" * MAX_HINT_CHARS
    assert parse_hints({"workflow_id": exact, "agent": exact}) == Hints(exact, exact, False)


@pytest.mark.parametrize("agent", [LONG, "a" * 10**6, True, "  ", 1.5, None], ids=short)
def test_a_malformed_agent_is_the_default_agent_never_a_truncated_one(agent):
    assert parse_hints({"workflow_id": "w", "agent": agent}).agent == DEFAULT_AGENT


def test_workflow_done_counts_only_as_a_boolean():
    assert parse_hints({"workflow_id": "w", "workflow_done": True}).done
    for done in ("true", 1, None):
        assert not parse_hints({"workflow_id": "w", "workflow_done": done}).done
        assert parse_hints({"workflow_done": done}).done        # no id: the call is its own workflow


@pytest.mark.parametrize("params", [None, "abc", 5, ["workflow_id"], {}])
def test_anything_but_an_object_is_an_unhinted_call(params):
    h = parse_hints(params)
    assert (h.workflow_id, h.agent, h.done) == (None, DEFAULT_AGENT, True)


@pytest.mark.parametrize("params", [{"workflow_done": False}, {"workflow_id": LONG, "workflow_done": False},
                                    {"workflow_id": "   ", "workflow_done": False},
                                    {"workflow_id": True, "workflow_done": False}],
                         ids=["no id", "long id", "blank id", "boolean id"])
def test_workflow_done_false_without_a_usable_id_still_ends_the_call(params):
    # a one-call workflow nothing else could ever end: its state would grow per request
    assert parse_hints(params) == Hints(None, DEFAULT_AGENT, True)
