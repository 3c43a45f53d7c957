"""The chain's adapters, each a class that declares what the rest of the package derives.

An adapter class names itself (`name`, its place in `params.DEFAULT_ORDER`), the
SamplingParams fields it reads (`fields`, every one besides `min_tokens_to_keep`: the lab's
editor shows them, and the row-wise key compares them), and three properties:

- `reads_history`: its output depends on the rows' tokens so far or on state updated by
  `SamplerState.accept` (mirostat's mu). Speculative decoding then processes a block's
  positions one by one (decode/speculative.py `history_free`), else all at once; a wrong
  False makes speculative decoding inexact (tests/sampling/test_adapters.py checks it
  against behaviour).
- `rowwise`: a function of each row's logits and its `fields` alone (no history, no random
  draw), so requests with equal settings share one chain call (chain.py `rowwise_key`).
- `index_free`: blind to which tokens the logits belong to beyond their order, and to tokens
  at -inf: tokens at -inf inserted anywhere into a row leave the other tokens' output as it
  was (and stay at -inf). The chain then runs it on the few tokens a top-k, top-p or min-p
  before it keeps (their `truncate(logits)`: those tokens' logits and ids where every row
  can say cheaply, else the adapter's output itself), in the vocabulary's order, rather than
  on the whole vocabulary (chain.py `build_chain`).

`active(params)` says whether the request's values switch it on (off values leave it out of
the chain); an instance, built once per request, is `(logits [R, V], state) -> logits`. The
maths lives in processors.py (pure functions); a field's range, description, CLI flag and
server exposure are declared on the SamplingParams field (params.py `option`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from decodekit.params import DEFAULT_ORDER, SamplingParams
from decodekit.sampling import processors as P

if TYPE_CHECKING:
    from decodekit.sampling.chain import SamplerState


class Adapter(ABC):
    """One stage of a request's chain (module docstring)."""

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]
    reads_history: ClassVar[bool] = False
    rowwise: ClassVar[bool] = False
    index_free: ClassVar[bool] = False

    def __init__(self, params: SamplingParams, tokenizer: Any = None):
        self.params = params

    @staticmethod
    @abstractmethod
    def active(params: SamplingParams) -> bool:
        """Whether the request's values switch this adapter on."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, state: SamplerState) -> torch.Tensor:  # [R, V] -> [R, V]
        """The processed logits."""


# -- penalties and masks ---------------------------------------------------------------------


class LogitBias(Adapter):
    name, fields, rowwise = "logit_bias", ("logit_bias",), True
    active = staticmethod(lambda p: bool(p.logit_bias))

    def __call__(self, logits, state):
        return P.logit_bias(logits, self.params.logit_bias)


class AllowedTokens(Adapter):
    name, fields, rowwise = "allowed_tokens", ("allowed_token_ids",), True
    active = staticmethod(lambda p: p.allowed_token_ids is not None)

    def __call__(self, logits, state):
        return P.allowed_tokens(logits, self.params.allowed_token_ids)


class BadWords(Adapter):
    name, fields, reads_history = "bad_words", ("bad_words",), True
    active = staticmethod(lambda p: bool(p.bad_words))

    def __init__(self, params: SamplingParams, tokenizer: Any = None):
        super().__init__(params, tokenizer)
        self.sequences = bad_word_sequences(params.bad_words, tokenizer)

    def __call__(self, logits, state):
        return P.bad_words(logits, state.contexts(), self.sequences)


class MinTokens(Adapter):
    name, fields, reads_history = "min_tokens", ("min_new_tokens",), True
    active = staticmethod(lambda p: p.min_new_tokens > 0)

    def __call__(self, logits, state):
        counts = [len(g) for g in state.generated]
        return P.min_tokens(logits, counts, self.params.min_new_tokens, state.stop_token_ids)


class NoRepeatNgram(Adapter):
    name, fields, reads_history = "no_repeat_ngram", ("no_repeat_ngram_size",), True
    active = staticmethod(lambda p: p.no_repeat_ngram_size > 0)

    def __call__(self, logits, state):
        return P.no_repeat_ngram(logits, state.contexts(), self.params.no_repeat_ngram_size)


class RepetitionPenalty(Adapter):
    name, fields, reads_history = "repetition_penalty", ("repetition_penalty",), True
    active = staticmethod(lambda p: p.repetition_penalty != 1.0)

    def __call__(self, logits, state):
        return P.repetition_penalty(logits, state.contexts(), self.params.repetition_penalty)


class FrequencyPresence(Adapter):
    name, fields, reads_history = "frequency_presence", ("frequency_penalty", "presence_penalty"), True
    active = staticmethod(lambda p: p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)

    def __call__(self, logits, state):
        p = self.params
        return P.frequency_presence(logits, state.generated, p.frequency_penalty, p.presence_penalty)


class Dry(Adapter):
    name, fields, reads_history = "dry", ("dry_multiplier", "dry_base", "dry_allowed_length"), True
    active = staticmethod(lambda p: p.dry_multiplier > 0)

    def __init__(self, params: SamplingParams, tokenizer: Any = None):
        super().__init__(params, tokenizer)
        self.breakers = dry_breakers(params.dry_sequence_breakers, tokenizer)

    def __call__(self, logits, state):
        p = self.params
        return P.dry(logits, state.contexts(), p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                     self.breakers)  # fmt: skip


# -- temperature and truncation --------------------------------------------------------------


class Temperature(Adapter):
    name, fields, rowwise = "temperature", ("temperature",), True
    index_free = True
    active = staticmethod(lambda p: p.temperature != 1.0)

    def __call__(self, logits, state):
        return P.temperature(logits, self.params.temperature)


class TopK(Adapter):
    name, fields, rowwise = "top_k", ("top_k",), True
    index_free = True
    active = staticmethod(lambda p: p.top_k > 0)

    def __call__(self, logits, state):
        return P.top_k(logits, self.params.top_k, self.params.min_tokens_to_keep)

    def truncate(self, logits):
        return P.top_k_kept(logits, self.params.top_k, self.params.min_tokens_to_keep)


class TopP(Adapter):
    name, fields, rowwise = "top_p", ("top_p",), True
    index_free = True
    active = staticmethod(lambda p: p.top_p < 1.0)

    def __call__(self, logits, state):
        return P.top_p(logits, self.params.top_p, self.params.min_tokens_to_keep)

    def truncate(self, logits):
        return P.top_p_kept(logits, self.params.top_p, self.params.min_tokens_to_keep)


class MinP(Adapter):
    name, fields, rowwise = "min_p", ("min_p",), True
    index_free = True
    active = staticmethod(lambda p: p.min_p > 0.0)

    def __call__(self, logits, state):
        return P.min_p(logits, self.params.min_p, self.params.min_tokens_to_keep)

    def truncate(self, logits):
        return P.min_p_kept(logits, self.params.min_p, self.params.min_tokens_to_keep)


class Typical(Adapter):
    name, fields, rowwise = "typical", ("typical_p",), True
    index_free = True
    active = staticmethod(lambda p: p.typical_p < 1.0)

    def __call__(self, logits, state):
        return P.typical(logits, self.params.typical_p, self.params.min_tokens_to_keep)


class Epsilon(Adapter):
    name, fields, rowwise = "epsilon", ("epsilon",), True
    index_free = True
    active = staticmethod(lambda p: p.epsilon > 0.0)

    def __call__(self, logits, state):
        return P.epsilon(logits, self.params.epsilon, self.params.min_tokens_to_keep)


class Eta(Adapter):
    name, fields, rowwise = "eta", ("eta",), True
    index_free = True
    active = staticmethod(lambda p: p.eta > 0.0)

    def __call__(self, logits, state):
        return P.eta(logits, self.params.eta, self.params.min_tokens_to_keep)


class TopNSigma(Adapter):
    name, fields, rowwise = "top_n_sigma", ("top_n_sigma",), True
    index_free = True
    active = staticmethod(lambda p: p.top_n_sigma is not None)

    def __call__(self, logits, state):
        return P.top_n_sigma(logits, self.params.top_n_sigma, self.params.min_tokens_to_keep)


class Xtc(Adapter):
    # Draws from the request's generator: not row-wise, but one draw per row whatever the
    # history, so a block's positions may run at once (they draw in the same order).
    name, fields = "xtc", ("xtc_threshold", "xtc_probability")
    index_free = True
    active = staticmethod(lambda p: p.xtc_probability > 0.0)

    def __call__(self, logits, state):
        p = self.params
        return P.xtc(logits, p.xtc_threshold, p.xtc_probability, state.generator, p.min_tokens_to_keep)


class Mirostat(Adapter):
    # Its target mu moves with every accepted token (SamplerState.accept).
    name, fields, reads_history = "mirostat", ("mirostat_tau", "mirostat_eta"), True
    index_free = True
    active = staticmethod(lambda p: p.mirostat_tau is not None)

    def __call__(self, logits, state):
        return P.mirostat(logits, state.mu, self.params.min_tokens_to_keep)


# Every adapter class by name, in DEFAULT_ORDER: a subclass of Adapter above is one (a name
# in DEFAULT_ORDER without a class is a KeyError here; tests/sampling/test_adapters.py checks both ways).
_CLASSES = {cls.name: cls for cls in Adapter.__subclasses__()}
ADAPTERS: dict[str, type[Adapter]] = {name: _CLASSES[name] for name in DEFAULT_ORDER}


def active_adapters(params: SamplingParams) -> list[type[Adapter]]:
    """The adapters `params` switches on, in `params.order`: a request's chain."""
    return [ADAPTERS[name] for name in params.order if ADAPTERS[name].active(params)]


# -- what adapters precompute from the tokenizer -------------------------------------------------


def bad_word_sequences(
    words: Sequence[str | tuple[int, ...]], tokenizer: Any = None
) -> list[tuple[int, ...]]:
    """Token sequences to ban. Text is tokenised without special tokens, alone and (as vLLM
    does) after a space when that gives a different word token of the same length."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        if not isinstance(word, str):
            sequences.append(tuple(word))
            continue
        if tokenizer is None:
            raise TypeError(
                f"bad_words entry {word!r} is text, which needs a model with a tokenizer; "
                "give token-id tuples instead"
            )
        plain = _encode(tokenizer, word)
        spaced = _encode(tokenizer, " " + word.lstrip())
        sequences += [plain] if plain else []
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    return list(dict.fromkeys(sequences))


def dry_breakers(breakers: Sequence[str], tokenizer: Any = None) -> P.DryBreakers:
    """DRY sequence breakers with the text of every token, so that `P.dry` matches them on
    the context's text across token boundaries. Without a tokenizer there are none."""
    if tokenizer is None or not any(breakers):
        return P.DryBreakers()
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return P.DryBreakers.from_texts(breakers, texts)


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))
