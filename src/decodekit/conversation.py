"""Chat: a conversation in, the assistant's next message out, as OpenAI's chat API and vLLM's
`LLM.chat` shape it, on any model.

    reply = dk.chat(model, [{"role": "user", "content": "What time is it in Paris?"}],
                    tools=[clock], tool_choice="required")[0]
    reply.tool_calls, reply.content, reply.reasoning, reply.finish_reason

- **The prompt** (`chat_prompt`): the model's chat template (or `chat_template`), with the
  template's own variables (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); a model
  without one gets the plain template: one line `ROLE: content` per message, then `ASSISTANT:`.
  Messages are OpenAI's: `role`, `content` (text, or a list of text parts), an assistant's
  `tool_calls`, a tool's `tool_call_id`, an assistant's `reasoning_content`.
- **Tools** (decode/tool_calls.py): a template that renders `tools` gets them (and earlier
  calls with their arguments as objects); otherwise a system message lists them and asks for
  Hermes-style calls, earlier calls are written into their turns and a tool's answer is a user
  turn. `tool_choice` "auto" (the default with tools), "required", a tool's name or "none"
  decides the grammar the answer is held to (`tool_grammar`), and the calls are read back
  from it.
- **Reasoning** (decode/reasoning.py): a template that speaks of `</think>` is a reasoning
  model's; its thinking comes back apart (`reasoning`) from the answer (`content`).

The server's /v1/chat/completions is these pieces with HTTP's errors (server/request_plan.py).
A bad message, tool or choice is a `ChatError` (a ValueError) naming the request field it
concerns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from decodekit.completion import Completion
from decodekit.decode.reasoning import Thinking, opens_thinking, template_thinks
from decodekit.decode.tool_calls import (
    CHOICES,
    NO_ARGUMENTS,
    Tool,
    ToolCall,
    ToolFormat,
    call_text,
    check_choice,
    check_tools,
    finished_calls,
    parse_tool_calls,
    template_takes_tools,
    template_text,
    tool_constraint,
    tool_format,
    tools_instruction,
)
from decodekit.optional import MissingDependency
from decodekit.params import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template's own arguments, which chat sets (or which change what it returns): a
# request's chat_template_kwargs holds the template's variables, never these
CHAT_TEMPLATE_ARGS = {
    "conversation", "messages", "tools", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
}  # fmt: skip


class ChatError(ValueError):
    """A bad chat input: `field` names the request field (OpenAI's) it concerns, `code` what kind."""

    def __init__(self, message: str, field: str, code: str = "invalid_value"):
        super().__init__(message)
        self.field, self.code = field, code


@dataclass
class ToolUse:
    """A conversation's tools: how the model may call them (`choice`: "none", "auto", "required"
    or a tool's name) and the format its template writes calls in."""

    tools: tuple[Tool, ...]
    choice: str
    format: ToolFormat | None  # None: the template's calls are in a format decodekit does not read
    parallel: bool = True
    grammar: bool = False  # the answer is under the tools' grammar (its calls streamed piece by piece)

    @property
    def forced(self) -> bool:
        """The answer is calls by construction (a grammar), not by the model's choice."""
        return self.choice not in ("auto", "none")

    @property
    def reads_calls(self) -> bool:
        """Whether answers are read for calls."""
        return self.choice != "none" and self.format is not None


@dataclass
class ChatReply:
    """The assistant's message: its text (`content`, None where it is only calls), the calls it
    made, a reasoning model's thinking (None for another), why it ended ("stop", "length",
    "tool_calls") and the completion it was read from (tokens, logprobs, usage)."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    finish_reason: str = "stop"
    completion: Completion | None = field(default=None, repr=False)


def as_tool(tool: Tool | Mapping[str, Any]) -> Tool:
    """A Tool, or one from OpenAI's {"type": "function", "function": {"name", "description",
    "parameters"}} (or the function object alone)."""
    if isinstance(tool, Tool):
        return tool
    if not isinstance(tool, Mapping):
        raise ChatError(f"tools: a tool is a Tool or OpenAI's function object, got {tool!r:.80}", "tools")
    function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(function, Mapping) or "name" not in function:
        raise ChatError(f"tools: a tool needs {{'type': 'function', 'function': {{'name': ...}}}}, got "
                        f"{tool!r:.80}", "tools")  # fmt: skip
    parameters = function.get("parameters")
    try:
        return Tool(function["name"], function.get("description"),
                    NO_ARGUMENTS if parameters is None else parameters)  # fmt: skip
    except (ValueError, TypeError) as error:
        raise ChatError(f"tools: {error}", "tools") from None


def tool_use(tools: Sequence[Tool | Mapping[str, Any]] | None, tool_choice: str | Mapping | None,
             parallel: bool, template: Any) -> ToolUse | None:  # fmt: skip
    """The conversation's tools and choice, checked, or None without tools. `tool_choice`:
    "none", "auto" (the default), "required", a tool's name, or OpenAI's
    {"type": "function", "function": {"name": ...}}; `template`: the chat template in use."""
    if tools is None:
        if tool_choice is not None:
            raise ChatError("tool_choice needs tools (the functions the model may call)", "tool_choice")
        return None
    try:
        checked = check_tools([as_tool(tool) for tool in tools])
    except ChatError:
        raise
    except (ValueError, TypeError) as error:
        raise ChatError(f"tools: {error}", "tools") from None
    choice = tool_choice or "auto"
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name")
    if not isinstance(choice, str):
        raise ChatError(f"tool_choice must be one of {', '.join(CHOICES)}, a tool's name or "
                        f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r:.80}",
                        "tool_choice")  # fmt: skip
    try:
        check_choice(choice, checked)
    except ValueError as error:
        raise ChatError(str(error), "tool_choice") from None
    return ToolUse(checked, choice, tool_format(template), parallel)


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as text: a string, or its text parts joined (None: empty)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def chat_turns(messages: Sequence[Mapping[str, Any]], tools: ToolUse | None, renders_tools: bool
               ) -> list[dict]:  # fmt: skip
    """The messages as a chat template takes them. Where the template renders tools, an
    assistant turn's calls go with it (their arguments as objects, as Hugging Face templates
    expect); elsewhere they become its text in the tools' format, and a tool's answer a user turn."""
    turns = []
    for m in messages:
        if m.get("role") not in ROLES:
            raise ChatError(f"messages: a role is one of {', '.join(ROLES)}, got {m.get('role')!r:.40}",
                            "messages")  # fmt: skip
        turn: dict[str, Any] = {"role": m["role"], "content": message_text(m)}
        if m.get("reasoning_content") is not None:
            turn["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls") or []
        if calls and renders_tools:
            turn["tool_calls"] = [_call_turn(call) for call in calls]
        elif calls:
            fmt = tools.format if tools is not None and tools.format is not None else "hermes"
            written = [call_text(ToolCall(c["function"]["name"], c["function"]["arguments"], c.get("id", "")),
                                 fmt) for c in calls]  # fmt: skip
            turn["content"] = "\n".join(filter(None, [turn["content"], *written]))
        if m["role"] == "tool":
            if renders_tools:
                turn["tool_call_id"] = m.get("tool_call_id")
            else:
                turn = {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
        turns.append(turn)
    return turns


def _call_turn(call: Mapping[str, Any]) -> dict:
    """An earlier call as a template takes it: its arguments as an object."""
    function = call["function"]
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ChatError(f"the arguments of tool call {call.get('id')!r} are not JSON: {arguments!r:.80}",
                            "messages") from None  # fmt: skip
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}  # fmt: skip


def chat_prompt(model, messages: Sequence[Mapping[str, Any]], template: str | None = None,
                tools: ToolUse | None = None, kwargs: Mapping[str, Any] | None = None) -> tuple[str, bool]:
    """The prompt text of a conversation, and whether it came from a chat template: `template`,
    else the tokenizer's, with the template's own variables (`kwargs`; the plain template has
    none). Tools go to a template that renders them, else into a system message."""
    clash = sorted(set(kwargs or {}) & CHAT_TEMPLATE_ARGS)
    if clash:
        raise ChatError(f"chat_template_kwargs cannot set {clash[0]!r}, which the chat sets",
                        "chat_template_kwargs")  # fmt: skip
    if not messages:
        raise ChatError("messages must contain at least one message", "messages")
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ChatError(f"model {model.name!r} has no tokenizer, so it cannot chat", "model")
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    renders_tools = tools is not None and source is not None and template_takes_tools(source)
    turns = chat_turns(messages, tools, renders_tools)
    if tools is not None and not renders_tools:
        instruction = tools_instruction(tools.tools)
        if turns[0]["role"] in ("system", "developer"):
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{instruction}"}
        else:
            turns.insert(0, {"role": "system", "content": instruction})
    if source:
        chosen = {**(kwargs or {}), **({} if template is None else {"chat_template": template})}
        if renders_tools:
            chosen["tools"] = [tool.openai() for tool in tools.tools]
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True,
                                                 **chosen), True  # fmt: skip
        except Exception as error:  # a template may reject a role order (jinja raises)
            raise ChatError(f"the chat template rejected the messages: {error}", "messages") from None
    return "".join(f"{t['role'].upper()}: {t['content']}\n" for t in turns) + "ASSISTANT:", False


def template_source(model, template: str | None = None) -> Any:
    """The chat template in use: `template`, else the model tokenizer's (None: the plain one)."""
    return template if template is not None else getattr(model.tokenizer, "chat_template", None)


def thinking_of(source: Any, prompt: str) -> Thinking | None:
    """A reasoning model's thinking marks (`source`: the template in use), or None."""
    return Thinking(opened=opens_thinking(prompt)) if template_thinks(template_text(source)) else None


def tool_grammar(model, tools: ToolUse, constraint=None, *, thinking: Thinking | None = None,
                 free: bool = True, field: str = "response_format"):  # fmt: skip
    """The constraint of a chat with tools (decode/tool_calls.py `tool_constraint`): a forced
    call's grammar (a ChatError beside another `constraint`, named `field`); for "auto" the
    grammar of text or calls where nothing else constrains the answer, `free` (no draft model,
    no ignore_eos) and the model's tokenizer is one llguidance reads (else its calls are parsed
    only); `constraint` itself for "none". A reasoning model may think before a forced call."""
    if tools.choice == "none" or (tools.format is None and not tools.forced):
        return constraint
    if tools.format is None:
        raise ChatError(f"tool_choice {tools.choice!r} needs calls in a format decodekit reads (Hermes "
                        "<tool_call> blocks or JSON objects); this model's chat template writes another",
                        "tool_choice", "unsupported")  # fmt: skip
    if tools.forced and constraint is not None:
        raise ChatError(f"tool_choice {tools.choice!r} makes the answer tool calls, so it cannot be combined "
                        f"with {field}", "tool_choice")  # fmt: skip
    if not tools.forced and (constraint is not None or not free):
        return constraint
    try:
        grammar = tool_constraint(tools.tools, tools.choice, tools.format, tools.parallel, thinking)
    except MissingDependency:
        if not tools.forced:
            return None
        raise ChatError(f"tool_choice {tools.choice!r} needs constrained decoding (install "
                        "decodekit[constrained])", "tool_choice", "unsupported") from None  # fmt: skip
    except (ValueError, TypeError) as error:
        raise ChatError(f"tools: {error}", "tools") from None
    if not tools.forced:
        from decodekit.decode.constrained import ll_tokenizer

        try:
            ll_tokenizer(model)
        except (TypeError, ValueError):  # a tokenizer llguidance cannot read: the calls are parsed only
            return None
    tools.grammar = True
    return grammar


def reply_of(completion: Completion, tools: ToolUse | None, thinking: Thinking | None) -> ChatReply:
    """The assistant's message a completion holds: a reasoning model's thinking apart; with
    tools, the calls the rest holds ("tool_calls", or "length" where max_tokens cut it) and the
    text around them; else the rest."""
    reasoning, text = None, completion.text
    if thinking is not None:
        reasoning, text = thinking.split(text)
    reason = "length" if completion.finish_reason == "length" else "stop"
    if tools is not None and tools.reads_calls:
        content, calls = parse_tool_calls(text, tools.tools, tools.format)
        if calls:  # ("length" where max_tokens cut the answer after a whole call: it was cut)
            return ChatReply(content, calls, reasoning, "length" if reason == "length" else "tool_calls",
                             completion)  # fmt: skip
        if reason == "length" and tools.grammar:  # cut off inside a call: the calls finished before it
            content, calls = parse_tool_calls(finished_calls(text, tools.format), tools.tools, tools.format)
            if calls:
                return ChatReply(content, calls, reasoning, "length", completion)
    return ChatReply(text, [], reasoning, reason, completion)


def chat(model, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None, *,
         tools: Sequence[Tool | Mapping[str, Any]] | None = None, tool_choice: str | Mapping | None = None,
         parallel_tool_calls: bool = True, chat_template: str | None = None,
         chat_template_kwargs: Mapping[str, Any] | None = None) -> list[ChatReply]:  # fmt: skip
    """The assistant's next message, `params.n` of them (module docstring): the conversation
    through the chat template, the answer held to the tools' grammar where `tool_choice`
    asks, and read back into content, calls and reasoning."""
    from decodekit.decode.sample import generate

    params = params if params is not None else SamplingParams()
    source = template_source(model, chat_template)
    use = tool_use(tools, tool_choice, parallel_tool_calls, source)
    text, templated = chat_prompt(model, messages, chat_template, use, chat_template_kwargs)
    thinking = thinking_of(source, text)
    constraint = None
    if use is not None:
        constraint = tool_grammar(model, use, thinking=thinking, free=not params.ignore_eos)
    prompt = list(model.tokenizer.encode(text, add_special_tokens=False)) if templated else text
    completions = generate(model, [prompt], params, constraint=constraint)[0]
    return [reply_of(completion, use, thinking) for completion in completions]
