"""Hugging Face reward models (ORMs and PRMs) as scorers: `RewardModel`.

Three kinds (reward_heads.py): a sequence-classification ORM (the logit at the last
token), a token-classification PRM (P(label 1) at each step's separator; Qwen2.5-Math-PRM),
and a causal LM PRM (p(+) / (p(+) + p(-)) after each step; Math-Shepherd, RLHFlow). Every
kind keeps the probes' contract (meta/rewards.py): `score_segments(prompt, segments)`
returns one score per segment, read at that segment's end, and `score_batch(items)` scores
many (prompt, segments) in one call. An ORM scores a whole solution as one segment; a PRM
a solution's steps. `score_kind` says what a score is: "logit" (a raw logit, any real) or
"probability" (in [0, 1]); weighted voting weighs a logit by its sigmoid
(meta/scorers.py `vote_weight`).

Tokens: the prompt (rendered by the tokenizer's chat template as the user turn, with the
assistant's generation prompt, when `RewardFormat.chat_template`; else encoded with the
tokenizer's special tokens), then each segment followed by the separator, each encoded on
its own, so a path's tokens extend its parent's (the prefix cache needs that). A step's
score is read at its separator's last token, or with no separator at its own last token.

Bodies: a Llama/Qwen2 body runs on decodekit's engine (reward_engine.py: native forward,
paged KV, prefix cache; siblings share their path's KV), any other through transformers
(reward_hf.py). Both apply the same head to the final norm's states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from decodekit.meta.reward_heads import build_head, num_labels, read_scores, reward_config, score_kind

QWEN_PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class RewardFormat:
    """How (prompt, segments) become tokens, and which tokens a causal LM PRM compares.

    separator: text after every segment, its last token the step's score position (None:
    the segment's own last token). plus / minus: the causal LM PRM's tokens (one token
    each). chat_template: render the prompt as a user turn of the tokenizer's template;
    system: that conversation's system message (with chat_template only).
    Defaults per kind (`default_format`): none of these for sequence and token
    classification and "+"/"-" for a causal LM; Qwen2.5-Math-PRM (`*ForProcessRewardModel`)
    gets its model card's "<extra_0>" separator, chat template and system prompt.
    """

    separator: str | None = None
    plus: str = "+"
    minus: str = "-"
    chat_template: bool = False
    system: str | None = None

    def __post_init__(self):
        if self.separator is not None and (not isinstance(self.separator, str) or not self.separator):
            raise ValueError(f"separator must be a non-empty string or None, got {self.separator!r}")
        for name in ("plus", "minus"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.plus == self.minus:
            raise ValueError(f"plus and minus must differ, got {self.plus!r} for both")
        if self.system is not None and not self.chat_template:
            raise ValueError("system needs chat_template=True (it is the template's system message)")


def default_format(config: dict) -> RewardFormat:
    """The format a model card prescribes, where decodekit knows it (see RewardFormat)."""
    if (config.get("architectures") or [""])[0].endswith("ForProcessRewardModel"):
        return RewardFormat(separator="<extra_0>", chat_template=True, system=QWEN_PRM_SYSTEM)
    return RewardFormat()


class RewardModel:
    """A Hugging Face reward model as a scorer (module docstring)."""

    def __init__(self, path: str | Path, format: RewardFormat | None = None, name: str | None = None,
                 native: bool | None = None):
        """native: run on decodekit's engine (True), through transformers (False), or the
        engine where NativeLM runs the body (None)."""
        from decodekit.meta.reward_engine import EngineScorer, native_reward_lm
        from decodekit.models.checkpoint import load_safetensors, load_tokenizer

        path = Path(path)
        config, self.head = reward_config(path)
        self.name = name or path.name
        self.format = format if format is not None else default_format(config)
        if not isinstance(self.format, RewardFormat):
            raise TypeError(f"format must be a RewardFormat, got {type(self.format).__name__}")
        self.tokenizer = load_tokenizer(path)
        if self.tokenizer is None:
            raise ValueError(f"reward model directory {str(path)!r} has no tokenizer files")
        labels = 2 if self.head == "causal_lm" else num_labels(config)
        self.score_kind = score_kind(self.head, labels)
        # Encodings of texts seen before (a tree scores each prompt and step many times).
        self._piece = lru_cache(maxsize=65536)(self._encode_piece)
        self._prompt = lru_cache(maxsize=4096)(self._prompt_ids)
        self._separator = self._separator_ids()
        pair = self._plus_minus() if self.head == "causal_lm" else None
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"reward model directory {str(path)!r} has no .safetensors weights")
        state = load_safetensors(path)
        head = build_head(state, self.head, pair)
        hidden = config.get("hidden_size")
        first = head if not hasattr(head, "__getitem__") else head[0]
        if hidden is not None and first.in_features != hidden:
            raise ValueError(f"the reward head reads {first.in_features} features, the body's "
                             f"hidden_size is {hidden}")
        model = None
        if native is not False:
            model = native_reward_lm(state, config, head, self.tokenizer, self.name)
        if native and model is None:
            raise ValueError(f"native=True, but NativeLM cannot run {self.name}'s body "
                             f"(model_type {config.get('model_type')!r})")
        if model is not None:
            self.scorer = EngineScorer(model)
        else:
            from decodekit.meta.reward_hf import TransformersScorer

            self.scorer = TransformersScorer(path, head)
        self.native = model is not None

    def _separator_ids(self) -> list[int]:
        separator = self.format.separator
        if separator is None:
            return []
        ids = self.tokenizer.encode(separator, add_special_tokens=False)
        if not ids:
            raise ValueError(f"separator {separator!r} encodes to no tokens with {self.name}'s tokenizer")
        if separator.startswith("<") and separator.endswith(">") and len(ids) != 1:
            raise ValueError(f"separator {separator!r} is not a token of {self.name}'s tokenizer (it "
                             f"encodes to {len(ids)} tokens); pass the model card's step separator")
        return ids

    def _plus_minus(self) -> tuple[int, int]:
        """(minus, plus) token ids: the head's rows, so label 1 is "+"."""
        ids = []
        for name in ("minus", "plus"):
            text = getattr(self.format, name)
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"{name} {text!r} must be one token of {self.name}'s tokenizer, "
                                 f"got ids {encoded}")
            ids.append(encoded[0])
        return ids[0], ids[1]

    def _encode_piece(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's tokens: rendered by the chat template, or with the special tokens."""
        return list(self._prompt(prompt))

    def _prompt_ids(self, prompt: str) -> tuple[int, ...]:
        fmt = self.format
        if fmt.chat_template:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"{self.name}'s tokenizer has no chat template; pass "
                                 "RewardFormat(chat_template=False)")
            messages = ([{"role": "system", "content": fmt.system}] if fmt.system else [])
            messages.append({"role": "user", "content": prompt})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = list(self.tokenizer.encode(prompt))
        if not ids:
            raise ValueError("the prompt must encode to at least one token")
        return tuple(ids)

    def encode(self, prompt: str, segments: Sequence[str]) -> tuple[list[int], list[int], int]:
        """(token ids, each segment's score position, where the last segment starts)."""
        ids = self.prompt_ids(prompt)
        positions, last = [], len(ids)
        for segment in segments:
            piece = list(self._piece(segment))
            if not piece:
                raise ValueError(f"segment {segment!r} encodes to no tokens")
            last = len(ids)
            ids += piece + self._separator
            positions.append(len(ids) - 1)
        return ids, positions, last

    def score_batch(self, items: Sequence[tuple[str, Sequence[str]]]) -> list[list[float]]:
        """Scores of many (prompt, segments): one list per item, one score per segment."""
        encoded = [self.encode(prompt, segments) for prompt, segments in items]
        outputs = self.scorer.head_outputs(encoded)
        return [read_scores(out) if positions else [] for out, (_, positions, _) in zip(outputs, encoded)]

    def score_segments(self, prompt: str, segments: Sequence[str]) -> list[float]:
        """One score per segment, read at its end (module docstring)."""
        return self.score_batch([(prompt, segments)])[0] if segments else []

    def __repr__(self) -> str:
        where = "engine" if self.native else "transformers"
        return f"RewardModel({self.name!r}, head={self.head!r}, score_kind={self.score_kind!r}, {where})"
