"""Tool calls: a chat model asks for functions to be run, in OpenAI's `tools` terms.

A `Tool` is one function a model may call: a name, a description and a JSON schema of its
arguments. What the model writes for a call depends on how it was trained; decodekit reads
two formats (`ToolFormat`):

- "hermes": each call a JSON object {"name": ..., "arguments": {...}} between `<tool_call>`
  and `</tool_call>` lines, any text around them being the answer's content (Hermes, Qwen
  2.5 and 3, and the models fine-tuned on their templates);
- "json": the whole answer one JSON object {"name": ..., "parameters": {...}} ("arguments"
  also read), or a list of them (Llama 3.1-3.3's templates).

`tool_format` picks one from the chat template's text. A template that never mentions tools
(and the plain template of a model without one) cannot show them to the model, so
`tools_instruction` writes them into a system message that asks for the "hermes" format. A
template that shows them in another format (`OTHER_FORMATS`: Mistral's `[TOOL_CALLS]`,
Qwen3-Coder's `<function=...>` blocks, DeepSeek's and Kimi's call tokens) has none that
decodekit reads: its answers are text.

How a call is made, by the request's `tool_choice` (`tool_constraint`: a grammar over
decode/constrained.py, each call's arguments valid under its tool's schema, written with
`tojson`'s separators):
- "auto": the model writes text or calls. The grammar lets text be free until the model opens
  a call (`<tool_call>`, or an answer opening with `{"name"` in the "json" format); from there
  it holds the model to calls of the tools, as llama.cpp's lazy grammars do. Where the answer
  is not constrained this way (another constraint, a draft model), `parse_tool_calls` still
  reads the calls, and text whose calls do not parse is content, as vLLM returns it.
- "required", or one tool named: the answer is calls (exactly one with `parallel=False` or a
  named tool), so it always parses into calls.
- "none": no call is looked for; the answer is text.

`ToolCallStream` does the same parse for a stream: it passes text on while it cannot be the
start of a call and holds the rest back until the answer ends.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from decodekit.decode.reasoning import Thinking, held

ToolFormat = Literal["hermes", "json"]
# what templates that write calls in a format decodekit does not read say (`tool_format`)
OTHER_FORMATS = ("[TOOL_CALLS]", "<function=", "tool_calls_begin", "tool▁calls▁begin", "<|tool_call_begin|>")
CHOICES = ("none", "auto", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENTS = {"hermes": "arguments", "json": "parameters"}  # each format's key of a call's arguments
OPENING = '{"name": '  # how every call's JSON begins, in either format (tojson's separators)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    """One function a model may call; `parameters`: the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_ARGUMENTS))

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ValueError(f"a tool's name must be 1-64 letters, digits, '_' or '-', got {self.name!r:.80}")
        if not isinstance(self.parameters, Mapping):
            raise TypeError(f"tool {self.name!r}: parameters must be a JSON schema object, "
                            f"got {self.parameters!r:.80}")  # fmt: skip

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request lists it (and Hugging Face chat templates take it)."""
        function = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: `arguments` is its JSON text, as OpenAI's responses carry it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def check_tools(tools: Sequence[Tool]) -> tuple[Tool, ...]:
    """The tools, refused (ValueError) when empty or when two share a name."""
    tools = tuple(tools)
    if not tools:
        raise ValueError("tools must list at least one function, got []")
    names = [tool.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tool names must be unique, got {repeated[0]!r} more than once")
    return tools


def check_choice(choice: str, tools: Sequence[Tool]) -> None:
    """`choice`: "none", "auto", "required" or the name of one of `tools`."""
    if choice in CHOICES:
        return
    names = [tool.name for tool in tools]
    if choice not in names:
        raise ValueError(f"tool_choice names the function {choice!r}, which is not among the tools "
                         f"({', '.join(names)})")  # fmt: skip


def template_text(template: Any) -> str:
    """A chat template's Jinja text: a string, or a dict of named templates (all of them)."""
    if isinstance(template, Mapping):
        return "\n".join(str(text) for text in template.values())
    return template if isinstance(template, str) else ""


def template_takes_tools(template: Any) -> bool:
    """Whether a chat template renders a `tools` variable (else it would drop them silently)."""
    return re.search(r"\btools\b", template_text(template)) is not None


def tool_format(template: Any) -> ToolFormat | None:
    """The format a template's model writes calls in: "hermes" where the template speaks of
    `<tool_call>` or cannot show tools at all (`tools_instruction` asks for it), None where it
    shows another format (`OTHER_FORMATS`), else "json"."""
    text = template_text(template)
    if not template_takes_tools(text):
        return "hermes"
    if any(mark in text for mark in OTHER_FORMATS):
        return None
    return "hermes" if OPEN in text else "json"


def tools_instruction(tools: Sequence[Tool]) -> str:
    """A system message that shows `tools` to a model whose template cannot, and asks for
    calls in the "hermes" format."""
    listed = "\n".join(json.dumps(tool.openai(), ensure_ascii=False) for tool in tools)
    return ("You can call functions to answer. They are listed, one JSON object a line, between "
            f"<tools> and </tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call one, write a JSON object with its name and arguments between <tool_call> and "
            "</tool_call> lines:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}')


def call_text(call: ToolCall, fmt: ToolFormat = "hermes") -> str:
    """A call as the model writes it, for an assistant turn a template cannot render."""
    body = f'{OPENING}{json.dumps(call.name)}, "{ARGUMENTS[fmt]}": {call.arguments}}}'
    return f"{OPEN}\n{body}\n{CLOSE}" if fmt == "hermes" else body


# Calls written as json.dumps and Jinja's `tojson` write them (the templates' examples): ", "
# between items, ": " after keys, no other whitespace.
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FREE = r"(.|\n)*"


def _lark_text(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


def tool_constraint(tools: Sequence[Tool], choice: str, fmt: ToolFormat = "hermes", parallel: bool = True,
                    thinking: Thinking | None = None):
    """The grammar of the answers `choice` allows, or None for "none".

    - "required": one or more calls of `tools` (one with `parallel=False`); a tool's name: one
      call of it. The answer is calls.
    - "auto": any text, or calls: in the "hermes" format free text, then once the model opens
      `<tool_call>`, calls and nothing else; in the "json" format an answer that opens with
      `{"name"` is one call, any other is text. The model decides; what it writes as a call
      is a call (a lazy grammar, as llama.cpp's server has).

    Each call's arguments are valid under its tool's schema. A reasoning model's forced calls
    may follow its thinking block (`thinking`, decode/reasoning.py; "auto"'s free text already
    takes one). A bad schema is a ValueError."""
    from decodekit.decode.constrained import Grammar

    check_choice(choice, tools)
    if choice == "none":
        return None
    targets = [tool for tool in tools if choice in ("auto", "required") or tool.name == choice]
    many = parallel and choice in ("auto", "required")
    key = ARGUMENTS[fmt]
    alternatives = [f"{_lark_text(json.dumps(tool.name) + f', {json.dumps(key)}: ')} args{i} \"}}\""
                    for i, tool in enumerate(targets)]  # fmt: skip
    rules = [f"named: {' | '.join(alternatives)}"]
    rules += [f"args{i}: %json {json.dumps({**tool.parameters, 'x-guidance': SEPARATORS})}"
              for i, tool in enumerate(targets)]  # fmt: skip
    if fmt == "hermes":
        more = " (OPEN named CLOSE)*" if many else ""
        first, again, close = (_lark_text(text) for text in (f"{OPEN}\n{OPENING}", f"\n{OPEN}\n{OPENING}",
                                                              f"\n{CLOSE}"))  # fmt: skip
        if choice == "auto":  # text without `<tool_call>`, or text then calls
            head = [f"start: TEXT | PRE named CLOSE{more}", f"TEXT: /{FREE}/ & ~/{FREE}{OPEN}{FREE}/",
                    f"PRE: TEXT {first}"]  # fmt: skip
        else:
            head = [f"start: {first} named CLOSE{more}"]
        head += [f"OPEN: {again}", f"CLOSE: {close}"]
    elif choice == "auto":
        head = ["start: TEXT | PRE named",
                f'TEXT: /{FREE}/ & ~/[ \\t\\n]*\\{{"name"{FREE}/',
                f"PRE: /[ \\t\\n]*/ {_lark_text(OPENING)}"]  # fmt: skip
    elif many:
        head = ["start: call | \"[\" call (\", \" call)* \"]\"", f"call: {_lark_text(OPENING)} named"]
    else:
        head = [f"start: {_lark_text(OPENING)} named"]
    if thinking is not None and choice != "auto":
        thought, lexemes = thinking.lark()
        head = [f"start: {thought} ({head[0].removeprefix('start: ')})", *head[1:], *lexemes]
    try:
        return Grammar("\n".join(head + rules) + "\n")
    except ValueError as error:
        raise ValueError(f"a tool's parameters are not a JSON schema this server can constrain to: "
                         f"{error}") from None  # fmt: skip


def _calls_of(value: Any, names: set[str]) -> list[ToolCall] | None:
    """The calls a parsed JSON value holds (an object or a list of them), or None if it is not
    calls of these tools."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def parse_tool_calls(text: str, tools: Sequence[Tool], fmt: ToolFormat = "hermes"
                     ) -> tuple[str | None, list[ToolCall]]:  # fmt: skip
    """(content, calls) of a model's answer: the calls it wrote in `fmt` and the text around
    them (None when there is none). An answer whose calls do not all parse is content alone."""
    names = {tool.name for tool in tools}
    if fmt == "json":
        try:
            calls = _calls_of(json.loads(text), names)
        except json.JSONDecodeError:
            calls = None
        return (None, calls) if calls else (text, [])
    outside, bodies = _split_calls(text)
    calls = []
    for body in bodies:
        try:
            found = _calls_of(json.loads(body), names)
        except json.JSONDecodeError:
            found = None
        if found is None:
            return text, []
        calls += [_as_written(call, body) for call in found]
    if not calls:
        return text, []
    return outside.strip() or None, calls


# How a call under the grammar begins, up to its arguments (`tool_constraint`'s "hermes" form).
CALL_HEAD = re.compile(re.escape(OPENING) + r'"([A-Za-z0-9_-]{1,64})", "arguments": ')
CALL_TAIL = "}\n" + CLOSE  # the call's closing brace and the block's end (no raw newline is in JSON)


def _as_written(call: ToolCall, body: str) -> ToolCall:
    """The call with its arguments as the model wrote them where it wrote the grammar's form
    (so a stream's pieces add up to the same text), else as json.dumps writes them."""
    head = CALL_HEAD.match(body.strip())
    written = body.strip()[head.end() : -1] if head and body.strip().endswith("}") else None
    if written is None or json.loads(written) != json.loads(call.arguments):
        return call
    return ToolCall(call.name, written, call.id)


def finished_calls(text: str, fmt: ToolFormat = "hermes") -> str:
    """An answer cut off inside a call (max_tokens), less that call: its finished calls stand
    ("hermes" blocks; a "json" answer is one value, so it is left whole)."""
    last = text.rfind(OPEN)
    if fmt != "hermes" or last < 0 or CLOSE in text[last:]:
        return text
    return text[:last]


def _split_calls(text: str) -> tuple[str, list[str]]:
    """(the text around an answer's `<tool_call>` blocks, the blocks' bodies); an unclosed last
    block's body runs to the end (read if its JSON is whole)."""
    outside, bodies, rest = [], [], text
    while OPEN in rest:
        before, _, rest = rest.partition(OPEN)
        body, _, rest = rest.partition(CLOSE)
        outside.append(before)
        bodies.append(body)
    return "".join([*outside, rest]), bodies


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its place among the answer's calls; its id and name with its
    first piece (None after); the next piece of its arguments' text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class ToolCallStream:
    """A stream's answer read for calls (module docstring). `feed` each piece of text; it gives
    the content to send on, and with `incremental` (an answer under the grammar, in the "hermes"
    format: its calls are the grammar's form) the calls' pieces as they come: a call's id and
    name once its name is written, then its arguments' text, holding back what may be the end of
    the call. `finish` gives the content held back, the calls' last pieces (whole calls where
    they were not streamed) and the calls. A call cut off by max_tokens after its pieces were
    sent stays sent; the answer then has no calls."""

    def __init__(self, tools: Sequence[Tool], fmt: ToolFormat = "hermes", constrained: bool = False,
                 incremental: bool = False):
        self.tools, self.fmt = tuple(tools), fmt
        self.text, self.sent = "", 0
        self.holding = constrained  # a constrained answer is calls: no content to send on early
        self.incremental = incremental and fmt == "hermes"
        self.calls: list[ToolCall] = []  # the calls begun (their id and name sent)
        self.at = None  # where the current call's unsent text begins, or None between calls
        self.opened = 0  # where the next `<tool_call>` is looked for

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        self.text += piece
        content = self._content()
        return content, self._pieces() if self.incremental and self.holding else []

    def _content(self) -> str:
        if self.holding:
            return ""
        if self.fmt == "json":
            start = self.text.lstrip()
            if not start:
                return ""
            self.holding = start[0] in "{["
            return "" if self.holding else self._send(len(self.text))
        found = self.text.find(OPEN, self.sent)
        if found >= 0:
            self.holding = True
            return self._send(found)
        # send up to where the text's tail might begin a `<tool_call>`
        return self._send(len(self.text) - held(self.text[self.sent:], OPEN))

    def _send(self, end: int) -> str:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece

    def _pieces(self) -> list[CallDelta]:
        out = []
        while True:
            if self.at is None:  # between calls: a call's head, once its name is written
                found = self.text.find(OPEN, self.opened)
                if found < 0:
                    return out
                body = found + len(OPEN) + 1  # `<tool_call>` and its newline
                head = CALL_HEAD.match(self.text, body)
                if head is None:
                    return out
                self.calls.append(ToolCall(head.group(1), ""))
                out.append(CallDelta(len(self.calls) - 1, self.calls[-1].id, head.group(1), ""))
                self.at = head.end()
            end = self.text.find(CALL_TAIL, self.at)
            stop = end if end >= 0 else len(self.text) - held(self.text[self.at:], CALL_TAIL)
            if stop > self.at:
                out.append(CallDelta(len(self.calls) - 1, None, None, self.text[self.at:stop]))
                self.at = stop
            if end < 0:
                return out
            self.at, self.opened = None, end + len(CALL_TAIL)

    def finish(self) -> tuple[str, list[CallDelta], list[ToolCall]]:
        """The content not yet sent, the calls' pieces not yet sent, and the answer's calls."""
        text = self.text
        _, calls = parse_tool_calls(text, self.tools, self.fmt)
        if not calls and self.incremental:  # cut off inside a call: the calls finished before it
            text = finished_calls(text, self.fmt)
            _, calls = parse_tool_calls(text, self.tools, self.fmt)
        if not calls:
            return self.text[self.sent:], [], []
        outside = _split_calls(text)[0] if self.fmt == "hermes" else ""
        # what was sent is the start of the text before the calls; space alone is no content
        content = outside[self.sent:].rstrip() if outside.strip() else ""
        if not self.incremental:
            return content, [CallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)], calls
        pieces = self._pieces()
        rest = self.text[self.at:].rstrip()[:-1] if self.at is not None else ""
        if rest:  # an unclosed last call (its JSON whole): the rest of it but its brace
            pieces.append(CallDelta(len(self.calls) - 1, None, None, rest))
        return content, pieces, calls
