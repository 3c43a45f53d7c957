"""Tool calls on /v1/chat/completions (decode/tool_calls.py, server/request_plan.py), through
the openai client: a forced call ("required", a named function) always comes back as calls
whose arguments fit the tool's schema, streamed or not; "auto" reads the calls a model wrote
in its template's format (forced here by a regex, since a random model writes none); the
conversation's calls and tool answers reach the template; bad tool fields are 400s naming them."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

pytest.importorskip("llguidance")

# A Hermes-style template: renders the tools, the calls of earlier turns and the tools' answers.
HERMES = """\
{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>
{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>
{% elif m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>
{% endfor %}{%- else %}{{ m.role }}: {{ m.content }}
{% endif %}{%- endfor %}{%- if add_generation_prompt %}assistant:{% endif %}"""
# A Llama 3-style one: tools rendered, calls written as bare JSON with "parameters".
LLAMA = """\
{%- if tools %}Answer with {"name": ..., "parameters": ...} to call one of:{% for t in tools %} \
{{ t.function.name }}{% endfor %}
{% endif %}{%- for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}{%- if add_generation_prompt %}assistant:{% endif %}"""

# A template that renders tools and writes calls in a format decodekit does not read (Mistral's).
MISTRAL = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
{%- for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}{%- if add_generation_prompt %}[TOOL_CALLS] or text:{% endif %}"""

# Reasoning models' templates: Qwen3's (the model opens <think>; enable_thinking false closes an
# empty one in the prompt) and DeepSeek-R1's (the prompt opens it).
QWEN3 = """\
{%- for m in messages %}{{ m.role }}: {{ (m.content or '').split('</think>')[-1] }}
{% endfor %}{%- if add_generation_prompt %}assistant:{%- if enable_thinking is defined and \
enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"""
R1 = """\
{%- for m in messages %}{{ m.role }}: {{ (m.content or '').split('</think>')[-1] }}
{% endfor %}{%- if add_generation_prompt %}assistant:<think>\n{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Rome?"}]
WRITTEN = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_server(server_model_dir, tmp_path_factory):
    """Names of the tiny model (2,048 positions of context), one a template: Hermes, Llama
    3-style, Mistral-style, two reasoning models' and none (the plain template)."""
    from decodekit.models.registry import load_model
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    path = tmp_path_factory.mktemp("tiny-tools") / "tiny"
    shutil.copytree(server_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    templates = {"hermes": HERMES, "llama": LLAMA, "mistral": MISTRAL, "qwen3": QWEN3, "r1": R1}
    models = {name: load_model(path) for name in (*templates, "plain")}
    backend = Backend(models, ServerConfig(max_tokens=300), chat_templates=templates)
    with ServerThread(backend) as thread:
        yield thread, backend


@pytest.fixture(scope="module")
def tool_client(tool_server):
    import openai

    return openai.OpenAI(base_url=tool_server[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def literal(text: str) -> str:
    """A regex (Rust syntax) that matches `text` alone."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "{}[].\\" else c for c in text)


def streamed(client, thinking: bool = False, **request) -> tuple:
    """(content, calls, finish reason) of a streamed chat, its deltas added up as clients do;
    with `thinking`, its reasoning_content first."""
    content, calls, reason, reasoning = "", {}, None, ""
    for chunk in client.chat.completions.create(stream=True, **request):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        for delta in choice.delta.tool_calls or []:
            made = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            made["name"] += delta.function.name or ""
            made["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    answer = (content, [calls[i] for i in sorted(calls)], reason)
    return (reasoning, *answer) if thinking else answer


@pytest.mark.parametrize("model", ["hermes", "llama", "plain"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_comes_back_as_calls_that_fit_the_schema(tool_client, model, choice):
    names = set()
    for seed in range(3):
        request = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed,
                       max_tokens=200, parallel_tool_calls=False)
        answer = tool_client.chat.completions.create(**request)
        [out] = answer.choices
        assert out.finish_reason == "tool_calls" and out.message.content is None
        [made] = out.message.tool_calls
        jsonschema.validate(json.loads(made.function.arguments), SCHEMAS[made.function.name])
        names.add(made.function.name)
        content, calls, reason = streamed(tool_client, **request)
        assert (content, reason) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls] == [(made.function.name, made.function.arguments)]
        assert calls[0]["id"].startswith("call_")
    if choice != "required":
        assert names == {"get_time"}


def test_a_forced_calls_arguments_stream_piece_by_piece(tool_client):
    """Under the grammar a call's name goes out with its first piece and its arguments' text
    follows in the next chunks (as vLLM streams them), adding up to the non-streamed call."""
    request = dict(model="hermes", messages=ASK, tools=TOOLS, tool_choice="required", seed=1, max_tokens=200,
                   parallel_tool_calls=False)  # fmt: skip
    pieces = [call for chunk in tool_client.chat.completions.create(stream=True, **request)
              for call in chunk.choices[0].delta.tool_calls or []]  # fmt: skip
    [made] = tool_client.chat.completions.create(**request).choices[0].message.tool_calls
    assert pieces[0].id and pieces[0].function.name == made.function.name and len(pieces) > 3
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == made.function.arguments


def test_a_forced_answer_cut_off_by_max_tokens_keeps_its_finished_calls(tool_client):
    """The random model calls again ("required", parallel calls) until max_tokens cuts it inside
    a call: the call finished before stands, with finish_reason "length", streamed or not."""
    for seed in range(8):  # an answer max_tokens cuts inside its second call (~73 tokens a call here)
        request = dict(model="hermes", messages=ASK, tools=[TIME], tool_choice="required", seed=seed,
                       max_tokens=90)  # fmt: skip
        [out] = tool_client.chat.completions.create(**request).choices
        if out.finish_reason == "length":
            break
    assert out.finish_reason == "length" and len(out.message.tool_calls) == 1 and out.message.content is None
    assert all(json.loads(c.function.arguments)["zone"] in ("UTC", "CET") for c in out.message.tool_calls)
    content, calls, reason = streamed(tool_client, **request)
    assert reason == "length" and content == ""
    finished = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls][: len(finished)] == finished  # then the one cut off


def test_auto_reads_the_calls_a_model_writes(tool_client):
    """A regex makes the tiny model write text then a call, as a tool-using model would."""
    pattern = literal("Checking. " + WRITTEN)
    request = dict(model="hermes", messages=ASK, tools=TOOLS, max_tokens=200, seed=0,
                   extra_body={"guided_regex": pattern})
    [out] = tool_client.chat.completions.create(**request).choices
    assert (out.finish_reason, out.message.content) == ("tool_calls", "Checking.")
    [made] = out.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("get_time", {"zone": "UTC"})
    content, calls, reason = streamed(tool_client, **request)
    assert (content.strip(), reason) == ("Checking.", "tool_calls") and "<" not in content
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", made.function.arguments)]
    # tool_choice "none": the same text is the answer
    [out] = tool_client.chat.completions.create(**request, tool_choice="none").choices
    assert (out.message.content, out.message.tool_calls) == ("Checking. " + WRITTEN, None)
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_an_answer_without_a_call_is_plain_text(tool_client, choice):
    """(Under "auto" the grammar of text or calls holds the random model to whole characters,
    so its text differs from "none"'s.)"""
    request = dict(model="hermes", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=12, seed=3)
    [out] = tool_client.chat.completions.create(**request).choices
    assert out.message.tool_calls is None and out.finish_reason in ("stop", "length") and out.message.content
    content, calls, _ = streamed(tool_client, **request)
    assert (content, calls) == (out.message.content, [])


def test_the_openai_clients_parse_helper_reads_the_arguments(tool_client):
    """openai's own pydantic tool helper (a strict schema) validates what the server returns."""
    import openai
    import pydantic

    class GetTime(pydantic.BaseModel):
        zone: str = pydantic.Field(pattern="^(UTC|CET)$")

    answer = tool_client.chat.completions.parse(
        model="hermes", messages=ASK, seed=1, max_tokens=200, tools=[openai.pydantic_function_tool(GetTime)],
        tool_choice="required", parallel_tool_calls=False)
    [made] = answer.choices[0].message.tool_calls
    assert made.function.name == "GetTime" and isinstance(made.function.parsed_arguments, GetTime)


def conversation(call_id: str = "call_1", arguments: str = '{"zone": "UTC"}') -> list[dict]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "12:00"}]  # fmt: skip


def test_earlier_calls_and_tool_answers_reach_the_prompt(tool_server):
    from decodekit.server.protocol import ChatMessage, ChatRequest
    from decodekit.server.request_plan import chat_text, tool_use_of

    _, backend = tool_server
    messages = [ChatMessage.model_validate(m) for m in conversation()]
    request = ChatRequest.model_validate({"model": "hermes", "messages": conversation(), "tools": TOOLS})
    hermes = tool_use_of(request, HERMES)
    text, _ = chat_text(backend.models["hermes"], messages, HERMES, hermes)
    assert text == ("<tools>get_weather get_time </tools>\nuser: Weather in Rome?\n" + WRITTEN +
                    "\n<tool_response>12:00</tool_response>\nassistant:")  # fmt: skip
    plain = tool_use_of(request, None)
    text, templated = chat_text(backend.models["plain"], messages, None, plain)
    assert not templated and text.startswith("SYSTEM: You can call functions")
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == TOOLS and "ASSISTANT: " + WRITTEN in text
    assert "USER: <tool_response>\n12:00\n</tool_response>\nASSISTANT:" in text
    # the client's next turn runs, the answer to the tool read for calls again
    answer = httpx.post(tool_server[0].url + "/v1/chat/completions", json={
        "model": "hermes", "messages": conversation(), "tools": TOOLS, "max_tokens": 4, "seed": 0})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"


BAD = [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "'get_news', which is not among the tools"),
    ({"tools": [TIME, TIME]}, "tools", "'get_time' more than once"),
    ({"tools": [{"type": "function", "function": {"name": "get time"}}]}, "tools", "a tool's name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools", "not a JSON schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": TOOLS, "messages": conversation(arguments="{zone")}, "messages", "are not JSON"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_tool_fields_are_400s_naming_them(tool_server, fields, param, message):
    body = {"model": "hermes", "messages": ASK, "max_tokens": 4, **fields}
    answer = httpx.post(tool_server[0].url + "/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_call_format_decodekit_does_not_read_leaves_the_answer_text(tool_client, tool_server):
    request = dict(model="mistral", messages=ASK, tools=TOOLS, max_tokens=200, seed=0,
                   extra_body={"guided_regex": literal("[TOOL_CALLS]" + WRITTEN)})
    [out] = tool_client.chat.completions.create(**request).choices
    assert out.message.tool_calls is None and out.message.content == "[TOOL_CALLS]" + WRITTEN
    body = {"model": "mistral", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 4}
    answer = httpx.post(tool_server[0].url + "/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"
    assert "format decodekit reads" in answer.json()["error"]["message"]


def test_auto_constrains_calls_unless_the_request_constrains_the_answer(tool_server):
    from decodekit.decode.constrained import Grammar, Regex
    from decodekit.server.protocol import ChatRequest
    from decodekit.server.request_plan import plan_request

    backend = tool_server[1]

    def constraint(**fields):
        body = {"model": "hermes", "messages": ASK, "tools": TOOLS, "max_tokens": 4, **fields}
        return plan_request(ChatRequest.model_validate(body), backend).constraint

    assert isinstance(constraint(), Grammar) and "TEXT | PRE" in constraint().lark
    assert isinstance(constraint(guided_regex="a+"), Regex)  # the request's own, calls parsed only
    assert constraint(tool_choice="none") is None and constraint(draft_model="prompt-lookup") is None
    assert constraint(ignore_eos=True) is None
    assert "TEXT" not in constraint(tool_choice="required").lark


@pytest.mark.parametrize(("model", "written"), [("qwen3", "<think>\nadd them\n</think>\n\nIt is 4."),
                                                ("r1", "add them\n</think>\n\nIt is 4.")])
def test_a_reasoning_models_thinking_comes_apart_from_its_answer(tool_client, model, written):
    request = dict(model=model, messages=ASK, max_tokens=200, seed=0,
                   extra_body={"guided_regex": literal(written)})
    [out] = tool_client.chat.completions.create(**request).choices
    reasoning = out.message.model_extra["reasoning_content"]
    assert (reasoning, out.message.content) == ("\nadd them\n"[model == "r1":], "It is 4.")
    assert streamed(tool_client, thinking=True, **request) == (reasoning, "It is 4.", [], "stop")
    # with tools: the calls are read from the answer after the thinking
    call = written.split("</think>")[0] + "</think>\n\n" + WRITTEN
    request = {**request, "tools": TOOLS, "extra_body": {"guided_regex": literal(call)}}
    [out] = tool_client.chat.completions.create(**request).choices
    assert out.message.content is None and out.message.model_extra["reasoning_content"].strip() == "add them"
    assert [(c.function.name, c.function.arguments) for c in out.message.tool_calls] == \
        [("get_time", '{"zone": "UTC"}')]
    reasoning, content, calls, reason = streamed(tool_client, thinking=True, **request)
    assert (reasoning.strip(), content, reason) == ("add them", "", "tool_calls") and len(calls) == 1


def test_chat_template_kwargs_reach_the_template(tool_server):
    from decodekit.server.protocol import ChatRequest
    from decodekit.server.request_plan import plan_request

    backend = tool_server[1]

    def plan(**fields):
        body = {"model": "qwen3", "messages": ASK, "max_tokens": 4, **fields}
        return plan_request(ChatRequest.model_validate(body), backend)

    thinking, quiet = plan(), plan(chat_template_kwargs={"enable_thinking": False})
    assert thinking.prompt_texts[0].endswith("assistant:") and thinking.thinking.opened is False
    assert quiet.prompt_texts[0].endswith("assistant:<think>\n\n</think>\n\n") and not quiet.thinking.opened
    assert plan_request(ChatRequest.model_validate({"model": "r1", "messages": ASK, "max_tokens": 4}),
                        backend).thinking.opened  # fmt: skip
    assert plan_request(ChatRequest.model_validate({"model": "hermes", "messages": ASK, "max_tokens": 4}),
                        backend).thinking is None  # fmt: skip
    answer = httpx.post(tool_server[0].url + "/v1/chat/completions", json={
        "model": "qwen3", "messages": ASK, "chat_template_kwargs": {"tools": []}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template_kwargs"
