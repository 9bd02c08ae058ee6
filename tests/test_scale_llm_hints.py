"""Hints from Ray Serve LLM's request objects, and what a replica reports (no Ray, no vLLM).

The fakes are shaped like Ray Serve LLM 2.60's: the ingress calls the model deployment as
`chat(body, raw_request_info)`, `body` a pydantic model that keeps unknown fields as extras
(vLLM's `OpenAIBaseModel` has `extra="allow"`), `raw_request_info` a dataclass with `headers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from pbkv.route import ReplicaSnapshot, RouteRequest, make_router
from pbkv.scale.adapter import Overlay, hinted_call
from pbkv.scale.llm_hints import (LLMCall, TextChunks, connector_params, find_llm_call, hints_of, llm_call,
                                  prompt_text, render_messages)
from pbkv.scale.llm_record import ReplicaRecord


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = "m"
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    stream: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = "m"
    prompt: Any
    max_tokens: Optional[int] = 16
    kv_transfer_params: Optional[dict[str, Any]] = None


@dataclass
class RawRequestInfo:
    headers: dict[str, str] = field(default_factory=dict)


SYSTEM = {"role": "system", "content": "You are a careful planner. " * 8}


def chat(user: str, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[SYSTEM, {"role": "user", "content": user}], **extra)


def test_hints_come_from_kv_transfer_params_then_body_fields_then_headers():
    info = RawRequestInfo({"X-Workflow-Id": "hdr-wf", "X-Agent": "hdr-agent"})
    assert hints_of(chat("q"), info) == ("hdr-wf", "hdr-agent", False)
    body = chat("q", workflow_id="body-wf", workflow_done=True)          # pbkv serve's extra_body fields
    assert hints_of(body, info) == ("body-wf", "hdr-agent", True)
    body = chat("q", workflow_id="body-wf", kv_transfer_params={"workflow_id": "kv-wf", "agent": "coder"})
    assert hints_of(body, info) == ("kv-wf", "coder", False)
    assert hints_of(chat("q"), None) == (None, "default", True)           # no hints: a workflow of its own
    assert hints_of(chat("q", workflow_id=17)) == ("17", "default", False)


def test_malformed_hints_are_ignored_not_fatal():
    bad = chat("q", kv_transfer_params={"workflow_id": "", "agent": ["x"], "workflow_done": "yes"},
               workflow_id="x" * 300)
    assert hints_of(bad, RawRequestInfo({"x-workflow-id": "  "})) == (None, "default", True)
    assert hints_of(chat("q", workflow_id=True)) == (None, "default", True)
    assert hints_of({"messages": [], "kv_transfer_params": "not a dict", "agent": 3}) == (None, "3", True)


def test_a_chat_call_becomes_a_route_request_with_chained_text_hashes():
    chunks = TextChunks(chunk_chars=64, chars_per_token=4)
    body = chat("find the bug", kv_transfer_params={"workflow_id": "w1", "agent": "planner"}, max_tokens=32)
    call = llm_call(body, None, chunks)
    text = render_messages(body.messages)
    assert text.startswith("<|system|>\nYou are a careful planner.") and text.endswith("<|user|>\nfind the bug\n")
    assert call == LLMCall(RouteRequest("w1", "planner", chunks.hash_ids(text), -(-len(text) // 4), 32), False)
    assert len(call.route.hash_ids) == len(text) // 64
    # the next step of the workflow extends the chat: its ids start with the first call's
    longer = ChatCompletionRequest(messages=body.messages + [{"role": "assistant", "content": "ok"},
                                                             {"role": "user", "content": "now fix it"}],
                                   kv_transfer_params={"workflow_id": "w1"})
    ids = llm_call(longer, None, chunks).route.hash_ids
    assert ids[:len(call.route.hash_ids)] == call.route.hash_ids and len(ids) > len(call.route.hash_ids)
    assert llm_call(chat("no workflow"), None, chunks) is None


def test_completions_and_message_shapes_render_deterministically():
    assert prompt_text(CompletionRequest(prompt="abc")) == "abc"
    assert prompt_text(CompletionRequest(prompt=[1, 2, 3])) == "[1, 2, 3]"
    assert prompt_text(CompletionRequest(prompt=["a", "b"])) == "a\x1eb"
    assert prompt_text({"model": "m"}) is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image_url", "image_url": {"url": "u"}}]},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]
    assert render_messages(parts) == ('<|user|>\nhi {"image_url": {"url": "u"}, "type": "image_url"}\n'
                                      '<|assistant|>\n[{"function": {"name": "f"}, "id": "1"}]\n')
    body = CompletionRequest(prompt="p" * 200, workflow_id="w", max_tokens=None)
    assert llm_call(body).route.output_tokens == 0


def test_find_llm_call_reads_a_handle_calls_arguments():
    body = chat("q")
    assert find_llm_call([body, RawRequestInfo({"x-workflow-id": "w"})]).route.workflow_id == "w"
    assert find_llm_call([], {"request": body, "raw_request_info": RawRequestInfo({"x-workflow-id": "k"})}
                         ).route.workflow_id == "k"
    assert find_llm_call(["plain", 3]) is None
    # the dict form of pbkv hints still wins, and never ends its workflow
    got = hinted_call([{"workflow_id": "d", "hash_ids": [1, 2]}])
    assert got == LLMCall(RouteRequest("d", "", (1, 2), 32), False)
    assert hinted_call([chat("q", workflow_id="w", workflow_done=True)]).done is True


def test_connector_params_carry_hints_that_came_as_fields_or_headers():
    body = chat("q", kv_transfer_params={"other": 1})
    call = llm_call(body, RawRequestInfo({"x-workflow-id": "w", "x-agent": "a"}))
    assert connector_params(body, call) == {"other": 1, "workflow_id": "w", "agent": "a", "workflow_done": False}


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=400), st.text(max_size=200), st.integers(1, 40), st.integers(1, 8))
def test_text_chunks_prefix_property(a, b, chunk_chars, per_token):
    chunks = TextChunks(max(chunk_chars, per_token), per_token)
    ida, idab = chunks.hash_ids(a), chunks.hash_ids(a + b)
    assert idab[:len(ida)] == ida and len(ida) == len(a) // chunks.chunk_chars
    assert all(0 <= h < 2 ** 63 for h in idab)


def test_text_chunks_reject_bad_sizes():
    with pytest.raises(ValueError, match="chunk_chars >= chars_per_token >= 1"):
        TextChunks(2, 4)


def test_replica_record_is_bounded_and_reports_what_it_served():
    chunks = TextChunks(16, 4)
    rec = ReplicaRecord("r0", chunks, max_blocks=5, max_workflows=2)
    calls = [LLMCall(RouteRequest(f"w{i}", "a", (10 * i + 1, 10 * i + 2, 10 * i + 3), 12, 4), done=(i == 1))
             for i in range(3)]
    for c in calls:
        rec.started(c)
    rec.started(None)
    s = rec.stats()
    assert (s["load"], s["block_size"], s["seq"]) == (4.0, 4, 1)
    assert s["blocks"] == [12, 13, 21, 22, 23]                           # the 5 most recent
    assert s["workflows"] == {"w1": 16, "w2": 16}                       # w0 dropped: max_workflows
    for c in calls:
        rec.finished(c)
    rec.finished(None)
    rec.finished(None)                                                   # never below zero
    s = rec.stats()
    assert (s["load"], s["seq"], s["served"], s["workflows"]) == (0.0, 2, 5, {"w2": 16})   # w1 ended
    snap = ReplicaSnapshot.from_stats(s, "r0")
    assert snap.cached_prefix_tokens((21, 22, 23, 99)) == 12 and snap.cached_prefix_tokens((1, 2)) == 0
    with pytest.raises(ValueError):
        ReplicaRecord("r", max_blocks=0)


def test_router_and_replica_reports_agree_on_a_workflow():
    """A workflow's calls, routed through the overlay and then through the replicas' reports,
    stay on the replica where the first call ran; a second workflow (its own system prompt)
    goes to the other one, which holds fewer workflows."""
    chunks = TextChunks()
    records = {r: ReplicaRecord(r, chunks) for r in ("r0", "r1")}
    overlay, router = Overlay(), make_router("pbkv", None)
    placed: dict[str, set[str]] = {}
    for step in range(4):
        for wf in ("a", "b"):
            msgs = [{"role": "system", "content": f"{wf} rules. " * 20}]
            msgs += [{"role": "user", "content": f"{wf} step {i} " * 6} for i in range(step + 1)]
            call = llm_call(ChatCompletionRequest(messages=msgs, workflow_id=wf), None, chunks)
            views = [overlay.view(r, records[r].stats() if step >= 2 else {}, 0) for r in ("r0", "r1")]
            rid = router.choose(call.route, views).replica
            overlay.routed(rid, call.route)
            records[rid].started(call)
            records[rid].finished(call)
            placed.setdefault(wf, set()).add(rid)
    assert placed == {"a": {"r0"}, "b": {"r1"}}
