"""Drafters for speculative decoding, and the rolling cache that target and drafter share.

A drafter proposes up to γ tokens after a context together with the distributions
they were drawn from (REFERENCES.md, "Speculative decoding"):

    drafter.propose(context, num_tokens, sampler) -> Draft(tokens [γ], probs q_1..q_γ [γ, V])

- `ModelDrafter`: any `LanguageModel` over the target's vocabulary (a smaller model of
  the same family, or a k-gram `NGramLM`). Its tokens are drawn through the request's
  own adapter chain (`DraftSampler`), so q is the processed draft distribution.
- Quantised self-draft ("self-int4"): a `ModelDrafter` over the target's own int4 copy
  (`self_draft`; issue 15, item 5). A memory-bound target verifies γ + 1 tokens for about
  the cost of one, and the int4 copy runs its matmuls through the packed int4 kernel
  (models/qlinear.py), about 4x faster than float32 at real shapes; its distribution stays
  close to the target's, so acceptance is high. Round-to-nearest in groups of 32 needs no
  calibration data and is built in a moment; its output head is int8 (one scale per channel):
  at a real vocabulary the head is a small model's largest matrix, and in float it made the
  draft's token cost most of the target's. Pass any `CompressConfig` (GPTQ) to `self_draft`
  for another copy.
- `PromptLookupDrafter`: the tokens that followed the most recent earlier occurrence of
  the context's final n-gram (HF prompt lookup, vLLM and llama.cpp n-gram drafting),
  with a one-hot q. Costs no model call.

Verification is exact for any q as long as q_i is the distribution x_i was actually
drawn from; using the same adapters for draft and target only raises acceptance.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.models.base import LanguageModel, weights_stamp
from decodekit.sampling import SamplerState, select_tokens
from decodekit.sampling.chain import Chain


@dataclass
class Draft:
    """Proposed tokens x_1..x_γ, their distributions q [γ, V] float64 and the model calls spent."""

    tokens: list[int]
    probs: torch.Tensor
    model_calls: int = 0


class Drafter(Protocol):
    def propose(self, context: Sequence[int], num_tokens: int, sampler: DraftSampler) -> Draft: ...


def scratch_state(state: SamplerState) -> SamplerState:
    """A copy of a sampler state whose histories (and mirostat target) can advance over
    hypothetical tokens without touching the original. The random generator is shared on
    purpose: every draw of the request comes from its one seeded stream."""
    scratch = copy.copy(state)
    scratch.select_rows(range(state.num_rows))  # fresh history lists, cloned mu
    return scratch


class DraftSampler:
    """Draws draft tokens the way the request samples: its chain and selector, applied with a
    scratch copy of its state that accepts each drawn token (so history-dependent adapters
    such as penalties see the hypothetical draft tokens)."""

    def __init__(self, chain: Chain, state: SamplerState, vocab_size: int):
        self.chain = chain
        self.state = scratch_state(state)
        self.vocab_size = vocab_size

    def draw(self, raw_logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(token, q [V] float64) from the draft model's raw logits [V]."""
        missing = self.vocab_size - raw_logits.shape[-1]
        if missing > 0:  # a draft vocabulary may be a prefix of the target's: the rest gets p = 0
            raw_logits = torch.cat([raw_logits, raw_logits.new_full((missing,), float("-inf"))])
        processed = self.chain(raw_logits[None].float(), self.state)  # [1, V]
        token = select_tokens(processed, self.state)  # [1]
        self.state.accept(token, processed)
        return int(token), torch.softmax(processed[0].double(), dim=-1)


def empty_draft(vocab_size: int, device: torch.device) -> Draft:
    return Draft([], torch.zeros((0, vocab_size), dtype=torch.float64, device=device))


class IncrementalModel:
    """One cache row of a model that follows a changing token sequence.

    `next_logits(sequence, count)` returns the logits after each of the last `count`
    tokens of `sequence`, running only the tokens the cache does not already hold: the
    cache is cropped back to the longest prefix it shares with `sequence` (rejected draft
    tokens, or another sample of the same prompt) and nothing before it is recomputed.
    """

    def __init__(self, model: LanguageModel):
        if not model.supports_crop:
            raise TypeError(f"model {model.name!r} cannot crop its cache, which rejected drafts need")
        self.model = model
        self.cache = model.new_cache(1)
        self.tokens: list[int] = []  # what the cache holds, position by position
        self.calls = 0

    def next_logits(self, sequence: Sequence[int], count: int) -> torch.Tensor:
        """Logits [count, V] float32 on the model's device predicting sequence[-count + 1:] and
        the token after it. Verification runs where the target's logits are (speculative.py
        `settle_block`); its decisions are read on the host once per block."""
        assert 1 <= count <= len(sequence), (count, len(sequence))
        keep = min(common_prefix(self.tokens, sequence), len(sequence) - count)
        if keep == 0:
            self.cache = self.model.new_cache(1)
        elif keep < len(self.tokens):
            self.cache.crop(keep)
        new = torch.tensor(list(sequence[keep:]), dtype=torch.long, device=self.model.device)[None]  # [1, T]
        logits = self.model.forward(new, self.cache)[0, -count:]  # [count, V]
        self.tokens = list(sequence)
        self.calls += 1
        return logits


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


class ModelDrafter:
    """Draft with a smaller `LanguageModel` over (a prefix of) the target's vocabulary.

    Each proposal feeds the draft model the context tokens its cache lacks (the previous
    block's last draft token and the target's extra token: at most two after the first
    block), then one token per further draft position: γ model calls per block.
    """

    def __init__(self, model: LanguageModel):
        self.model = model
        self.runner = IncrementalModel(model)

    def propose(self, context: Sequence[int], num_tokens: int, sampler: DraftSampler) -> Draft:
        num_tokens = min(num_tokens, self.model.max_context - len(context) + 1)
        if num_tokens <= 0:
            return empty_draft(sampler.vocab_size, self.model.device)
        sequence, probs = list(context), []
        for _ in range(num_tokens):
            logits = self.runner.next_logits(sequence, 1)[0]  # [V]
            token, q = sampler.draw(logits)
            sequence.append(token)
            probs.append(q)
        return Draft(sequence[len(context) :], torch.stack(probs), model_calls=num_tokens)


def sample_drafter(drafter: Drafter) -> Drafter:
    """A drafter for one of several samples that take turns: a model drafter gets its own
    cache row, so the samples do not crop each other's; prompt lookup and user drafters
    (no cache) are shared."""
    return ModelDrafter(drafter.model) if isinstance(drafter, ModelDrafter) else drafter


class PromptLookupDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it, each
    with a one-hot draft distribution. No match: an empty draft (a plain decoding step)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, context: Sequence[int], num_tokens: int) -> list[int]:
        """The up to `num_tokens` tokens that followed the last earlier match, or []."""
        ids = torch.tensor(list(context), dtype=torch.long, device="cpu")  # host: token ids are lists
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ids) <= n or num_tokens <= 0:
                continue
            windows = ids[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram followed by a token
            match = (windows == ids[-n:]).all(dim=-1).nonzero()
            if len(match):
                start = int(match[-1]) + n
                return ids[start : start + num_tokens].tolist()
        return []

    def propose(self, context: Sequence[int], num_tokens: int, sampler: DraftSampler) -> Draft:
        tokens = self.lookup(context, num_tokens)
        # one-hot on the host; verification moves it beside the target's logits
        probs = torch.zeros((len(tokens), sampler.vocab_size), dtype=torch.float64, device="cpu")
        rows = torch.arange(len(tokens), device="cpu")
        probs[rows, torch.tensor(tokens, dtype=torch.long, device="cpu")] = 1.0
        return Draft(tokens, probs)


def check_vocabulary(draft: LanguageModel, target: LanguageModel) -> None:
    """A draft model must speak the target's token ids: the same vocabulary size (or a prefix of
    it), and the same tokenizer where both have one (a character-level k-gram model does not)."""
    problem = None
    if draft.vocab_size > target.vocab_size:
        problem = f"vocab_size {draft.vocab_size} > the target's {target.vocab_size}"
    elif (draft.tokenizer is None) != (target.tokenizer is None) and draft.vocab_size != target.vocab_size:
        problem = f"its own vocabulary of {draft.vocab_size} symbols"
    elif None not in (draft.tokenizer, target.tokenizer) and (
        draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()
    ):
        problem = "a different tokenizer"
    if problem:
        raise ValueError(
            f"draft model {draft.name!r} has {problem}; it must share the target's vocabulary"
        )


SELF_DRAFT = CompressConfig("rtn", bits=4, group_size=32, head_bits=8)


def self_draft(target: LanguageModel, config: CompressConfig = SELF_DRAFT) -> ModelDrafter:
    """A drafter over the target's own quantised copy (module docstring); the target must be
    a float NativeLM, whose float tensors the copy shares. The copy is built once per target
    and config (and again only when the target's weights change: `draft_for`)."""
    from decodekit.models.native import NativeLM

    if not isinstance(target, NativeLM):
        raise ValueError(f"a self-draft needs a NativeLM target, got {type(target).__name__}")
    return ModelDrafter(draft_for(target, ("self", config), lambda: quantized_copy(target, config)))


_DRAFTS_LOCK = threading.Lock()


def draft_for(target: LanguageModel, key: object, build: Callable[[], LanguageModel]) -> LanguageModel:
    """The draft model `key` of `target`, built once and kept on the target (so it lives as
    long as the target does): every call with "self-int4", "auto" or a draft's name gets
    the same model, so the target's engine keeps one member pool for it (members.py), not one
    per call. A target whose weights changed gets a new one."""
    stamp = weights_stamp(target)
    with _DRAFTS_LOCK:
        drafts = target.__dict__.setdefault("_decodekit_drafts", {})
        built_on, draft = drafts.get(key, (None, None))
        if draft is None or built_on != stamp:
            draft = build()
            drafts[key] = (stamp, draft)
        return draft


def make_drafter(draft: object, target: LanguageModel) -> Drafter:
    """A drafter from a `Drafter`, a `LanguageModel`, "prompt-lookup", "self-int4" (the
    target's own int4 copy, `self_draft`), "auto" (the target's embedded draft: registry.py
    `default_draft`, e.g. `shakespeare-draft` for `shakespeare`) or an
    embedded model name / checkpoint directory."""
    if isinstance(draft, str):
        if draft == "prompt-lookup":
            return PromptLookupDrafter()
        if draft == "self-int4":
            return self_draft(target)
        from decodekit.models.registry import default_draft, load_model, resolve

        if draft == "auto":
            draft = default_draft(target.name)
            if draft is None:
                raise ValueError(
                    f"no default draft model for {target.name!r} (no embedded model "
                    f"'{target.name}-draft'); name a draft model or use 'prompt-lookup'"
                )
        name = draft
        # beside the target (an n-gram model runs on the CPU only; verification moves its draft)
        device = "cpu" if resolve(name)[2] == "ngram" else target.device
        draft = draft_for(target, ("model", name), lambda: load_model(name, device=device))
    if isinstance(draft, LanguageModel):
        check_vocabulary(draft, target)
        return ModelDrafter(draft)
    if callable(getattr(draft, "propose", None)):
        return draft  # type: ignore[return-value]
    raise TypeError(
        "draft must be a LanguageModel, a Drafter, 'prompt-lookup', 'self-int4', 'auto' or a model name, "
        f"got {type(draft).__name__}"
    )
