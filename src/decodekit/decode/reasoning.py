"""A reasoning model's thinking, kept apart from its answer.

Reasoning models (Qwen3, QwQ, DeepSeek-R1 and its distillations) think between `<think>` and
`</think>` before they answer. Their chat templates say so (`template_thinks`: the template
speaks of `</think>`, to drop earlier turns' thinking). Two ways an answer's thinking begins:

- the model opens `<think>` itself (Qwen3, QwQ);
- the prompt opened it (`opens_thinking`: DeepSeek-R1's generation prompt ends in
  `<think>\\n`), so the answer begins inside the thinking and only closes it.

`Thinking.split` cuts an answer into (reasoning, content), as vLLM's reasoning parsers and
DeepSeek's API return `reasoning_content` beside `content`; an answer cut off before
`</think>` is all reasoning. `ThinkingStream` does the same for a stream, piece by piece.
`Thinking.lark` is the grammar of the thinking block, so a grammar over the answer (a forced
tool call: decode/tool_calls.py) lets the model think first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

THINK, UNTHINK = "<think>", "</think>"
SPACE = " \t\n\r"


def template_thinks(template_text: str) -> bool:
    """Whether a chat template is a reasoning model's (it speaks of `</think>`)."""
    return UNTHINK in template_text


def opens_thinking(prompt: str) -> bool:
    """Whether a prompt ends inside a `<think>` block (its answer begins in the thinking)."""
    return prompt.rfind(THINK) > prompt.rfind(UNTHINK)


def held(text: str, mark: str) -> int:
    """The length of `text`'s longest tail that is a proper prefix of `mark` (may begin it): what
    a stream holds back (here and decode/tool_calls.py)."""
    for size in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class Thinking:
    """How an answer's thinking is marked; `opened`: the prompt opened it (`opens_thinking`)."""

    opened: bool = False

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of an answer: the reasoning is the text between the
        marks, the content what follows `</think>` less its leading space."""
        if not self.opened:
            body = text.lstrip(SPACE)
            if not body.startswith(THINK):
                return None, text
            text = body[len(THINK):]
        reasoning, closed, content = text.partition(UNTHINK)
        return reasoning, content.lstrip(SPACE) if closed else ""  # cut off while thinking: no content

    def lark(self) -> tuple[str, list[str]]:
        """(an expression, its lexeme definitions): the Lark of the thinking block an answer may
        begin with (must, where the prompt opened it), and the space after it."""
        closing = UNTHINK.replace("/", "\\/")  # a "/" would end the regex literal
        free = f"/(.|\\n)*/ & ~/(.|\\n)*{closing}(.|\\n)*/"
        tail = f"{json.dumps(UNTHINK)} /[ \\t\\n\\r]*/"
        if self.opened:
            return "THOUGHT", [f"THOUGHT: ({free}) {tail}"]
        return "THOUGHT?", [f"THOUGHT: /[ \\t\\n\\r]*/ {json.dumps(THINK)} ({free}) {tail}"]


class ThinkingStream:
    """A streamed answer's thinking apart from its content (`Thinking.split`, piece by piece):
    `feed` returns (reasoning, content) to send on, holding back text that may be the start
    of a mark; `finish` returns what is left. The pieces add up to `split`'s parts."""

    def __init__(self, thinking: Thinking):
        self.text = ""
        self.state = "inside" if thinking.opened else "start"  # start -> inside -> space -> after
        self.sent = 0  # where the current part's unsent text begins in `text`

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        reasoning = ""
        if self.state == "start":
            body = self.text.lstrip(SPACE)
            if not body or (THINK.startswith(body) and body != THINK):
                return "", ""  # not yet known whether the answer thinks
            thinks = body.startswith(THINK)
            self.state = "inside" if thinks else "after"
            self.sent = len(self.text) - len(body) + len(THINK) if thinks else 0
        if self.state == "inside":
            end = self.text.find(UNTHINK, self.sent)
            if end < 0:
                stop = len(self.text) - held(self.text[self.sent:], UNTHINK)
                reasoning, self.sent = self.text[self.sent:stop], stop
                return reasoning, ""
            reasoning, self.state, self.sent = self.text[self.sent:end], "space", end + len(UNTHINK)
        if self.state == "space":  # the space after </think> is not content
            rest = self.text[self.sent:]
            self.sent += len(rest) - len(rest.lstrip(SPACE))
            if self.sent == len(self.text):
                return reasoning, ""
            self.state = "after"
        content, self.sent = self.text[self.sent:], len(self.text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) not yet sent."""
        if self.state == "start":
            return "", self.text  # only space, or the start of `<think>`: content
        if self.state == "inside":
            return self.text[self.sent:], ""
        return "", self.text[self.sent:]
