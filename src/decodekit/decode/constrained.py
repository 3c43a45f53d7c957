"""Constrained decoding through llguidance: JSON schema, regex, Lark grammar, choices.

Seeds 001 and 003 ("Masking out wordtypes", "Compile the schema into a state machine;
filter the next-token distribution for valid tokens"): the constraint is compiled once
into a grammar, and at every step a token mask removes the tokens that cannot continue
it, so the output always parses. The grammar engine is llguidance (used by vLLM, SGLang
and llama.cpp; about 50 us per mask on large vocabularies, REFERENCES.md), not a
hand-written state machine.

- A `Constraint` is a small frozen spec (`JsonSchema`, `Regex`, `Grammar`, `Choices`),
  validated when it is made: a bad schema, regex or grammar, or an empty list of
  choices, is a ValueError before anything is generated.
- `GrammarMask` holds one llguidance matcher per row. The decoders apply its mask first,
  before the request's adapter chain, so every adapter (temperature, top-p, penalties,
  greedy) works on the distribution renormalised over the allowed tokens; after the
  selector it consumes the chosen tokens; rows are forked on `select_rows` (n samples,
  beam search), a row picked twice getting a copy of its matcher.
- EOS is allowed only when the grammar accepts (llguidance puts it in the mask then).
  A row stops with finish_reason "stop" as soon as its grammar is complete (nothing but
  EOS could follow; no EOS token is added), or when it picks EOS where EOS is allowed.
  If max_new_tokens runs out first the row ends with finish_reason "length" and its text
  is an unfinished prefix of a valid output.

Needs the `constrained` extra (`pip install decodekit[constrained]`) and a model with a
fast tokenizer (a tokenizer.json: decodekit's `FastTokenizer` or transformers' fast one)
that llguidance can read: a byte-level one (GPT-2's, Llama 3's, the shipped models') or a
byte-fallback one (Llama 2's); another kind raises `UnreadableTokenizer`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch

from decodekit.models.base import LanguageModel
from decodekit.optional import require
from decodekit.params import SamplingParams
from decodekit.request import MaskBuilder, TokenMask

NEG_INF = float("-inf")


class UnreadableTokenizer(ValueError):
    """llguidance cannot read the model's tokenizer (its decoder is neither byte-level nor
    byte-fallback): the model cannot be constrained, whatever the request asks."""


def _llguidance():
    return require("llguidance", "constrained", "constrained decoding (and token healing)")


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match; subclasses say how to compile it to llguidance."""

    def grammar(self) -> str:
        """The llguidance grammar (a JSON string) of this constraint."""
        raise NotImplementedError

    def _check(self, what: str) -> None:
        error = _llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            # llguidance's message spans lines (a source excerpt with a caret): keep the
            # first line, which has the position, and the "error: ..." detail, on one line.
            lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
            detail = [line for line in lines[1:] if line.startswith("error:")]
            raise ValueError(f"invalid {what}: " + " ".join(lines[:1] + detail))


@dataclass(frozen=True)
class JsonSchema(Constraint):
    """A JSON value valid under `schema` (a dict, or its JSON text).

    whitespace_flexible=False (the default) emits compact JSON (no whitespace between
    tokens, "," and ":" separators), which keeps outputs short; True allows any JSON
    whitespace. A schema's own "x-guidance" options override this.
    """

    schema: dict[str, Any] | str | bool
    whitespace_flexible: bool = False

    def __post_init__(self):
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"JSON schema text is not valid JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise TypeError(f"a JSON schema must be a dict (or true/false), got {schema!r:.80}")
        object.__setattr__(self, "schema", schema)
        self._check("JSON schema")

    def grammar(self) -> str:
        defaults = {"whitespace_flexible": self.whitespace_flexible}
        return _llguidance().LLMatcher.grammar_from_json_schema(self.schema, defaults=defaults)


@dataclass(frozen=True)
class Regex(Constraint):
    """Text fully matched by `pattern` (Rust `regex` syntax, anchored at both ends)."""

    pattern: str

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise TypeError(f"a regex must be a string, got {self.pattern!r:.80}")
        self._check(f"regex {self.pattern!r}")

    def grammar(self) -> str:
        return _llguidance().LLMatcher.grammar_from_regex(self.pattern)


@dataclass(frozen=True)
class Grammar(Constraint):
    """Text derived from the `start` rule of a context-free grammar in (llguidance's) Lark syntax."""

    lark: str

    def __post_init__(self):
        if not isinstance(self.lark, str) or not self.lark.strip():
            raise ValueError(f"a grammar must be non-empty Lark text, got {self.lark!r:.80}")
        self._check("Lark grammar")

    def grammar(self) -> str:
        return _llguidance().LLMatcher.grammar_from_lark(self.lark)


@dataclass(frozen=True)
class Choices(Constraint):
    """Exactly one of `options` (non-empty strings)."""

    options: tuple[str, ...]

    def __post_init__(self):
        options = self.options
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise TypeError(f"choices must be a list of strings, got {options!r:.80}")
        options = tuple(options)
        if not options:
            raise ValueError("choices must contain at least one option, got []")
        bad = [o for o in options if not isinstance(o, str) or not o]
        if bad:
            raise ValueError(f"every choice must be a non-empty string, got {bad[:3]}")
        object.__setattr__(self, "options", options)
        self._check("choices")

    def grammar(self) -> str:
        # Lark string literals take JSON's escapes (llguidance's own "choice" format does this).
        lark = "start: " + " | ".join(json.dumps(option) for option in self.options)
        return _llguidance().LLMatcher.grammar_from_lark(lark)


# llguidance tokenizers are built once per Hugging Face tokenizer object (about a second on
# large vocabularies); keyed weakly so a dropped model frees its entry.
_TOKENIZERS: WeakKeyDictionary = WeakKeyDictionary()


def ll_tokenizer(model: LanguageModel):
    """The llguidance tokenizer of `model` (cached): its vocabulary width and EOS ids."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise TypeError(f"model {model.name!r} has no tokenizer; constraints need one")
    key = (model.vocab_size, tuple(model.eos_token_ids))
    per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        if not model.eos_token_ids:
            raise ValueError(f"model {model.name!r} has no EOS token; constraints need one")
        llg = require("llguidance", "constrained", "constrained decoding (and token healing)")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"model {model.name!r}: constraints need a fast tokenizer (tokenizer.json)")
        # What llguidance.hf.from_tokenizer does, without its import of transformers: the Rust
        # tokenizer serialised (with transformers' added tokens), unpadded and untruncated.
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        try:
            per_tokenizer[key] = llg.LLTokenizer(backend.to_str(), n_vocab=model.vocab_size,
                                                 eos_token=list(model.eos_token_ids))  # fmt: skip
        except ValueError as error:
            raise UnreadableTokenizer(
                f"model {model.name!r}: llguidance cannot read its tokenizer.json ({error}); constrained "
                "decoding needs a byte-level or byte-fallback tokenizer") from None
    return per_tokenizer[key]


class GrammarMask:
    """One llguidance matcher per row of a request (n samples, or beams)."""

    def __init__(self, model: LanguageModel, constraint: Constraint, num_rows: int):
        if not isinstance(constraint, Constraint):
            raise TypeError(
                f"constraint must be a JsonSchema, Regex, Grammar or Choices, got {constraint!r:.80}"
            )
        llg = _llguidance()
        first = llg.LLMatcher(ll_tokenizer(model), constraint.grammar(), log_level=0)
        if first.is_error():
            raise ValueError(f"constraint cannot be compiled: {first.get_error()}")
        self.matchers = [first]
        self.vocab_size = model.vocab_size
        self.words = (model.vocab_size + 31) // 32  # llguidance packs 32 tokens per int32
        if not self.can_begin():
            raise ValueError(f"constraint allows no token of model {model.name!r}'s vocabulary to begin "
                             "with: the vocabulary cannot write what the grammar requires first")
        self.matchers += [first.deep_copy() for _ in range(num_rows - 1)]

    def can_begin(self) -> bool:
        """Whether some token of the vocabulary can begin the output. Where none can (arith's 37
        characters cannot write a JSON object's "{"), llguidance's mask still lets the unknown
        token through and its matcher then refuses it, so the allowed tokens are tried, each on
        a copy (the first succeeds wherever the mask is right)."""
        allowed = self.allowed()[0].nonzero().flatten().tolist()
        return any(self.matchers[0].deep_copy().consume_token(token) for token in allowed)

    def allowed(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """Which tokens each row may take next: [R, V] bool on `device`. The grammar runs on
        the host, which writes the packed mask (V / 32 words a row); only that is copied, and
        unpacked beside the logits."""
        bitmask = torch.zeros((len(self.matchers), self.words), dtype=torch.int32, device="cpu")  # [R, W]
        for row, matcher in enumerate(self.matchers):
            matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), self.words * 4)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits = (bitmask.to(device)[:, :, None] >> shifts) & 1  # [R, W, 32], bit i of word w = token 32w+i
        return bits.flatten(1)[:, : self.vocab_size].bool()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf on the tokens the grammar does not allow: [R, V] -> [R, V]."""
        return logits.masked_fill(~self.allowed(logits.device), NEG_INF)

    def accept(self, tokens: torch.Tensor | Sequence[int]) -> None:
        """Advance each row's matcher by its chosen token [R] (a tensor or host ints)."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        for matcher, token in zip(self.matchers, ids, strict=True):
            if not matcher.consume_token(int(token)):
                raise ValueError(
                    f"token {token} breaks the constraint ({matcher.get_error()}); the sampling "
                    "adapters removed every token the constraint allows (bad_words, "
                    "allowed_token_ids or stop tokens that exclude the grammar's only ways on?)"
                )

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep and reorder rows; a row taken again gets its own copy of the matcher."""
        taken: set[int] = set()
        matchers = []
        for r in rows:
            matchers.append(self.matchers[r].deep_copy() if r in taken else self.matchers[r])
            taken.add(r)
        self.matchers = matchers

    def is_complete(self, row: int) -> bool:
        """Whether the row's grammar is finished: nothing but EOS can follow."""
        return self.matchers[row].is_stopped()

    def completes(self, row: int, token: int) -> bool:
        """Whether taking `token` (an allowed one) would finish the row's grammar."""
        matcher = self.matchers[row]
        if not matcher.consume_token(token):
            raise AssertionError(f"token {token} is not allowed: {matcher.get_error()}")
        done = matcher.is_stopped()
        matcher.rollback(1)
        return done


def token_mask(
    model: LanguageModel,
    prompt_ids: Sequence[int],
    num_rows: int,
    constraint: Constraint | None = None,
    heal: bool | int = False,
    ignore_eos: bool = False,
) -> tuple[TokenMask | None, list[int], Callable[[Sequence[int]], str]]:
    """A request's token mask (or None), its prompt ids and how its generated ids read as text.

    The decoders call this once per request, before generating: every error of the
    constraint or the healing is raised here.
    """
    from decodekit.decode.healing import heal_prompt  # healing builds on this module

    if constraint is None and not heal:
        return None, list(prompt_ids), model.decode
    if constraint is None:
        return heal_prompt(model, prompt_ids, num_rows, heal)
    if heal:
        raise ValueError(
            "heal cannot be combined with a constraint: the healed bytes belong to the prompt, "
            "not to the constrained text"
        )
    if ignore_eos:
        raise ValueError(
            "ignore_eos cannot be combined with a constraint: EOS is how an accepting grammar ends"
        )
    return GrammarMask(model, constraint, num_rows), list(prompt_ids), model.decode


def mask_builder(constraint: Constraint | None = None, heal: bool | int = False) -> MaskBuilder | None:
    """`make_requests`' masks for a constraint or token healing; None when there is neither."""
    if constraint is None and not heal:
        return None

    def masks(model: LanguageModel, prompt_ids: list[int], params: SamplingParams):
        return token_mask(model, prompt_ids, params.n, constraint, heal, params.ignore_eos)

    return masks
