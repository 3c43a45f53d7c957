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
from typing import Any, NamedTuple, get_args, get_type_hints

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




class Range(NamedTuple):
    """The values a numeric field allows: low to high, open ends excluded (integers: closed)."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False


# Every numeric field's range, checked by `SamplingParams._validate` and published by the
# server's OpenAPI document (server/extensions.py); None is allowed where the type says so.
RANGES: dict[str, Range] = {
    "max_new_tokens": Range(1),
    "min_new_tokens": Range(0),
    "temperature": Range(0.0),
    "top_k": Range(-1),  # -1 (vLLM's) and 0: off
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "typical_p": Range(0.0, 1.0, low_open=True),
    "epsilon": Range(0.0, 1.0, high_open=True),
    "eta": Range(0.0, 1.0, high_open=True),
    "top_n_sigma": Range(0.0),
    "min_tokens_to_keep": Range(1),
    "mirostat_tau": Range(0.0, low_open=True),
    "mirostat_eta": Range(0.0),
    "xtc_threshold": Range(0.0, 1.0),
    "xtc_probability": Range(0.0, 1.0),
    "dry_multiplier": Range(0.0),
    "dry_base": Range(1.0),
    "dry_allowed_length": Range(1),
    "repetition_penalty": Range(0.0, low_open=True),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "no_repeat_ngram_size": Range(0),
    "seed": Range(0, 2**63 - 1),
    "n": Range(1),
    "logprobs": Range(0, 20),
}

# What each field does, in one line (the server's OpenAPI descriptions).
DESCRIPTIONS: dict[str, str] = {
    "max_new_tokens": "the most tokens to generate",
    "min_new_tokens": "EOS and stop tokens are masked until this many tokens are generated",
    "temperature": "divides the logits; 0 is greedy",
    "top_k": "keep the k most likely tokens; 0 or -1: off",
    "top_p": "nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1: off",
    "min_p": "drop tokens less likely than min_p times the most likely one; 0: off",
    "typical_p": "locally typical sampling's mass; 1: off",
    "epsilon": "epsilon sampling: drop tokens with probability below epsilon; 0: off",
    "eta": "eta sampling's threshold scale; 0: off",
    "top_n_sigma": "keep tokens whose logit is within n standard deviations of the largest; null: off",
    "min_tokens_to_keep": "truncation adapters keep at least this many tokens",
    "mirostat_tau": "Mirostat v2's target surprise in bits; null: off",
    "mirostat_eta": "Mirostat's learning rate",
    "xtc_threshold": "XTC: tokens at least this likely are candidates for exclusion",
    "xtc_probability": "XTC: the chance a step excludes the top candidates; 0: off",
    "dry_multiplier": "DRY repetition penalty's strength; 0: off",
    "dry_base": "DRY's penalty base, raised to the repeat length beyond dry_allowed_length",
    "dry_allowed_length": "DRY: repeats up to this length are not penalised",
    "dry_sequence_breakers": "DRY: strings that end a repeated sequence",
    "repetition_penalty": "divides the logits of tokens already seen (CTRL); 1: off",
    "frequency_penalty": "subtracted per previous occurrence of a token; 0: off",
    "presence_penalty": "subtracted once from every token already seen; 0: off",
    "no_repeat_ngram_size": "forbid repeating any n-gram of this size; 0: off",
    "logit_bias": "token id -> value added to its logit",
    "bad_words": "words never generated: strings, or lists of token ids",
    "allowed_token_ids": "only these token ids may be generated; null: all",
    "stop": "strings that end the text (not included)",
    "stop_token_ids": "token ids that end the text, besides EOS",
    "ignore_eos": "keep generating past EOS",
    "seed": "the random seed; null: random",
    "n": "samples per prompt",
    "logprobs": "log-probabilities of the chosen token and this many alternatives; null: none",
    "entropies": "also return each token's raw entropy and the last step's raw log-probabilities",
    "order": "the adapter chain's order (adapter names, each at most once)",
}

# Fields given as JSON or CLI lists, stored as tuples.
SEQUENCE_FIELDS = ("dry_sequence_breakers", "bad_words", "stop", "stop_token_ids", "order")


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the decoder. Defaults sample at temperature 1, unchanged.

    Off values: top_k=0 (or -1), top_p=1, min_p=0, typical_p=1, epsilon=0, eta=0,
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
    # Each token's raw entropy (Completion.entropies) and the last step's raw log-probs
    # (Completion.final_logprobs): what a probe reward model whose policy is this model reads
    # instead of a second forward (meta/rewards.py).
    entropies: bool = False
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self):
        # Accept lists where tuples are expected (JSON and CLI give lists).
        for name in SEQUENCE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if isinstance(value, list):
                value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
            if not isinstance(value, tuple):
                raise TypeError(f"{name} must be a list, got {value!r:.80}")
            object.__setattr__(self, name, value)
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        self._validate()
        if self.top_k == -1:  # vLLM's "off"
            object.__setattr__(self, "top_k", 0)

    def _validate(self):
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is None and name in NULLABLE_FIELDS:
                continue
            if name in INTEGER_FIELDS:
                check_int(name, value, int(allowed.low), allowed.high)
            else:
                check_range(name, value, *allowed)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        for name in ("ignore_eos", "entropies"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r:.80}")
        for breaker in self.dry_sequence_breakers:
            if not isinstance(breaker, str):
                raise TypeError(f"dry_sequence_breakers must be a list of strings, got {breaker!r:.80}")
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
            if not isinstance(self.allowed_token_ids, tuple):
                raise TypeError(f"allowed_token_ids must be None or a list of token ids, got "
                                f"{self.allowed_token_ids!r:.80}")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or non-empty, got ()")
            for token in self.allowed_token_ids:
                check_int("allowed_token_ids entry", token, 0)
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        for token in self.stop_token_ids:
            check_int("stop_token_ids entry", token, 0)
        unknown = [name for name in self.order if not isinstance(name, str) or name not in ADAPTER_NAMES]
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
        """Token ids given by the user must exist in the model's vocabulary; the error names
        the field that holds them."""
        given = {
            "logit_bias": list(self.logit_bias),
            "bad_words": [t for w in self.bad_words if isinstance(w, tuple) for t in w],
            "allowed_token_ids": list(self.allowed_token_ids or ()),
            "stop_token_ids": list(self.stop_token_ids),
        }
        for name, ids in given.items():
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name} must hold token ids in the vocabulary [0, {vocab_size}), got {bad[:5]}"
                )

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


_TYPES = get_type_hints(SamplingParams)
INTEGER_FIELDS = frozenset(name for name, kind in _TYPES.items() if int in (kind, *get_args(kind)))
NULLABLE_FIELDS = frozenset(name for name, kind in _TYPES.items() if type(None) in get_args(kind))


def preset_values(name: str) -> tuple[float, float]:
    """(temperature, top_p) of the preset `name`; ValueError naming the allowed names."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]
