"""Tool calls (decode/tool_calls.py): the two formats parsed from hand-written answers, the
stream reader against the whole-text parse, and the grammar of a forced call, whose output
always parses into calls whose arguments are valid under their tool's schema."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit.decode.tool_calls import (
    Tool,
    ToolCallStream,
    check_choice,
    check_tools,
    finished_calls,
    parse_tool_calls,
    template_takes_tools,
    tool_constraint,
    tool_format,
    tools_instruction,
)

WEATHER = Tool("get_weather", "The weather of a city", {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}}})  # fmt: skip
TIME = Tool("get_time", parameters={"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                    "required": ["zone"], "additionalProperties": False})  # fmt: skip
NOOP = Tool("noop")
TOOLS = (WEATHER, TIME, NOOP)


def call(name: str, arguments: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: arguments})


def test_hermes_calls_and_the_text_around_them():
    text = (f"Let me look.\n<tool_call>\n{call('get_weather', {'city': 'Rome', 'days': 2})}\n</tool_call>\n"
            f"<tool_call>\n{call('get_time', {'zone': 'CET'})}\n</tool_call>")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    "no call at all",
    f"<tool_call>\n{call('launch_rockets', {})}\n</tool_call>",  # not one of the tools
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',  # broken JSON
    f"<tool_call>\n{call('get_time', {'zone': 'UTC'})}\n</tool_call><tool_call>\n[1, 2]\n</tool_call>",
    '<tool_call>\n{"name": "get_time", "arguments": "not json"}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',
])
def test_an_answer_whose_calls_do_not_all_parse_is_content(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_arguments_written_as_json_text_and_an_unclosed_last_call():
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}'  # no </tool_call>
    content, [made] = parse_tool_calls(text, TOOLS)
    assert content is None and (made.name, json.loads(made.arguments)) == ("get_time", {"zone": "UTC"})


def test_json_format_one_object_or_a_list():
    content, calls = parse_tool_calls(" " + call("get_time", {"zone": "UTC"}, "parameters"), TOOLS, "json")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    both = json.dumps([{"name": "noop", "parameters": {}},
                       {"name": "get_time", "arguments": {"zone": "CET"}}])  # fmt: skip
    assert [c.name for c in parse_tool_calls(both, TOOLS, "json")[1]] == ["noop", "get_time"]
    for text in ("The weather is fine.", '{"name": "nope", "parameters": {}}', '{"answer": 1}', "[]"):
        assert parse_tool_calls(text, TOOLS, "json") == (text, [])


def test_tools_and_choices_are_checked():
    for bad in ("", "has space", "x" * 65, "dot.name"):
        with pytest.raises(ValueError, match="a tool's name"):
            Tool(bad)
    with pytest.raises(TypeError, match="parameters"):
        Tool("f", parameters="{}")
    with pytest.raises(ValueError, match="'noop' more than once"):
        check_tools([NOOP, WEATHER, NOOP])
    with pytest.raises(ValueError, match="at least one"):
        check_tools([])
    with pytest.raises(ValueError, match="'get_news', which is not among the tools"):
        check_choice("get_news", TOOLS)
    for choice in ("none", "auto", "required", "noop"):
        check_choice(choice, TOOLS)


def test_the_format_and_the_instruction_follow_the_template():
    hermes = "{% for t in tools %}{{ t | tojson }}{% endfor %} Call with <tool_call>...</tool_call>"
    llama = "{% if tools %}Respond with {\"name\": ..., \"parameters\": ...}{% endif %}"
    assert (tool_format(hermes), tool_format(llama), tool_format("{{ messages }}"), tool_format(None)) == \
        ("hermes", "json", "hermes", "hermes")
    mistral = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %} [TOOL_CALLS]"
    coder = "{% for t in tools %}{{ t.name }}{% endfor %}<tool_call>\n<function={{ name }}>"
    assert tool_format(mistral) is None and tool_format(coder) is None  # formats decodekit does not read
    assert template_takes_tools({"default": "{{ messages }}", "tool_use": llama})
    assert not template_takes_tools("{{ messages }}") and not template_takes_tools(None)
    text = tools_instruction(TOOLS)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [tool.openai() for tool in TOOLS]
    assert "<tool_call>" in text


def stream_pieces(text: str, cuts: list[int], reader: ToolCallStream) -> tuple[str, str, list]:
    """(what the reader sent while the text arrived, what it sent at the end, the calls)."""
    sent, start = [], 0
    for cut in [*sorted(cuts), len(text)]:
        content, pieces = reader.feed(text[start:cut])
        assert pieces == [] or reader.incremental  # calls whole at the end unless streamed
        sent.append(content)
        start = max(start, cut)
    rest, _, calls = reader.finish()
    return "".join(sent), rest, calls


def streamed_calls(text: str, cuts: list[int], reader: ToolCallStream) -> list[tuple[str, str]]:
    """(name, arguments) of each call a reader streamed, its pieces added up by index."""
    pieces, start = [], 0
    for cut in [*sorted(cuts), len(text)]:
        pieces += reader.feed(text[start:cut])[1]
        start = max(start, cut)
    pieces += reader.finish()[1]
    calls: dict[int, list] = {}
    for piece in pieces:
        if piece.id is not None:  # a call's first piece: its id and name
            assert piece.index == len(calls) and piece.name is not None
            calls[piece.index] = [piece.name, ""]
        else:
            assert piece.name is None and piece.arguments
        calls[piece.index][1] += piece.arguments
    return [tuple(made) for made in calls.values()]


ANSWERS = [
    "Plain text with a < sign and a <tool box.",
    f"Checking.\n<tool_call>\n{call('get_time', {'zone': 'UTC'})}\n</tool_call>",
    f"<tool_call>\n{call('noop', {})}\n</tool_call>\nDone <tool",
    f"<tool_call>\n{call('nope', {})}\n</tool_call>",
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ANSWERS), st.lists(st.integers(0, 120), max_size=8))
def test_a_stream_sends_the_content_and_never_part_of_a_call(text, cuts):
    content, calls = parse_tool_calls(text, TOOLS)
    early, rest, streamed = stream_pieces(text, cuts, ToolCallStream(TOOLS))
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    if not calls:
        assert early + rest == text  # every character, in order
    else:
        assert text.startswith(early) and len(early) <= text.index("<tool_call>")  # sent before the call
        assert (early + rest).strip() == content and "<tool_call>" not in early + rest


def test_a_json_format_stream_holds_an_answer_that_opens_with_json():
    text = call("get_time", {"zone": "CET"}, "parameters")
    early, rest, calls = stream_pieces(text, [3, 10], ToolCallStream(TOOLS, "json"))
    assert (early, rest, [c.name for c in calls]) == ("", "", ["get_time"])
    early, rest, calls = stream_pieces("  Sunny.", [1, 4], ToolCallStream(TOOLS, "json"))
    assert (early, rest, calls) == ("  Sunny.", "", [])


def test_a_forced_answer_is_held_whole():
    text = f"<tool_call>\n{call('noop', {})}\n</tool_call>"
    reader = ToolCallStream(TOOLS, constrained=True)
    assert reader.feed(text[:5]) == ("", []) and reader.feed(text[5:]) == ("", [])
    rest, pieces, calls = reader.finish()
    assert rest == "" and [(c.name, c.arguments) for c in pieces] == [("noop", "{}")] == \
        [(c.name, c.arguments) for c in calls]


@pytest.fixture(scope="module")
def shakespeare():
    pytest.importorskip("llguidance")
    from decodekit.models.registry import load_model

    return load_model("shakespeare")


@pytest.mark.parametrize("fmt", ["hermes", "json"])
@pytest.mark.parametrize(("choice", "parallel"), [("required", False), ("get_weather", True), ("noop", True)])
def test_a_forced_call_always_parses_and_its_arguments_fit_the_schema(shakespeare, fmt, choice, parallel):
    import jsonschema

    import decodekit as dk

    constraint = tool_constraint(TOOLS, choice, fmt, parallel)
    schemas = {tool.name: tool.parameters for tool in TOOLS}
    names = set()
    for seed in range(4):
        [done] = dk.generate(shakespeare, "ROMEO:", dk.SamplingParams(max_new_tokens=200, seed=seed),
                             constraint=constraint)  # fmt: skip
        assert done.finish_reason == "stop", done.text
        content, calls = parse_tool_calls(done.text, TOOLS, fmt)
        assert content is None and len(calls) == 1, done.text
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
        names.add(calls[0].name)
    assert names <= ({choice} if choice != "required" else set(schemas))


def test_required_parallel_calls_repeat_the_format(shakespeare):
    """The grammar's loop: a random model under it keeps calling until its tokens run out."""
    import decodekit as dk

    constraint = tool_constraint((TIME,), "required", "hermes", parallel=True)
    texts = [dk.generate(shakespeare, "ROMEO:", dk.SamplingParams(max_new_tokens=120, seed=seed),
                         constraint=constraint)[0].text for seed in range(6)]  # fmt: skip
    counts = [len(parse_tool_calls(text, (TIME,))[1]) or text.count("<tool_call>") for text in texts]
    assert all(count >= 1 for count in counts) and max(counts) > 1  # some answers call it again
    assert tool_constraint(TOOLS, "none") is None


def answer(name: str, arguments: dict, key: str = "arguments") -> str:
    return f"<tool_call>\n{call(name, arguments, key)}\n</tool_call>" if key == "arguments" \
        else call(name, arguments, key)


# (format, tool_choice, parallel) -> hand-written answers and whether the grammar takes each whole
GRAMMAR_CASES = {
    ("hermes", "auto", True): [
        ("plain text, a < sign and a <tool box", True),
        ("Let me look.\n" + answer("get_time", {"zone": "UTC"}), True),
        (answer("noop", {}) + "\n" + answer("get_weather", {"city": "Rome", "days": 3}), True),
        (answer("get_time", {"zone": "PST"}), False),  # not in the enum
        (answer("get_weather", {"city": "Rome"}), False),  # a required argument missing
        (answer("launch", {}), False),  # not a tool
        (answer("noop", {}) + "\nand then some text", False),  # nothing but calls after a call
        ("<tool_call>\n{\"name\":\"noop\",\"arguments\":{}}\n</tool_call>", False),  # not tojson's spacing
    ],
    ("hermes", "auto", False): [(answer("noop", {}) + "\n" + answer("noop", {}), False)],
    ("hermes", "required", True): [("plain text", False), (answer("noop", {}), True)],
    ("hermes", "get_time", True): [(answer("noop", {}), False), (answer("get_time", {"zone": "CET"}), True)],
    ("json", "auto", True): [
        ("Sunny.", True), ('{"answer": 1}', True),
        ("  " + answer("get_time", {"zone": "CET"}, "parameters"), True),
        (answer("get_time", {"zone": "XX"}, "parameters"), False), (answer("nope", {}, "parameters"), False),
    ],
    ("json", "required", True): [
        (answer("noop", {}, "parameters"), True), ("Sunny.", False),
        (f"[{answer('noop', {}, 'parameters')}, {answer('get_time', {'zone': 'UTC'}, 'parameters')}]", True),
    ],
    ("json", "required", False): [(f"[{answer('noop', {}, 'parameters')}]", False)],
}


@pytest.mark.parametrize("case", list(GRAMMAR_CASES), ids=lambda case: "-".join(map(str, case)))
def test_the_grammar_takes_calls_and_text_as_the_choice_allows(shakespeare, case):
    import llguidance

    from decodekit.decode.constrained import ll_tokenizer

    fmt, choice, parallel = case
    grammar = tool_constraint(TOOLS, choice, fmt, parallel).grammar()
    for text, taken in GRAMMAR_CASES[case]:
        matcher = llguidance.LLMatcher(ll_tokenizer(shakespeare), grammar, log_level=0)
        whole = matcher.consume_tokens(shakespeare.encode(text)) and matcher.is_accepting()
        assert whole == taken, text


def test_a_schema_the_grammar_cannot_take_is_a_value_error():
    pytest.importorskip("llguidance")
    with pytest.raises(ValueError, match="parameters are not a JSON schema"):
        tool_constraint((Tool("f", parameters={"type": 5}),), "required")


GRAMMAR_ANSWERS = [  # as the grammar writes them: tojson's separators, nested objects, a } in a string
    f"Checking.\n{answer('get_time', {'zone': 'UTC'})}",
    f"{answer('get_weather', {'city': 'Rome}', 'days': 2})}\n{answer('noop', {})}",
    answer("get_weather", {"city": "a\nb", "days": 3}) + "\n" + answer("get_time", {"zone": "CET"}),
    '<tool_call>\n{"name": "noop", "arguments": {}}',  # no </tool_call>: the call whole at the end
]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(GRAMMAR_ANSWERS), st.lists(st.integers(0, 150), max_size=10))
def test_calls_under_the_grammar_stream_piece_by_piece(text, cuts):
    """A stream of an answer under the grammar sends each call's name as soon as it is written
    and its arguments piece by piece; the pieces add up to the whole answer's calls (their
    arguments as written), whatever the cuts, and no content is sent after the first call."""
    content, calls = parse_tool_calls(text, TOOLS)
    assert streamed_calls(text, cuts, ToolCallStream(TOOLS, incremental=True)) == \
        [(c.name, c.arguments) for c in calls]
    assert all(json.loads(c.arguments) is not None for c in calls)
    early, rest, _ = stream_pieces(text, cuts, ToolCallStream(TOOLS, incremental=True))
    assert (early + rest).strip() == (content or "")


def test_a_calls_name_goes_out_before_its_arguments_end():
    reader = ToolCallStream(TOOLS, constrained=True, incremental=True)
    assert reader.feed('<tool_call>\n{"name": "get_wea')[1] == []
    first, piece = reader.feed('ther", "arguments": {"ci')[1]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert first.id.startswith("call_") and (piece.index, piece.id, piece.arguments) == (0, None, '{"ci')
    [more] = reader.feed('ty": "Rome"}}\n</tool_')[1]  # the call's brace and what follows held back
    assert (more.id, more.arguments) == (None, 'ty": "Rome"}')


def test_an_answer_cut_off_inside_a_call_keeps_the_calls_finished_before_it():
    cut = answer("noop", {}) + "\n" + answer("get_time", {"zone": "UTC"}) + \
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert finished_calls(cut) == answer("noop", {}) + "\n" + answer("get_time", {"zone": "UTC"}) + "\n"
    assert finished_calls(answer("noop", {})) == answer("noop", {})  # nothing cut off: the same
    assert finished_calls('{"name": "noop", "param', "json") == '{"name": "noop", "param'
    reader = ToolCallStream(TOOLS, constrained=True, incremental=True)
    pieces = reader.feed(cut)[1]
    rest, more, calls = reader.finish()
    assert rest == "" and [c.name for c in calls] == ["noop", "get_time"]
    begun = [p.name for p in pieces + more if p.name]
    assert begun == ["noop", "get_time", "get_weather"]  # the third was begun
