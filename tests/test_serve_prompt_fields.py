"""Every field that tells chat messages apart reaches the prompt: an assistant's `tool_calls`, a
tool message's `tool_call_id`, a message's `name`, and the request's `tools` / `functions`.

Before, only role and text were rendered: two chats with different tool calls (or names) were the
same prompt, got the same answer and shared KV. Checked on pbkv's own layout (the `tiny` model,
over real HTTP) and on chat templates that render some fields, none, or refuse them."""

import json

import httpx
import pytest

from serve_helpers import start_server, torch_threads  # noqa: F401

from pbkv.serve.tokenizer import ByteTokenizer, ChatRefused, HFTokenizer, render_chat


def conv(fn="get_weather", args='{"city": "Paris"}', call_id="call_1", answers="call_1", name=None, tag=""):
    user = {"role": "user", "content": f"weather?{tag}"}
    if name is not None:
        user["name"] = name
    return [user,
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call_id, "type": "function", "function": {"name": fn, "arguments": args}}]},
            {"role": "tool", "tool_call_id": answers, "content": "sunny"}]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": CITY}}]

VARIANTS = {   # each differs from the base chat in one field
    "base": (conv(), None),
    "function": (conv(fn="delete_all_files"), None),
    "arguments": (conv(args='{"path": "/"}'), None),
    "call id": (conv(call_id="call_2"), None),
    "tool_call_id": (conv(answers="call_9"), None),
    "name": (conv(name="alice"), None),
    "other name": (conv(name="bob"), None),
    "tools": (conv(), TOOLS),
}


def as_prompt(messages):
    """What `app.chat` hands the tokenizer (`Message.prompt_dict`)."""
    from pbkv.serve.schemas import Message
    return [Message.model_validate(m).prompt_dict() for m in messages]


# ---------------------------------------------------------------- pbkv's own layout (no template)

def test_pbkv_layout_tells_every_field_apart():
    tok = ByteTokenizer(512)
    prompts = {k: tuple(tok.chat(as_prompt(m), tools)) for k, (m, tools) in VARIANTS.items()}
    assert len(set(prompts.values())) == len(VARIANTS)
    text = render_chat(as_prompt(conv(name="alice")), TOOLS)
    assert text.startswith('<|tools|>\n[{"type": "function", "function": {"name": "get_weather"')
    assert '<|user name="alice"|>\nweather?\n' in text
    assert ('<|assistant|>\ntool_calls: [{"id": "call_1", "type": "function", "function": {"name": "get_weather", '
            '"arguments": "{\\"city\\": \\"Paris\\"}"}}]\n') in text
    assert '<|tool tool_call_id="call_1"|>\nsunny\n' in text
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(plain) == "<|user|>\nhi\n<|assistant|>\n"   # a chat without them renders as before


# ---------------------------------------------------------------- chat templates

def hf_tokenizer(template: str) -> HFTokenizer:
    """A real transformers tokenizer (bytes as tokens, built offline) with `template`."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)}, merges=[]))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    tok.chat_template = template
    return HFTokenizer(tok)


ROLES_ONLY = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
RICH = ("{% if tools %}<tools>{{ tools | tojson }}\n{% endif %}{% for m in messages %}<{{ m.role }}"
        "{% if m.name %} {{ m.name }}{% endif %}>{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endif %}\n{% endfor %}"
        "<assistant>")
REFUSES = ("{% for m in messages %}{% if m.tool_calls or m.name %}{{ raise_exception('unsupported') }}{% endif %}"
           "<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")

# Llama-3.1's behaviour: an assistant message with tool_calls is the call's JSON, its text dropped;
# more than one call raises; tool call ids never shown
LLAMA_LIKE = ("{% for m in messages %}<{{ m.role }}>{% if 'tool_calls' in m %}{% if m.tool_calls | length != 1 %}"
              "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
              "{{ m.tool_calls[0].function.name }} {{ m.tool_calls[0].function.arguments | tojson }}"
              "{% else %}{{ m.content }}{% endif %}\n{% endfor %}<assistant>")
# Mistral-Instruct v0.1/v0.2's: strictly alternating user/assistant turns, no system or tool role
MISTRAL_LIKE = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                "{% endif %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% elif m.role == 'assistant' %}"
                "{{ m.content }}</s>{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
                "{% endif %}{% endfor %}")
# writes a message's name / tool_call_id INSTEAD of its text
NAME_DROPS_TEXT = ("{% for m in messages %}<{{ m.role }}>{% if m.name or m.tool_call_id %}{{ m.name }}"
                   "{{ m.tool_call_id }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}<assistant>")
TEMPLATES = {"roles-only": ROLES_ONLY, "rich": RICH, "refuses": REFUSES, "llama-like": LLAMA_LIKE,
             "name-drops-text": NAME_DROPS_TEXT}


@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
def test_a_template_that_drops_or_refuses_a_field_still_gets_it_as_text(template):
    tok = hf_tokenizer(template)
    prompts = {k: tok.render(as_prompt(m), tools) for k, (m, tools) in VARIANTS.items()}
    assert len(set(prompts.values())) == len(VARIANTS), prompts
    for text in prompts.values():
        assert "pbkv_probe" not in text


def test_a_template_that_renders_a_field_gets_it_in_its_own_format():
    text = hf_tokenizer(RICH).render(as_prompt(conv(name="alice")), TOOLS)
    assert text.startswith('<tools>[{"type": "function", "function": {"name": "get_weather"')   # tools=, natively
    assert "<user alice>weather?" in text                          # the template's name
    assert '[get_weather {"city": "Paris"}]' in text               # arguments as a JSON object (transformers)
    assert 'tool_call_ids: ["call_1"]' in text                     # ids: this template drops them, so as text
    assert '<tool>tool_call_id: "call_1"\nsunny' in text
    assert "tool_calls:" not in text and "Tools (function definitions" not in text


def test_a_template_without_those_fields_folds_them_into_the_messages():
    text = hf_tokenizer(ROLES_ONLY).render(as_prompt(conv(name="alice")), TOOLS)
    assert text.startswith(f'<user>Tools (function definitions, JSON): {json.dumps(TOOLS)}\n\n'
                           'name: "alice"\nweather?\n')   # into the first message, before its text
    assert ('<assistant>tool_calls: [{"id": "call_1", "type": "function", "function": {"name": "get_weather", '
            '"arguments": "{\\"city\\": \\"Paris\\"}"}}]\n') in text
    plain = [{"role": "user", "content": "hi"}]
    assert hf_tokenizer(ROLES_ONLY).render(plain) == "<user>hi\n<assistant>"   # unchanged without them


def chat(text="I will read the file", call_id="c1", fn="read", name=None, answer="r"):
    assistant = {"role": "assistant", "content": text,
                 "tool_calls": [{"id": call_id, "type": "function", "function": {"name": fn, "arguments": '{"f": 1}'}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": answer}
    if name is not None:
        tool["name"] = name
    return as_prompt([{"role": "user", "content": "task"}, assistant, tool])


@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
def test_the_text_beside_a_rendered_field_still_reaches_the_prompt(template):
    """A template that writes a tool call (Llama-3.1) or a name instead of the message's text: the
    field counts as rendered only if the text shows too, else it is folded into the text. Before,
    chats differing only in the assistant's text, the call id (folded into that dropped text) or
    a named tool message's text were one prompt."""
    tok = hf_tokenizer(template)
    variants = [chat(), chat(text="Delete everything"), chat(call_id="call_other"), chat(name="read"),
                chat(name="read", answer="other"), chat(name="write")]
    prompts = [tok.render(m) for m in variants]
    assert len(set(prompts)) == len(variants), prompts


def test_a_template_that_drops_the_text_beside_a_call_gets_the_call_as_text():
    text = hf_tokenizer(LLAMA_LIKE).render(chat())
    assert ('<assistant>I will read the file\ntool_calls: [{"id": "c1", "type": "function", "function": '
            '{"name": "read", "arguments": "{\\"f\\": 1}"}}]<tool>') in text


def workflow_calls():
    """A workflow's successive calls: each call's chat is the previous one plus new turns, one with
    2 parallel tool calls (a template may refuse those) and named messages."""
    def call(i, n=1):
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}_{k}", "type": "function", "function": {"name": "read", "arguments": f'{{"f": "{i}_{k}"}}'}}
            for k in range(n)]}

    def res(i, k=0):
        return {"role": "tool", "tool_call_id": f"c{i}_{k}", "content": f"r{i}_{k}"}
    turns = [[{"role": "system", "content": "sys"}, {"role": "user", "content": "task", "name": "alice"},
              call(1), res(1)],
             [call(2, n=2), res(2, 0), res(2, 1)],
             [{"role": "assistant", "content": "done?"}, {"role": "user", "content": "more"}, call(3), res(3)],
             [call(4, n=3), res(4, 0), res(4, 1), res(4, 2)]]
    return [as_prompt(sum(turns[:i], [])) for i in range(1, len(turns) + 1)]


@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["", "tools"])
def test_earlier_turns_render_the_same_in_every_later_call(template, tools):
    """Each call's prompt (less the assistant's turn) begins every later call's prompt, so the
    workflow reuses its KV prefix. Before, a message the template refused (Llama-3.1: 2 parallel
    calls) made the whole chat render as text: call 2 shared 223 of call 1's 409 chars."""
    tok = hf_tokenizer(template)
    prompts = [tok.render(m, tools) for m in workflow_calls()]
    for earlier, later in zip(prompts, prompts[1:]):
        assert later.startswith(earlier.removesuffix("<assistant>")), (earlier, later)


PLAIN_CHATS = [[{"role": "user", "content": "hi"}],
               [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "?"}],
               [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]


@pytest.mark.parametrize("template", [ROLES_ONLY, RICH, LLAMA_LIKE, MISTRAL_LIKE],
                         ids=["roles-only", "rich", "llama-like", "mistral-like"])
def test_a_chat_without_extra_fields_renders_as_before(template):
    """Byte for byte what pbkv rendered before the extra fields reached the prompt (73a4128)."""
    tok = hf_tokenizer(template)
    for messages in PLAIN_CHATS[:2] if template == MISTRAL_LIKE else PLAIN_CHATS:
        before = tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.render(as_prompt(messages)) == before
    for messages in PLAIN_CHATS:
        before = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        assert render_chat(as_prompt(messages)) == before   # pbkv's own layout (the tiny model)


def test_tools_on_a_template_without_a_system_role_go_into_the_first_message():
    """Mistral's template refuses a system message; the tools were put in a new one (a 500)."""
    tok = hf_tokenizer(MISTRAL_LIKE)
    hi = as_prompt([{"role": "user", "content": "hi"}])
    text = tok.render(hi, TOOLS)
    assert text == f"[INST] Tools (function definitions, JSON): {json.dumps(TOOLS)}\n\nhi [/INST]"
    other = [{"type": "function", "function": {"name": "get_weather", "description": "the weather"}}]
    assert len({tok.render(hi), text, tok.render(hi, other), tok.render(hi, TOOLS + other)}) == 4
    system = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert hf_tokenizer(ROLES_ONLY).render(as_prompt(system), TOOLS).startswith(
        "<system>sys\n\nTools (function definitions, JSON): [")   # a system message: after its text


@pytest.mark.parametrize("messages, says", [
    ([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], "Conversation roles must alternate"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}], "Conversation roles must alternate"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "42"}],
     "Only user and assistant roles are supported!"),
])
def test_a_chat_the_template_refuses_is_refused(messages, says):
    with pytest.raises(ChatRefused, match="^the model's chat template refuses this chat: " + says):
        hf_tokenizer(MISTRAL_LIKE).render(as_prompt(messages), TOOLS)


# Mistral-7B-Instruct-v0.3's behaviour: call ids must be 9 alphanumerics (else it raises), a tool
# message must carry its tool_call_id, an assistant message with tool_calls drops its text
NINE = "{% if not {0} is defined or {0}|length != 9 or not {0}.isalnum() %}" \
       "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
MISTRAL_V03_LIKE = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
                    "{% elif m.tool_calls is defined %}[TOOL_CALLS] {% for c in m.tool_calls %}"
                    + NINE.replace("{0}", "c.id") + "{{ c.function | tojson }} {{ c.id }}{% endfor %}</s>"
                    "{% elif m.role == 'assistant' %} {{ m.content }}</s>{% elif m.role == 'tool' %}"
                    + NINE.replace("{0}", "m.tool_call_id") +
                    "[TOOL_RESULTS] {{ m.content }} {{ m.tool_call_id }}[/TOOL_RESULTS]{% endif %}{% endfor %}")
# requires a tool message's tool_call_id but never writes it
REQUIRES_ID = ("{% for m in messages %}{% if m.role == 'tool' and m.tool_call_id is not defined %}"
               "{{ raise_exception('a tool message needs its tool_call_id') }}{% endif %}"
               "<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")


def test_a_template_strict_about_call_ids_renders_real_ones_natively():
    """Mistral v0.3: the probes' ids (`pbkv_probe_5e1callid`) made it raise, so tool_calls and
    tool_call_id counted as not rendered and were folded; the tool message then lacked the
    tool_call_id the template requires: every chat with a tool result was refused (400)."""
    tok = hf_tokenizer(MISTRAL_V03_LIKE)
    base = conv(call_id="abc123XYZ", answers="abc123XYZ")
    text = tok.render(as_prompt(base))
    direct = [dict(m) for m in base]
    direct[1] = dict(direct[1], content="", tool_calls=[dict(direct[1]["tool_calls"][0], function={
        "name": "get_weather", "arguments": {"city": "Paris"}})])
    assert text == tok.tok.apply_chat_template(direct, add_generation_prompt=True, tokenize=False)   # all native
    variants = [base, conv(call_id="abc123XYW", answers="abc123XYZ"), conv(call_id="abc123XYZ", answers="zzz123XYZ"),
                conv(fn="delete_all", call_id="abc123XYZ", answers="abc123XYZ"),
                conv(args='{"city": "Rome"}', call_id="abc123XYZ", answers="abc123XYZ")]
    said = [dict(m) for m in base]
    said[1] = dict(said[1], content="I will look it up")   # the template drops it: the call goes as text
    prompts = [tok.render(as_prompt(m)) for m in variants + [said]]
    assert len(set(prompts)) == len(prompts), prompts
    assert "I will look it up" in prompts[-1]


def test_a_field_the_template_requires_is_kept_natively_beside_its_text():
    """A template that requires a tool message's tool_call_id but does not write it: folded (as
    text only) the template raised, and the chat was refused. Now it is given both ways."""
    tok = hf_tokenizer(REQUIRES_ID)
    prompts = [tok.render(as_prompt(conv(answers=a))) for a in ("call_1", "call_9")]
    assert prompts[0] != prompts[1] and 'tool_call_id: "call_9"' in prompts[1]
    calls = [tok.render(m) for m in workflow_calls()]
    for earlier, later in zip(calls, calls[1:]):
        assert later.startswith(earlier.removesuffix("<assistant>"))


def dict_template_tokenizer() -> HFTokenizer:
    tok = hf_tokenizer(ROLES_ONLY)
    tok.tok.chat_template = {"default": ROLES_ONLY, "tool_use": RICH}   # as a folder with additional_chat_templates/
    return tok


def test_a_tokenizer_with_several_templates_renders_with_the_one_transformers_picks():
    """`tokenizer.chat_template` a dict (Hermes-2-Pro, Command-R): the probe cache's key
    (template, feature) was unhashable: any chat with tools or a name was a TypeError (500). The
    template is now the one apply_chat_template picks (`tool_use` with tools, else `default`),
    probed and rendered as that one."""
    tok = dict_template_tokenizer()
    named = as_prompt([{"role": "user", "content": "hi", "name": "alice"}])
    assert tok.render(named) == '<user>name: "alice"\nhi\n<assistant>'            # default: name folded
    assert tok.render(named, TOOLS) == f"<tools>{json.dumps(TOOLS)}\n<user alice>hi<assistant>"   # tool_use
    for messages in PLAIN_CHATS:
        for tools in (None, TOOLS):
            assert tok.render(as_prompt(messages), tools) == tok.tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False)
    prompts = {k: tok.render(as_prompt(m), tools) for k, (m, tools) in VARIANTS.items()}
    assert len(set(prompts.values())) == len(VARIANTS)


UNDEFINED_BOS = "{{ bos_token + '' }}" + ROLES_ONLY   # a tokenizer without a BOS token (Llama-2's templates)


@pytest.mark.parametrize("messages", [[{"role": "user", "content": "hi"}], conv()], ids=["plain", "fields"])
def test_a_template_broken_on_the_server_side_is_not_the_clients_fault(messages):
    """Was ChatRefused (400 chat_template_refused) for every chat: only the template's own
    `raise_exception` (a bare jinja2 TemplateError) refuses a chat; an undefined variable is a
    server error."""
    from jinja2 import UndefinedError
    with pytest.raises(UndefinedError):
        hf_tokenizer(UNDEFINED_BOS).render(as_prompt(messages))


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def srv(torch_threads):  # noqa: F811
    server = start_server()
    yield server
    server.stop()


def ask(srv, messages, tools=None, **extra):
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.mark.parametrize("variant", [k for k in VARIANTS if k != "base"])
def test_chats_that_differ_in_one_field_are_different_prompts(srv, variant):
    """The base chat is served first; the variant is not a whole-prompt cache hit on it (it was,
    prompt - 1 tokens: only the last token recomputed, the same answer)."""
    tag = f" ({variant})"   # this test's own chats: no hit on another test's
    base = [dict(m) for m in VARIANTS["base"][0]]
    base[0]["content"] += tag
    ask(srv, base)
    messages, tools = VARIANTS[variant]
    messages = [dict(m) for m in messages]
    messages[0]["content"] += tag
    usage = ask(srv, messages, tools)
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - 1, usage
    again = ask(srv, messages, tools)   # the same chat again is the same prompt
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1


def test_legacy_functions_and_function_call_messages_reach_the_prompt(srv):
    msgs = [{"role": "user", "content": "legacy?"},
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "function", "name": "f", "content": "42"}]
    plain = [{"role": "user", "content": "legacy?"}, {"role": "assistant", "content": None},
             {"role": "function", "content": "42"}]
    with_fns = ask(srv, msgs, functions=[{"name": "f", "parameters": {"type": "object"}}], function_call="auto")
    assert with_fns["prompt_tokens"] > ask(srv, msgs)["prompt_tokens"] > ask(srv, plain)["prompt_tokens"]


@pytest.mark.parametrize("message, says", [
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
                                                       "function": {"name": "f", "arguments": "{}"}}]},
     "only an assistant message may carry tool_calls"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
     "Field required"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                         "arguments": {}}}]},
     "Input should be a valid string"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "web", "function": {"name": "f", "arguments": ""}}]},
     "Input should be 'function'"),
])
def test_malformed_tool_calls_are_400s(srv, message, says):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "q"}, message], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.1.tool_calls"), r.text
    assert says in r.json()["error"]["message"]


@pytest.fixture
def mistral(srv, monkeypatch):
    """`srv` rendering prompts with a Mistral-like template (alternating user/assistant only)."""
    monkeypatch.setattr(srv.state, "tokenizer", hf_tokenizer(MISTRAL_LIKE))
    return srv


def post(srv, **body):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True} | body)


def test_tools_on_a_template_without_a_system_role_are_answered(mistral):
    """Was a 500 (TemplateError): the tools went into a new system message the template refuses."""
    hi = [{"role": "user", "content": "hi"}]
    plain = post(mistral, messages=hi)
    with_tools = post(mistral, messages=hi, tools=TOOLS)
    with_functions = post(mistral, messages=hi, functions=[TOOLS[0]["function"]])
    assert plain.status_code == with_tools.status_code == with_functions.status_code == 200, with_tools.text
    tokens = plain.json()["usage"]["prompt_tokens"]
    assert with_tools.json()["usage"]["prompt_tokens"] == with_functions.json()["usage"]["prompt_tokens"] > tokens


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["", "tools"])
def test_a_chat_the_template_refuses_is_a_400_naming_why(mistral, tools):
    """Was a 500 (with or without extra fields): the chat does not fit the model's template."""
    r = post(mistral, messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
             **({"tools": tools} if tools else {}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert error["message"] == ("the model's chat template refuses this chat: "
                                "Conversation roles must alternate user/assistant/user/assistant/...")


def test_a_wrong_model_is_a_404_before_the_chat_is_rendered(mistral):
    r = post(mistral, model="gpt-4", messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_a_template_broken_on_the_server_side_is_a_500_logged_once(srv, monkeypatch):
    """Was a 400 chat_template_refused. And an unexpected error was logged twice: by the app's
    handler and by uvicorn ("Exception in ASGI application", Starlette re-raises it)."""
    import logging
    monkeypatch.setattr(srv.state, "tokenizer", hf_tokenizer(UNDEFINED_BOS))
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    # "pbkv" too: a server run earlier in the session may have set it not to propagate (server.py)
    loggers = [logging.getLogger(), logging.getLogger("pbkv"), logging.getLogger("uvicorn.error"),
               logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        r = post(srv, messages=[{"role": "user", "content": "hi"}])
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "internal_error" and "UndefinedError" in r.json()["error"]["message"]
    tracebacks = {id(rec): rec for rec in records if rec.exc_info and "bos_token" in str(rec.exc_info[1])}
    assert len(tracebacks) == 1, [rec.getMessage() for rec in records]
