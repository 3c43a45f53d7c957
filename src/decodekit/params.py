"""Per-request sampling parameters.

`SamplingParams` is a small frozen dataclass validated in `__post_init__`: every
bad value raises a `ValueError` (or `TypeError`) that names the field, the value
and what is allowed. The engine configuration lives elsewhere.

The adapter order is explicit (`order`). The default applies penalties and masks
first, then temperature, then truncation, as Hugging Face and vLLM do; llama.cpp
applies temperature last, which a user gets by reordering (REFERENCES.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from decodekit.validate import check_int, check_range

# Names of the adapters a chain can contain, in the default order.
PENALTY_ADAPTERS = (
    "logit_bias",
    "allowed_tokens",
    "bad_words",
    "min_tokens",
    "no_repeat_ngram",
    "repetition_penalty",
    "frequency_presence",
    "dry",
)
TRUNCATION_ADAPTERS = (
    "top_k",
    "top_p",
    "min_p",
    "typical",
    "epsilon",
    "eta",
    "top_n_sigma",
    "xtc",
    "mirostat",
)
DEFAULT_ORDER = PENALTY_ADAPTERS + ("temperature",) + TRUNCATION_ADAPTERS
ADAPTER_NAMES = frozenset(DEFAULT_ORDER)

# Use-case presets: (temperature, top_p). Seed 003 (CS 288, "Sequence Modeling: Generation",
# slide "Inference with Modern LLMs"), whose table cites "ruv, 2023, ChatGPT API
# recommendations"; the seed's row names are in the comments. What they do to the shipped
# model's text: BENCHMARKS.md, "Seeds' remaining claims (issue 17)".
PRESETS: dict[str, tuple[float, float]] = {
    "code-generation": (0.2, 0.1),  # Code Generation
    "creative-writing": (0.7, 0.8),  # Creative Writing
    "chatbot": (0.5, 0.5),  # Chatbot Responses
    "code-comments": (0.3, 0.2),  # Code Comment Generation
    "data-analysis": (0.2, 0.1),  # Data Analysis Scripting
    "exploratory-code": (0.6, 0.7),  # Exploratory Code Writing
}


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the decoder. Defaults sample at temperature 1, unchanged.

    Off values: top_k=0, top_p=1, min_p=0, typical_p=1, epsilon=0, eta=0,
    top_n_sigma=None, mirostat_tau=None, xtc_probability=0, dry_multiplier=0,
    penalties 1 (repetition) or 0 (frequency, presence). temperature=0 is greedy.
    """

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon: float = 0.0
    eta: float = 0.0
    top_n_sigma: float | None = None
    min_tokens_to_keep: int = 1
    mirostat_tau: float | None = None
    mirostat_eta: float = 0.1
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words: tuple[str | tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self):
        # Accept lists where tuples are expected (JSON and CLI give lists).
        for name in ("dry_sequence_breakers", "bad_words", "stop", "stop_token_ids", "order"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if isinstance(value, list):
                value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
            object.__setattr__(self, name, value)
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        self._validate()

    def _validate(self):
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        check_range("temperature", self.temperature, 0.0, math.inf)
        check_int("top_k", self.top_k, 0)
        check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_range("min_p", self.min_p, 0.0, 1.0)
        check_range("typical_p", self.typical_p, 0.0, 1.0, low_open=True)
        check_range("epsilon", self.epsilon, 0.0, 1.0, high_open=True)
        check_range("eta", self.eta, 0.0, 1.0, high_open=True)
        if self.top_n_sigma is not None:
            check_range("top_n_sigma", self.top_n_sigma, 0.0, math.inf)
        check_int("min_tokens_to_keep", self.min_tokens_to_keep, 1)
        if self.mirostat_tau is not None:
            check_range("mirostat_tau", self.mirostat_tau, 0.0, math.inf, low_open=True)
        check_range("mirostat_eta", self.mirostat_eta, 0.0, math.inf)
        check_range("xtc_threshold", self.xtc_threshold, 0.0, 1.0)
        check_range("xtc_probability", self.xtc_probability, 0.0, 1.0)
        check_range("dry_multiplier", self.dry_multiplier, 0.0, math.inf)
        check_range("dry_base", self.dry_base, 1.0, math.inf)
        check_int("dry_allowed_length", self.dry_allowed_length, 1)
        check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, 0)
        if not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            check_int("logit_bias token id", token, 0)
            check_range(f"logit_bias[{token}]", bias, -math.inf, math.inf)
        for word in self.bad_words:
            if not (isinstance(word, str) and word) and not (
                isinstance(word, tuple) and word and all(isinstance(t, int) for t in word)
            ):
                raise ValueError(
                    f"bad_words entries must be non-empty strings or token-id tuples, got {word!r}"
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or non-empty, got ()")
            for token in self.allowed_token_ids:
                check_int("allowed_token_ids entry", token, 0)
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        for token in self.stop_token_ids:
            check_int("stop_token_ids entry", token, 0)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1)
        check_int("n", self.n, 1)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, 20)
        unknown = [name for name in self.order if name not in ADAPTER_NAMES]
        if unknown:
            raise ValueError(
                f"order contains unknown adapters {unknown}; allowed: {sorted(ADAPTER_NAMES)}"
            )
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"order must not repeat an adapter, got {list(self.order)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given by the user must exist in the model's vocabulary."""
        ids = list(self.logit_bias) + list(self.stop_token_ids) + list(self.allowed_token_ids or ())
        ids += [t for w in self.bad_words if isinstance(w, tuple) for t in w]
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"token ids {bad} are outside the vocabulary [0, {vocab_size})")

    def replace(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> SamplingParams:
        """The use case `name`'s temperature and top_p (PRESETS, seed 003); `overrides` win."""
        temperature, top_p = preset_values(name)
        return cls(**{"temperature": temperature, "top_p": top_p, **overrides})

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def preset_values(name: str) -> tuple[float, float]:
    """(temperature, top_p) of the preset `name`; ValueError naming the allowed names."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]
