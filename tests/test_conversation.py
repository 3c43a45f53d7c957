"""dk.chat (decodekit/conversation.py): a conversation's next assistant message on the shipped
model, the same completion as generating from its templated prompt; forced tool calls that fit
their schemas; a reasoning model's thinking read apart; earlier calls and tool answers in the
prompt; bad inputs as ChatErrors naming their field."""

from __future__ import annotations

import dataclasses
import json

import pytest

import decodekit as dk
from decodekit.conversation import ChatError, chat_prompt, reply_of, tool_use
from decodekit.decode.reasoning import Thinking
from decodekit.decode.tool_calls import Tool

CLOCK = Tool("get_time", "The time in a zone", {
    "type": "object", "required": ["zone"], "additionalProperties": False,
    "properties": {"zone": {"enum": ["UTC", "CET"]}}})  # fmt: skip
ASK = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def model():
    return dk.load_model("shakespeare")


def test_a_chat_is_the_completion_of_its_templated_prompt(model):
    params = dk.SamplingParams(max_new_tokens=20, seed=3, n=2)
    replies = dk.chat(model, ASK, params)
    text, templated = chat_prompt(model, ASK)
    assert not templated and text == "USER: What time is it?\nASSISTANT:"  # the plain template
    assert [r.content for r in replies] == [c.text for c in dk.generate(model, text, params)]
    assert all(r.tool_calls == [] and r.reasoning is None and r.finish_reason in ("stop", "length")
               for r in replies)  # fmt: skip


@pytest.mark.parametrize("choice", ["required", "get_time",
                                    {"type": "function", "function": {"name": "get_time"}}])  # fmt: skip
def test_a_forced_call_fits_its_schema(model, choice):
    pytest.importorskip("llguidance")
    import jsonschema

    openai_tool = {"type": "function", "function": {"name": "noop"}}  # OpenAI's form beside a Tool
    for seed in range(3):
        [reply] = dk.chat(model, ASK, dk.SamplingParams(max_new_tokens=120, seed=seed),
                          tools=[CLOCK, openai_tool], tool_choice=choice, parallel_tool_calls=False)
        assert reply.finish_reason == "tool_calls" and reply.content is None, reply
        [call] = reply.tool_calls
        if choice != "required":
            assert call.name == "get_time"
        schema = CLOCK.parameters if call.name == "get_time" else {"type": "object", "maxProperties": 0}
        jsonschema.validate(json.loads(call.arguments), schema)


def test_a_reasoning_models_thinking_and_calls_are_read_apart(model):
    [done] = dk.generate(model, "x", dk.SamplingParams(max_new_tokens=2, seed=0))
    done = dataclasses.replace(done, finish_reason="stop")  # (an answer that ended on its own)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    tools = tool_use([CLOCK], None, True, None)
    thought = dataclasses.replace(done, text="<think>\nthe clock\n</think>\n\n" + call)
    reply = reply_of(thought, tools, Thinking())
    assert (reply.reasoning, reply.content, reply.finish_reason) == ("\nthe clock\n", None, "tool_calls")
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_time", {"zone": "UTC"})]
    cut = dataclasses.replace(done, text=call + '\n<tool_call>\n{"name": "get_ti', finish_reason="length")
    tools.grammar = True  # (under the grammar a cut-off answer's finished calls stand)
    reply = reply_of(cut, tools, None)
    assert (reply.finish_reason, [c.name for c in reply.tool_calls]) == ("length", ["get_time"])
    assert reply.content is None
    tools.grammar = False
    assert reply_of(cut, tools, None).tool_calls == []  # parsed only: a cut-off answer is text
    whole = reply_of(dataclasses.replace(cut, text=call), tools, None)  # cut after a whole call
    assert (whole.finish_reason, len(whole.tool_calls)) == ("length", 1)
    opened = dataclasses.replace(done, text="add them\n</think>It is 4.")
    reply = reply_of(opened, None, Thinking(opened=True))
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("add them\n", "It is 4.", [])


def test_earlier_calls_and_tool_answers_reach_the_prompt(model):
    made = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [made]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]  # fmt: skip
    text, _ = chat_prompt(model, history, tools=tool_use([CLOCK], None, True, None))
    assert text.startswith("SYSTEM: You can call functions") and json.dumps(CLOCK.openai()) in text
    assert 'ASSISTANT: <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text
    assert text.endswith("USER: <tool_response>\n12:00\n</tool_response>\nASSISTANT:")


@pytest.mark.parametrize(("call", "field", "message"), [
    (lambda m: dk.chat(m, [{"role": "wizard", "content": "x"}]), "messages", "a role is one of"),
    (lambda m: dk.chat(m, []), "messages", "at least one message"),
    (lambda m: dk.chat(m, ASK, tool_choice="required"), "tool_choice", "needs tools"),
    (lambda m: dk.chat(m, ASK, tools=[CLOCK], tool_choice="get_news"), "tool_choice", "not among the tools"),
    (lambda m: dk.chat(m, ASK, tools=[{"type": "function"}]), "tools", "a tool needs"),
    (lambda m: dk.chat(m, ASK, tools=[CLOCK, CLOCK]), "tools", "more than once"),
    (lambda m: dk.chat(m, ASK, chat_template_kwargs={"tools": []}), "chat_template_kwargs", "cannot set"),
])  # fmt: skip
def test_bad_inputs_are_chat_errors_naming_their_field(model, call, field, message):
    with pytest.raises(ChatError, match=message) as caught:
        call(model)
    assert caught.value.field == field and isinstance(caught.value, ValueError)
