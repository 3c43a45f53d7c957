"""A reasoning model's thinking apart from its answer (decode/reasoning.py): hand-written
answers split, the stream reader against the whole-text split over every way of cutting the
text into pieces, and the thinking block a forced tool call's grammar lets the model write."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.decode.reasoning import Thinking, ThinkingStream, opens_thinking, template_thinks

QWEN = Thinking()  # the model opens <think> itself
R1 = Thinking(opened=True)  # the prompt opened it


@pytest.mark.parametrize(("thinking", "text", "parts"), [
    (QWEN, "<think>\nLet me add.\n</think>\n\n4", ("\nLet me add.\n", "4")),
    (QWEN, "  \n<think>x</think>y", ("x", "y")),
    (QWEN, "4, no thinking", (None, "4, no thinking")),
    (QWEN, "<think>\ncut off by max_tokens", ("\ncut off by max_tokens", "")),
    (QWEN, "<thin", (None, "<thin")),
    (QWEN, "The answer. <think>late</think>", (None, "The answer. <think>late</think>")),
    (R1, "Let me add.\n</think>\n\n4", ("Let me add.\n", "4")),
    (R1, "still thinking", ("still thinking", "")),
    (R1, "</think>", ("", "")),
])  # fmt: skip
def test_an_answer_splits_into_reasoning_and_content(thinking, text, parts):
    assert thinking.split(text) == parts


def test_the_template_and_the_prompt_say_where_thinking_begins():
    assert template_thinks("{{ content.split('</think>')[-1] }}") and not template_thinks("{{ content }}")
    assert opens_thinking("<|Assistant|><think>\n") and not opens_thinking("<think>\n\n</think>\n\n")
    assert not opens_thinking("no marks") and opens_thinking("<think>a</think><think>")


TEXTS = ["<think>\nsum: 2+2\n</think>\n\nIt is 4.", " <think></think>", "<th", "plain <think> text",
         "<think>a</thi", "<think>a</think>  ", "a</think>b", "x</th"]  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(TEXTS), st.booleans(), st.lists(st.integers(0, 40), max_size=6))
def test_a_stream_adds_up_to_the_split(text, opened, cuts):
    thinking = Thinking(opened)
    reader, reasoning, content, start = ThinkingStream(thinking), "", "", 0
    for cut in [*sorted(cuts), len(text)]:
        more, rest = reader.feed(text[start:max(start, cut)])
        start = max(start, cut)
        reasoning, content = reasoning + more, content + rest
        assert "</" not in reasoning or "</think>" not in text  # never a piece of the closing mark
    more, rest = reader.finish()
    whole_reasoning, whole_content = thinking.split(text)
    assert (reasoning + more, content + rest) == (whole_reasoning or "", whole_content)


def test_a_forced_call_may_follow_the_thinking():
    llguidance = pytest.importorskip("llguidance")

    from decodekit.decode.constrained import ll_tokenizer
    from decodekit.decode.tool_calls import Tool, tool_constraint
    from decodekit.models.registry import load_model

    model = load_model("shakespeare")
    tool = Tool("get_time", parameters={"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                                        "required": ["zone"], "additionalProperties": False})  # fmt: skip
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    cases = {QWEN: [(call, True), ("<think>\nthe time\n</think>\n\n" + call, True),
                    ("<think>x</think>plain", False), ("the time\n</think>\n" + call, False)],
             R1: [(call, False), ("the time\n</think>\n\n" + call, True), ("x</think>plain", False)]}
    for thinking, texts in cases.items():
        grammar = tool_constraint([tool], "required", thinking=thinking).grammar()
        for text, taken in texts:
            matcher = llguidance.LLMatcher(ll_tokenizer(model), grammar, log_level=0)
            assert (matcher.consume_tokens(model.encode(text)) and matcher.is_accepting()) == taken, text
