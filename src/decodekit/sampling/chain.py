"""A request's sampling chain and its state.

`build_chain(params, tokenizer)` is built once per request and returns one adapter,
`(logits [R, V], state) -> logits [R, V]`, that applies the active adapters (adapters.py, each
a class declaring its properties) in `params.order`; adapters at their off values are left out. A caller's
own adapter (`first`: controlled decoding's value tilt, align/controlled.py) runs before
them, so it changes the policy that the params then sample from. The
per-request state (histories, the mirostat target, the request's random generator)
lives in `SamplerState`, and the decode loop calls, per step:

    processed = chain(raw_logits, state)
    tokens = select_tokens(processed, state)
    state.accept(tokens, processed)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from decodekit.params import SamplingParams
from decodekit.sampling import processors as P
from decodekit.sampling.adapters import ADAPTERS, active_adapters

Chain = Callable[[torch.Tensor, "SamplerState"], torch.Tensor]


class SamplerState:
    """State of one request's R rows (R = n samples, or beams).

    `generator` (CPU) is seeded by `params.seed`, or by a fresh random seed when it is
    None; it belongs to the request, so a seed reproduces the request's draws whatever
    else shares the batch. `generated[r]` lists the tokens accepted for row r. `mu` [R]
    is the mirostat v2 target surprise (None unless mirostat is in the chain).
    `tokenizer` is kept for callers; text-to-token mapping happens in `build_chain`.
    `hidden` [R, H]: each row's final hidden state at this step (what the LM head read to
    make the logits being processed), when the decoder hands it over (the engine does for a
    request whose adapter asks: request.py `Request.wants_hidden`), else None. `memory`:
    per-row tensors [R, ...] an adapter keeps across steps (align/qvalue.py's running Q-head
    memory), keyed by the adapter's object; `select_rows` reorders them with the rows.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        num_rows: int,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
    ):
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        params.check_vocab(vocab_size)
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        # Tokens that end a sequence, masked by min_tokens until min_new_tokens are out.
        eos = () if params.ignore_eos else self.eos_token_ids
        self.stop_token_ids = tuple(dict.fromkeys(eos + params.stop_token_ids))
        self.seed = params.seed if params.seed is not None else _fresh_seed()
        self.generator = torch.Generator().manual_seed(self.seed)
        self.generated: list[list[int]] = [[] for _ in range(num_rows)]
        self.mu: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.memory: dict[Any, torch.Tensor] = {}
        if params.mirostat_tau is not None and "mirostat" in params.order:
            # Mirostat v2 starts its target at twice the target surprise tau.
            tau = 2.0 * params.mirostat_tau
            self.mu = torch.full((num_rows,), tau, dtype=torch.float64, device="cpu")  # host, as `accept`

    @property
    def num_rows(self) -> int:
        return len(self.generated)

    def contexts(self) -> list[list[int]]:
        """Prompt + generated tokens of every row."""
        return [self.prompt_ids + row for row in self.generated]

    def accept(self, tokens: torch.Tensor | Sequence[int], processed_logits: torch.Tensor | None) -> None:
        """Record the chosen tokens [R] (a tensor, or ints already read on the host) drawn from
        `processed_logits` [R, V] (None: plain greedy's one-hot, request.py; mirostat, the one
        reader, is never plain greedy)."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        assert len(ids) == self.num_rows, (len(ids), self.num_rows)
        for row, token in enumerate(ids):
            self.generated[row].append(int(token))
        if self.mu is not None:
            # Mirostat v2: mu <- mu - eta * (surprise - tau), surprise in bits under the
            # distribution the token was drawn from.
            log_probs = torch.log_softmax(processed_logits.double(), dim=-1)
            index = torch.tensor(ids, dtype=torch.long, device=log_probs.device)
            chosen = log_probs.gather(-1, index[:, None])[:, 0]
            surprise = -chosen.cpu() / math.log(2)
            self.mu = self.mu - self.params.mirostat_eta * (surprise - self.params.mirostat_tau)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep and reorder rows (beam search): row i becomes a copy of old row rows[i]."""
        self.generated = [list(self.generated[r]) for r in rows]
        if self.mu is not None:
            self.mu = self.mu[torch.as_tensor(list(rows), dtype=torch.long, device=self.mu.device)].clone()
        for key, tensor in self.memory.items():
            self.memory[key] = tensor[torch.as_tensor(list(rows), dtype=torch.long, device=tensor.device)]


def build_chain(params: SamplingParams, tokenizer: Any = None, first: Chain | None = None) -> Chain:
    """The request's adapters, in `params.order`, as one function (logits, state) -> logits;
    `first`, a stateless adapter of the caller's (it reads the rows' tokens from the state),
    runs before them."""
    stages = chain_stages(params, tokenizer)
    active = [adapter for _, adapter in stages]
    if first is not None:
        active.insert(0, first)
    compact_at = _compaction(active)

    def chain(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:  # [R, V] -> [R, V]
        for at, adapter in enumerate(active):
            if at == compact_at and compacting(logits):
                truncated = adapter.truncate(logits)
                if isinstance(truncated, tuple):  # the rest of the chain on the kept tokens alone
                    values, ids = truncated
                    for later in active[at + 1 :]:
                        values = later(values, state)
                    out = P.expand_kept(logits, values, ids)
                    out.kept = (values, ids)  # for the draw (select.py `draw_logits_rows`)
                    return out
                logits = truncated  # the adapter's output over the whole vocabulary
                continue
            logits = adapter(logits, state)
        return logits if active else logits.clone()

    # No adapter: the processed logits equal the raw ones (request.py samples from the raw
    # logits and reads one log-softmax for both).
    chain.identity = not active
    # Whether a call at a large CPU vocabulary may go on with a truncation's kept tokens: its
    # rows together decide whether they can (`truncate`), so request.py samples such a
    # request's rows apart from other requests' (a row then gets what it gets alone).
    chain.compacts = compact_at is not None
    # ... and whether they must: a top-k keeps k + TIES_LOOKED_AT tokens in every row whatever
    # the batch, so a batch whose rows all compact gives each row what it gets alone (one that
    # does not is sampled apart: request.py); a top-p's or min-p's kept width is the batch's.
    chain.compacts_apart = chain.compacts and active[compact_at].name != "top_k"
    chain.rowwise_key = rowwise_key(params, [name for name, _ in stages]) if first is None else None
    # Plain greedy (temperature 0, no other adapter): its processed logits are the raw argmax's
    # one-hot, so request.py takes the argmax of the raw logits and a processed logprob of 0
    # without building them (two argmaxes and two log-softmaxes over the vocabulary, one each).
    chain.argmax_only = first is None and [name for name, _ in stages] == ["temperature"] and params.greedy
    return chain


# From this vocabulary on, a CPU chain runs the adapters after a top-k, top-p or min-p on its
# kept tokens (`_compaction`).
COMPACT_MIN_VOCAB = 16384


def compacting(logits: torch.Tensor) -> bool:
    """Whether chains that compact (`chain.compacts`) do so on rows like logits [R, V]."""
    return logits.is_cpu and logits.shape[-1] >= COMPACT_MIN_VOCAB


def _compaction(active: list) -> int | None:
    """Where the chain may go on with the tokens a truncation keeps (a top-k's, top-p's or
    min-p's: adapters.py `truncate`): the first such adapter's place, when every adapter after it is
    index-free, else None. A top-k at 151,936 tokens keeps ~40, and llama.cpp's default chain
    (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8) then runs its other adapters and
    the draw on those: 5.0 -> 0.7 ms a row (BENCHMARKS.md, "Sampling a real vocabulary
    against llama.cpp's samplers")."""
    for at, adapter in enumerate(active):
        if hasattr(adapter, "truncate"):
            later = active[at + 1 :]
            return at if all(getattr(a, "index_free", False) for a in later) else None
    return None


# Adapters that read only the logits and the params, row by row (no history, state or random
# draw): requests whose chains have only these, with equal settings, can run as one batch.
ROWWISE = frozenset(name for name, adapter in ADAPTERS.items() if adapter.rowwise)


def rowwise_key(params: SamplingParams, names: list[str]) -> tuple | None:
    """What a chain of row-wise adapters computes, as a key (equal keys: the same function of
    each row's logits, so request.py batches their rows); None when an adapter reads more."""
    if any(name not in ROWWISE for name in names):
        return None
    values = [_hashable(getattr(params, f)) for name in names for f in ADAPTERS[name].fields]
    return (tuple(names), params.min_tokens_to_keep, *values)


def chain_stages(params: SamplingParams, tokenizer: Any = None) -> list[tuple[str, Chain]]:
    """The active adapters of `build_chain`, in order, by name (the lab shows each stage)."""
    return [(adapter.name, adapter(params, tokenizer)) for adapter in active_adapters(params)]


def _hashable(value: Any) -> Any:
    # logit_bias is a dict; allowed token ids compare as a set
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return tuple(sorted(value)) if isinstance(value, tuple) else value


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1
