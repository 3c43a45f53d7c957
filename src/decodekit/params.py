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
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, NamedTuple, get_args, get_origin, get_type_hints

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


# What truncate_prompt_tokens allows (vLLM's rule), in every message that refuses a value.
TRUNCATE_RULE = "truncate_prompt_tokens must be an integer >= 1, or -1 (the model's context)"


class Range(NamedTuple):
    """The values a numeric field allows: low to high, open ends excluded (integers: closed)."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False


def option(
    default: Any = MISSING,
    description: str = "",
    allowed: Range | None = None,
    flag: str | None = None,
    extension: bool = False,
    factory: Any = MISSING,
) -> Any:
    """A SamplingParams field with everything the surfaces derive from it: `description` (one
    line: the server's OpenAPI document and docs/server.md), `allowed` (a number's range,
    checked by `_validate`, published by the server), `flag` (the help of `decodekit generate`'s
    flag of the same name, cli/generate.py; None: no plain flag) and `extension` (a typed
    request field the server adds to OpenAI's, server/extensions.py)."""
    spec = {"description": description, "range": allowed, "flag": flag, "extension": extension}
    return field(default=default, default_factory=factory, metadata=spec)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the decoder. Defaults sample at temperature 1, unchanged.

    Off values: top_k=0 (or -1), top_p=1, min_p=0, typical_p=1, epsilon=0, eta=0,
    top_n_sigma=None, mirostat_tau=None, xtc_probability=0, dry_multiplier=0,
    penalties 1 (repetition) or 0 (frequency, presence). temperature=0 is greedy.
    Each field declares its description, range, CLI flag and server exposure (`option`).
    """

    max_new_tokens: int = option(
        64, "the most tokens to generate", Range(1), flag="most tokens generated per sample (default 64)")
    min_new_tokens: int = option(
        0, "EOS and stop tokens are masked until this many tokens are generated", Range(0),
        flag="EOS and stop tokens masked until this many (default 0)", extension=True)
    temperature: float = option(
        1.0, "divides the logits; 0 is greedy", Range(0.0),
        flag="divide the logits by T; 0 is greedy (default 1)")
    top_k: int = option(
        0, "keep the k most likely tokens; 0 or -1: off", Range(-1),  # -1 (vLLM's) and 0: off
        flag="keep the K most likely tokens; 0 is off (default)", extension=True)
    top_p: float = option(
        1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1: off",
        Range(0.0, 1.0, low_open=True),
        flag="nucleus: the smallest set with probability >= P, in (0, 1]; 1 is off (default)")
    min_p: float = option(
        0.0, "drop tokens less likely than min_p times the most likely one; 0: off", Range(0.0, 1.0),
        flag="drop tokens below P times the top probability; 0 is off (default)", extension=True)
    typical_p: float = option(
        1.0, "locally typical sampling's mass; 1: off", Range(0.0, 1.0, low_open=True),
        flag="locally typical sampling's mass, in (0, 1]; 1 is off (default)", extension=True)
    epsilon: float = option(
        0.0, "epsilon sampling: drop tokens with probability below epsilon; 0: off",
        Range(0.0, 1.0, high_open=True),
        flag="drop tokens with probability below E, in [0, 1); 0 is off (default)", extension=True)
    eta: float = option(
        0.0, "eta sampling's threshold scale; 0: off", Range(0.0, 1.0, high_open=True),
        flag="eta sampling's entropy-scaled cut, in [0, 1); 0 is off (default)", extension=True)
    top_n_sigma: float | None = option(
        None, "keep tokens whose logit is within n standard deviations of the largest; null: off",
        Range(0.0), flag="keep logits within N standard deviations of the top one (default off)",
        extension=True)
    min_tokens_to_keep: int = option(
        1, "truncation adapters keep at least this many tokens", Range(1),
        flag="every truncation keeps at least this many tokens (default 1)", extension=True)
    mirostat_tau: float | None = option(
        None, "Mirostat v2's target surprise in bits; null: off", Range(0.0, low_open=True),
        flag="mirostat v2's target surprise in bits (default off)", extension=True)
    mirostat_eta: float = option(
        0.1, "Mirostat's learning rate", Range(0.0), flag="mirostat's learning rate (default 0.1)",
        extension=True)
    xtc_threshold: float = option(
        0.1, "XTC: tokens at least this likely are candidates for exclusion", Range(0.0, 1.0),
        flag="XTC: tokens above this probability may be excluded (default 0.1)", extension=True)
    xtc_probability: float = option(
        0.0, "XTC: the chance a step excludes the top candidates; 0: off", Range(0.0, 1.0),
        flag="XTC: chance per step of excluding them; 0 is off (default)", extension=True)
    dry_multiplier: float = option(
        0.0, "DRY repetition penalty's strength; 0: off", Range(0.0),
        flag="DRY repetition penalty's strength; 0 is off (default)", extension=True)
    dry_base: float = option(
        1.75, "DRY's penalty base, raised to the repeat length beyond dry_allowed_length", Range(1.0),
        flag="DRY's base, >= 1 (default 1.75)", extension=True)
    dry_allowed_length: int = option(
        2, "DRY: repeats up to this length are not penalised", Range(1),
        flag="DRY: repeats up to this length are free (default 2)", extension=True)
    dry_sequence_breakers: tuple[str, ...] = option(
        ("\n", ":", '"', "*"), "DRY: strings that end a repeated sequence", extension=True)
    repetition_penalty: float = option(
        1.0, "divides the logits of tokens already seen (CTRL); 1: off", Range(0.0, low_open=True),
        flag="divide the logits of seen tokens by this (CTRL); 1 is off (default)", extension=True)
    frequency_penalty: float = option(
        0.0, "subtracted per previous occurrence of a token; 0: off", Range(-2.0, 2.0),
        flag="subtract this times a token's count so far, in [-2, 2] (default 0)")
    presence_penalty: float = option(
        0.0, "subtracted once from every token already seen; 0: off", Range(-2.0, 2.0),
        flag="subtract this from every token seen so far, in [-2, 2] (default 0)")
    no_repeat_ngram_size: int = option(
        0, "forbid repeating any n-gram of this size; 0: off", Range(0),
        flag="never repeat an n-gram of this size; 0 is off (default)", extension=True)
    logit_bias: dict[int, float] = option(description="token id -> value added to its logit", factory=dict)
    bad_words: tuple[str | tuple[int, ...], ...] = option(
        (), "words never generated: strings, or lists of token ids", extension=True)
    allowed_token_ids: tuple[int, ...] | None = option(
        None, "only these token ids may be generated; null: all", extension=True)
    stop: tuple[str, ...] = option((), "strings that end the text (not included)")
    stop_token_ids: tuple[int, ...] = option((), "token ids that end the text, besides EOS", extension=True)
    ignore_eos: bool = option(False, "keep generating past EOS", extension=True)
    # vLLM's field of the same name and meaning (its `_validate_truncation_size`): the prompt is
    # tokenised whole, then cut on the left; a prompt cut to the whole context leaves no room
    # to generate, so -1 helps only a prompt that then fits (request.py `kept_tokens`).
    truncate_prompt_tokens: int | None = option(
        None, "keep only the prompt's last k tokens, k >= 1 (left truncation, as vLLM); -1: the model's "
        "context; null: the whole prompt", Range(-1), extension=True)
    seed: int | None = option(
        None, "the random seed; null: random", Range(0, 2**63 - 1),
        flag="the samples' random seed (default: unseeded)")
    n: int = option(1, "samples per prompt", Range(1))
    logprobs: int | None = option(
        None, "log-probabilities of the chosen token and this many alternatives; null: none", Range(0, 20),
        flag="with --json: the top K alternatives' log-probabilities per token, 0..20")
    # Each token's raw entropy (Completion.entropies) and the last step's raw log-probs
    # (Completion.final_logprobs): what a probe reward model whose policy is this model reads
    # instead of a second forward (meta/rewards.py).
    entropies: bool = option(
        False, "also return each token's raw entropy and the last step's raw log-probabilities")
    order: tuple[str, ...] = option(
        DEFAULT_ORDER, "the adapter chain's order (adapter names, each at most once)", extension=True)

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
        if self.truncate_prompt_tokens == 0:
            raise ValueError(TRUNCATE_RULE + ", got 0")
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


_SPECS = {f.name: f.metadata for f in fields(SamplingParams)}
# Every numeric field's range, checked by `SamplingParams._validate` and published by the
# server's OpenAPI document (server/extensions.py); None is allowed where the type says so.
RANGES: dict[str, Range] = {name: spec["range"] for name, spec in _SPECS.items() if spec["range"]}
# What each field does, in one line (the server's OpenAPI descriptions).
DESCRIPTIONS: dict[str, str] = {name: spec["description"] for name, spec in _SPECS.items()}
# Fields with a plain `decodekit generate` flag: name -> the flag's help.
FLAGS: dict[str, str] = {name: spec["flag"] for name, spec in _SPECS.items() if spec["flag"]}
# Fields a server request sets by their own name besides OpenAI's (server/extensions.py).
EXTENSION_FIELDS = tuple(name for name, spec in _SPECS.items() if spec["extension"])
_TYPES = get_type_hints(SamplingParams)
# Fields given as JSON or CLI lists, stored as tuples (allowed_token_ids, also None, apart).
SEQUENCE_FIELDS = tuple(name for name, kind in _TYPES.items() if get_origin(kind) is tuple)
INTEGER_FIELDS = frozenset(name for name, kind in _TYPES.items() if int in (kind, *get_args(kind)))
NULLABLE_FIELDS = frozenset(name for name, kind in _TYPES.items() if type(None) in get_args(kind))


def preset_values(name: str) -> tuple[float, float]:
    """(temperature, top_p) of the preset `name`; ValueError naming the allowed names."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]
