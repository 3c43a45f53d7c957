"""The `LanguageModel` contract every model implements (ARCHITECTURE.md).

A model scores token ids: `forward(tokens [B, T], cache, mask) -> logits [B, T, V]`
returns float32 logits for every position and grows the cache by T. Rows of one
batch may hold prompts of different lengths: they are left-padded and `mask`
marks the real tokens, so padding is never attended to and never advances a
row's positions.

A cache is the model's own object with three operations:
- `fork(rows)`   a new cache whose row i continues row `rows[i]` of this one
                 (copy-on-write where the model supports it);
- `select(rows)` in place: keep and reorder rows (beam search);
- `crop(length)` in place: roll every row back to `length` positions
                 (speculative decoding after rejected draft tokens).

A model declares what it supports beyond that as capabilities (class attributes), and the
code that picks an execution path reads them, never the model's class:
- `supports_paged_kv`  runs on the paged engine (engine/: KV blocks, copy-on-write
                       fork, prefix cache); False: the plain loop (decode/sample.py);
- `supports_fork`      its cache forks and selects rows (n samples, beam search);
- `supports_crop`      its cache crops (speculative decoding's rollback).
Every model here forks, selects and crops its cache, so the last two default to True.

A model that combines others (decode/contrastive.py's `ContrastiveLM`: an expert and an
amateur) may run on one of their engines instead of the plain loop, through one optional
hook, read by decode/sample.py and decode/beam.py beside `supports_paged_kv`:
- `engine_programs(requests)`  (the model whose engine runs them, the requests as programs
                       (engine/program.py)), or None (the default): the plain loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


class Cache(ABC):
    """Per-row key/value state of a model. `length` counts positions, padding included."""

    @property
    @abstractmethod
    def length(self) -> int: ...

    @abstractmethod
    def fork(self, rows: Sequence[int]) -> Cache: ...

    @abstractmethod
    def select(self, rows: Sequence[int]) -> None: ...

    @abstractmethod
    def crop(self, length: int) -> None: ...


class LanguageModel(ABC):
    """A causal language model over token ids.

    Attributes: `name`, `vocab_size`, `eos_token_ids`, `tokenizer` (transformers' fast
    tokenizer surface: models/tokenizer.py's FastTokenizer or transformers' own; None for
    models with their own `encode`/`decode`) and
    `max_context` (positions the model can attend over); capabilities as in the module
    docstring.
    """

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any | None
    max_context: int
    device: torch.device = torch.device("cpu")  # where its logits are; a model on another sets its own
    supports_paged_kv: bool = False
    supports_fork: bool = True
    supports_crop: bool = True

    @abstractmethod
    def new_cache(self, batch_size: int) -> Cache:
        """An empty cache for `batch_size` rows."""

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, cache: Cache, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V] float32 for tokens [B, T] (long); `mask` [B, T] bool marks real tokens."""

    def hidden_states(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's hidden state after the final norm (what the LM head reads),
        [B, T, hidden] float32, at every position of tokens [B, T] on a fresh cache (`mask`
        as in `forward`). A model that does not expose its states raises TypeError."""
        raise TypeError(f"model {self.name!r} ({type(self).__name__}) does not expose hidden states")

    def engine_programs(self, requests: list) -> tuple[LanguageModel, list] | None:
        """How a model without paged KV of its own runs `requests` (request.py's sampling
        requests, or decode/beam.py's `BeamSearch`es) on another model's engine: (that model,
        one program per request), or None: the plain loop."""
        return None

    def num_parameters(self) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise TypeError(f"model {self.name!r} has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""  # a model over raw ids has no text; its completions carry token_ids
        # No clean-up of spaces: decoding a longer list must extend the shorter one's text.
        # A fast tokenizer's Rust backend does exactly that, without the Python wrapper's cost.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (for display; may be a partial character)."""
        return self.decode([token_id])


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to one tensor on `device` (built on the host, copied once).
    Returns tokens [B, T] long and mask [B, T] bool."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    width = max(len(p) for p in prompts)
    rows = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    seen = [[False] * (width - len(p)) + [True] * len(p) for p in prompts]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(seen, device=device)


def prefill(model: LanguageModel, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Cache]:
    """Run the prompts through a fresh cache; returns next-token logits [B, V] and the cache."""
    longest = max((len(p) for p in prompts), default=0)
    if longest > model.max_context:
        raise ValueError(
            f"prompt has {longest} tokens, more than the model's context of {model.max_context}"
        )
    tokens, mask = left_pad(prompts, device=model.device)
    cache = model.new_cache(len(prompts))
    logits = model.forward(tokens, cache, mask)  # [B, T, V]
    return logits[:, -1, :], cache


def logprobs(model: LanguageModel, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities [B, T, V] float32 of the next token after every position of tokens
    [B, T], in one forward on a fresh cache (`mask` as in `forward`)."""
    return torch.log_softmax(model.forward(tokens, model.new_cache(len(tokens)), mask).float(), dim=-1)


def next_token_logprobs(
    model: LanguageModel, rows: Sequence[Sequence[int]] | torch.Tensor, starts: Sequence[int]
) -> list[torch.Tensor]:
    """log p(. | row[:t]) for t in [start, len(row)) of each row, [len(row) - start, V]
    float32, in one forward: rows of different lengths are left-padded."""
    if len(starts) != len(rows):
        raise ValueError(f"need one start per row: {len(rows)} rows, got {len(starts)} starts")
    for row, start in zip(rows, starts):
        if not 1 <= start <= len(row):
            raise ValueError(f"start must be in [1, {len(row)}] (the first token has no prefix), got {start}")
    if isinstance(rows, torch.Tensor):  # [B, T], no padding
        tokens, mask = rows, None
    else:
        tokens, mask = left_pad(rows, device=model.device)
        mask = None if all(len(row) == tokens.shape[1] for row in rows) else mask
    width = tokens.shape[1]
    logp = logprobs(model, tokens, mask)  # [B, T, V]
    # the logits at column t predict the token at t + 1
    return [logp[b, width - len(row) + start - 1 : width - 1]
            for b, (row, start) in enumerate(zip(rows, starts))]


def score_batch(
    model: LanguageModel, rows: Sequence[Sequence[int]] | torch.Tensor, starts: Sequence[int]
) -> list[torch.Tensor]:
    """log p(row[t] | row[:t]) for t in [start, len(row)) of each row, [len(row) - start]
    float32, in one forward: rows of different lengths are left-padded."""
    dists = next_token_logprobs(model, rows, starts)
    return [
        logp.gather(-1, torch.as_tensor(row[start:], dtype=torch.long, device=logp.device)[:, None])[:, 0]
        for logp, row, start in zip(dists, rows, starts)
    ]


def score_tokens(model: LanguageModel, ids: Sequence[int], start: int) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t in [start, len(ids)): [len(ids) - start] float32, one forward."""
    return score_batch(model, [ids], [start])[0]


def weights_stamp(model: LanguageModel) -> tuple:
    """Identity, storage and in-place version of every weight: changes when they change (what
    is built from a model's weights, its engine, a draft, a compiled step, is rebuilt then)."""
    net = getattr(model, "net", None)
    tensors = [*net.parameters(), *net.buffers()] if net is not None else []
    return tuple((id(t), t.data_ptr(), t._version) for t in tensors)
