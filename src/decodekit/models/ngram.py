"""`NGramLM`: k-gram language models with add-constant or Kneser-Ney smoothing (seed 000).

A k-gram model approximates p(x_i | x_1..x_{i-1}) by p(x_i | x_{i-k+1}..x_{i-1}) and estimates
it from counts (seed 000, "k-gram models"). Two estimators:

- add-constant (Laplace for c = 1; seed 000, "Tools from statistics"):
  p(w | h) = (count(h w) + c) / (count(h) + V c); an unseen context h gets the uniform 1/V;
- interpolated Kneser-Ney (Chen & Goodman 1998, eq. 26): the top order uses raw counts,
  lower orders use continuation counts N1+(. h w) (how many distinct tokens precede h w),
  each order is absolutely discounted by D = n1 / (n1 + 2 n2) and the freed mass
  D N1+(h .) / count(h) goes to the next lower order, which ends in the uniform 1/V.

Order 0 is Shannon's zero-order approximation: every symbol equiprobable.

Every document ends with EOS (the seed's terminal token $) and starts with k - 1 EOS as
padding, so EOS doubles as the start-of-document context; the cache is each row's token
history, and the context at the start of a history is that same EOS padding. Counts are kept
as sorted int64 keys (a k-gram is a base-V number), so training and scoring are numpy
searches: a play trains in well under a second.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decodekit.models.base import Cache, LanguageModel

SMOOTHINGS = ("add-constant", "kneser-ney")
LEVELS = ("char", "word", "token")
EOS_SYMBOL = "<|endoftext|>"  # the end symbol of char and word models (the BPE tokenizer's EOS)
CONFIG_FILE, COUNTS_FILE = "ngram.json", "counts.npz"


@dataclass(frozen=True)
class NGramConfig:
    """order k (k - 1 tokens of context; 0 is uniform), smoothing, add-constant c."""

    order: int
    smoothing: str = "kneser-ney"
    constant: float = 1.0

    def __post_init__(self):
        if isinstance(self.order, bool) or not isinstance(self.order, int) or self.order < 0:
            raise ValueError(f"order must be an integer >= 0, got {self.order!r}")
        if self.smoothing not in SMOOTHINGS:
            raise ValueError(f"smoothing must be one of {SMOOTHINGS}, got {self.smoothing!r}")
        if not self.constant > 0:
            raise ValueError(f"constant must be > 0 (add-constant c), got {self.constant!r}")


@dataclass
class _Table:
    """Counts of one order j: j-grams (sorted keys) and their contexts (the first j-1 tokens)."""

    gram_keys: np.ndarray  # [G] int64, sorted
    gram_counts: np.ndarray  # [G] float64: raw counts, or continuation counts
    ctx_keys: np.ndarray  # [H] int64, sorted
    ctx_start: np.ndarray  # [H] first index of the context's j-grams in gram_keys
    ctx_types: np.ndarray  # [H] N1+(h .): distinct continuations
    ctx_total: np.ndarray  # [H] float64: sum of the continuations' counts
    discount: float


def _table(keys: np.ndarray, counts: np.ndarray, vocab_size: int) -> _Table:
    ctx, start = np.unique(keys // vocab_size, return_index=True)
    types = np.diff(np.append(start, len(keys)))
    total = np.add.reduceat(counts, start) if len(keys) else np.zeros(0)
    n1, n2 = np.sum(counts == 1), np.sum(counts == 2)
    # Kneser-Ney's D = n1 / (n1 + 2 n2) (Ney et al. 1994); 0.5 when the counts cannot tell.
    discount = float(n1 / (n1 + 2 * n2)) if n1 > 0 and n2 > 0 else 0.5
    return _Table(keys, counts, ctx, start, types, total.astype(np.float64), discount)


def _lookup(sorted_keys: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found [N] bool, index [N]) of each query in sorted_keys."""
    if len(sorted_keys) == 0:
        return np.zeros(len(queries), bool), np.zeros(len(queries), np.int64)
    index = np.minimum(np.searchsorted(sorted_keys, queries), len(sorted_keys) - 1)
    return sorted_keys[index] == queries, index


def count_kgrams(
    sequences: Sequence[Sequence[int]], order: int, vocab_size: int, eos_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct k-grams (sorted int64 keys) and their counts over EOS-terminated documents."""
    if order == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pad = [eos_id] * (order - 1)
    stream: list[int] = []
    is_event: list[bool] = []  # the window ending here predicts a real token (not padding)
    for seq in sequences:
        stream += pad + list(seq) + [eos_id]
        is_event += [False] * len(pad) + [True] * (len(seq) + 1)
    ids = np.asarray(stream, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    windows = np.lib.stride_tricks.sliding_window_view(ids, order)  # [N - k + 1, k]
    powers = vocab_size ** np.arange(order - 1, -1, -1, dtype=np.int64)
    keys = (windows * powers).sum(axis=1)[np.asarray(is_event)[order - 1 :]]
    return np.unique(keys, return_counts=True)


class NGramCache(Cache):
    """Each row's token history [B, L]; -1 marks padding, which is never context."""

    def __init__(self, history: np.ndarray):
        self.history = history

    @property
    def length(self) -> int:
        return self.history.shape[1]

    def fork(self, rows: Sequence[int]) -> NGramCache:
        return NGramCache(self.history[list(rows)].copy())

    def select(self, rows: Sequence[int]) -> None:
        self.history = self.history[list(rows)]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        self.history = self.history[:, :length]


class NGramLM(LanguageModel):
    """A k-gram model over token ids: characters, words (own vocabulary) or a HF tokenizer's."""

    def __init__(
        self,
        kgram_keys: np.ndarray,
        kgram_counts: np.ndarray,
        config: NGramConfig,
        *,
        vocab_size: int,
        eos_id: int,
        level: str = "token",
        symbols: Sequence[str] | None = None,
        tokenizer: Any | None = None,
        name: str = "ngram",
    ):
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        # char and word models carry their symbols; a token model a tokenizer (or none: raw ids)
        if level != "token" and (symbols is None or tokenizer is not None):
            raise ValueError(f"a {level}-level model needs its symbols and no tokenizer")
        if level == "token" and symbols is not None:
            raise ValueError("a token-level model takes its vocabulary from the tokenizer")
        if symbols is not None and len(symbols) != vocab_size:
            raise ValueError(f"{len(symbols)} symbols for vocab_size {vocab_size}")
        if config.order > 0 and float(vocab_size) ** config.order >= 2.0**62:
            raise ValueError(f"vocab_size**order must be < 2**62 for int64 keys, got "
                             f"{vocab_size}**{config.order}")
        self.config, self.name, self.level = config, name, level
        self.vocab_size, self.eos_token_ids = vocab_size, (eos_id,)
        self.eos_id = eos_id
        self.symbols = list(symbols) if symbols is not None else None
        self.tokenizer = tokenizer
        self.max_context = 1 << 30  # any history; only the last k - 1 tokens are read
        self.kgram_keys = np.asarray(kgram_keys, np.int64)
        self.kgram_counts = np.asarray(kgram_counts, np.int64)
        self._tables = self._build_tables()
        self._unigram = self._base_distribution()

    @classmethod
    def fit(
        cls, sequences: Sequence[Sequence[int]], config: NGramConfig, *, vocab_size: int,
        eos_id: int, **kwargs: Any,
    ) -> NGramLM:
        """Count the k-grams of token-id documents (each gets EOS appended); kwargs as __init__."""
        keys, counts = count_kgrams(sequences, config.order, vocab_size, eos_id)
        return cls(keys, counts, config, vocab_size=vocab_size, eos_id=eos_id, **kwargs)

    # ------------------------------------------------------------ estimation

    def _build_tables(self) -> dict[int, _Table]:
        """Order k from raw counts; orders k-1..1 from continuation counts (Kneser-Ney only)."""
        k, V = self.config.order, self.vocab_size
        if k == 0:
            return {}
        tables = {k: _table(self.kgram_keys, self.kgram_counts.astype(np.float64), V)}
        if self.config.smoothing == "kneser-ney":
            distinct = self.kgram_keys  # distinct (j+1)-grams, starting with j + 1 = k
            for j in range(k - 1, 0, -1):
                # N1+(. w_1..w_j): distinct (j+1)-grams that end in the j-gram w_1..w_j
                distinct, continuation = np.unique(distinct % V**j, return_counts=True)
                tables[j] = _table(distinct, continuation.astype(np.float64), V)
        return tables

    def _base_distribution(self) -> np.ndarray:
        """[V] the distribution that the recursion starts from (uniform, or KN's unigram)."""
        V = self.vocab_size
        uniform = np.full(V, 1.0 / V)
        if self.config.smoothing != "kneser-ney" or self.config.order == 0:
            return uniform
        t = self._tables[1]
        if len(t.gram_keys) == 0:
            return uniform
        total, d = t.ctx_total[0], t.discount
        probs = uniform * d * t.ctx_types[0] / total
        probs[t.gram_keys] += np.maximum(t.gram_counts - d, 0.0) / total
        return probs

    def _orders(self) -> list[tuple[int, _Table]]:
        k = self.config.order
        if self.config.smoothing == "add-constant":
            return [(k, self._tables[k])] if k > 0 else []
        return [(j, self._tables[j]) for j in range(2, k + 1)]

    def distribution(self, context_keys: np.ndarray) -> np.ndarray:
        """p(. | h) [N, V] float64 for N contexts given as base-V keys of their k-1 tokens."""
        V, n = self.vocab_size, len(context_keys)
        if self.config.smoothing == "add-constant" and self.config.order > 0:
            c, t = self.config.constant, self._tables[self.config.order]
            found, pos = _lookup(t.ctx_keys, context_keys)
            probs = np.full((n, V), float(c))
            self._scatter(probs, t, found, pos, 0.0)
            total = np.where(found, t.ctx_total[pos], 0.0)
            return probs / (total + V * c)[:, None]
        probs = np.tile(self._unigram, (n, 1))
        for j, t in self._orders():
            found, pos = _lookup(t.ctx_keys, context_keys % V ** (j - 1))
            total = t.ctx_total[pos[found]]
            probs[found] *= (t.discount * t.ctx_types[pos[found]] / total)[:, None]
            self._scatter(probs, t, found, pos, t.discount, total)
        return probs

    @staticmethod
    def _scatter(probs, t: _Table, found, pos, discount: float, total=None) -> None:
        """probs[row, w] += max(count(h w) - D, 0) / total for every seen continuation w."""
        rows = np.flatnonzero(found)
        start, n = t.ctx_start[pos[rows]], t.ctx_types[pos[rows]]
        first = np.repeat(np.cumsum(n) - n, n)
        index = np.repeat(start, n) + np.arange(n.sum()) - first  # into gram_keys
        value = np.maximum(t.gram_counts[index] - discount, 0.0)
        if total is not None:
            value = value / np.repeat(total, n)
        probs[np.repeat(rows, n), t.gram_keys[index] % probs.shape[1]] += value

    def token_probs(self, context_keys: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """p(target | h) [N]: the same estimate as `distribution`, one entry per context."""
        V, c = self.vocab_size, self.config.constant
        if self.config.smoothing == "add-constant" and self.config.order > 0:
            t = self._tables[self.config.order]
            found, pos = _lookup(t.ctx_keys, context_keys)
            hit, gpos = _lookup(t.gram_keys, context_keys * V + targets)
            count = np.where(hit, t.gram_counts[gpos], 0.0)
            return (count + c) / (np.where(found, t.ctx_total[pos], 0.0) + V * c)
        probs = self._unigram[targets]
        for j, t in self._orders():
            h = context_keys % V ** (j - 1)
            found, pos = _lookup(t.ctx_keys, h)
            hit, gpos = _lookup(t.gram_keys, h * V + targets)
            total = np.where(found, t.ctx_total[pos], 1.0)
            count = np.where(hit, t.gram_counts[gpos], 0.0)
            mixed = np.maximum(count - t.discount, 0.0) / total
            mixed += t.discount * t.ctx_types[pos] / total * probs
            probs = np.where(found, mixed, probs)
        return probs

    # ------------------------------------------------------------ the LanguageModel contract

    def context_keys(self, history: Sequence[int]) -> np.ndarray:
        """[len(history) + 1] key of the k-1 tokens before each position (EOS-padded)."""
        k, V = self.config.order, self.vocab_size
        if k <= 1:
            return np.zeros(len(history) + 1, np.int64)
        padded = np.asarray([self.eos_id] * (k - 1) + list(history), np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(padded, k - 1)  # [L + 1, k - 1]
        return (windows * V ** np.arange(k - 2, -1, -1, dtype=np.int64)).sum(axis=1)

    def new_cache(self, batch_size: int) -> NGramCache:
        return NGramCache(np.zeros((batch_size, 0), np.int64))

    def forward(
        self, tokens: torch.Tensor, cache: NGramCache, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids = tokens.detach().cpu().numpy().astype(np.int64)  # [B, T]
        if mask is not None:
            ids = np.where(mask.detach().cpu().numpy().astype(bool), ids, -1)
        real = ids[ids >= 0]
        if real.size and (real.min() < 0 or real.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {real.max()}")
        batch, steps = ids.shape
        if cache.history.shape[0] != batch:
            raise ValueError(f"cache has {cache.history.shape[0]} rows, tokens have {batch}")
        full = np.concatenate([cache.history, ids], axis=1)  # [B, L + T]
        keys = np.empty((batch, steps), np.int64)
        for row in range(batch):
            seen = full[row] >= 0
            # position t predicts from the real tokens up to and including t
            n_real = np.cumsum(seen)[cache.length :]
            keys[row] = self.context_keys(full[row][seen])[n_real]
        cache.history = full
        probs = self.distribution(keys.reshape(-1))  # [B * T, V]
        return torch.from_numpy(np.log(probs)).float().reshape(batch, steps, -1)  # [B, T, V]

    def num_parameters(self) -> int:
        """Stored counts (distinct k-grams): the closest thing a k-gram model has to weights."""
        return int(len(self.kgram_keys))

    def encode(self, text: str) -> list[int]:
        if self.symbols is None:
            return super().encode(text)
        units = list(text) if self.level == "char" else text.split()
        index = self._symbol_index()
        missing = sorted({u for u in units if u not in index})
        if missing:
            raise ValueError(f"{missing[:5]!r} not in the vocabulary of model {self.name!r}")
        return [index[u] for u in units]

    def decode(self, ids: Sequence[int]) -> str:
        if self.symbols is None:
            return super().decode(ids)
        units = [self.symbols[i] for i in ids if i != self.eos_id]
        return ("" if self.level == "char" else " ").join(units)

    def _symbol_index(self) -> dict[str, int]:
        return {s: i for i, s in enumerate(self.symbols or [])}

    # ------------------------------------------------------------ evaluation, sampling, files

    def perplexity(self, sequences: Sequence[Sequence[int]]) -> float:
        """exp(mean -log p) over every token of every document and its closing EOS."""
        keys, targets = [], []
        for seq in sequences:
            keys.append(self.context_keys(list(seq)))
            targets.append(np.asarray(list(seq) + [self.eos_id], np.int64))
        probs = self.token_probs(np.concatenate(keys), np.concatenate(targets))
        return float(np.exp(-np.mean(np.log(probs))))

    def save(self, path: str | Path) -> None:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"format": "decodekit-ngram", "version": 1, "name": self.name,
                "level": self.level, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "symbols": self.symbols, **asdict(self.config)}
        (out / CONFIG_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n")
        counts = self.kgram_counts.astype(np.uint32 if self.kgram_counts.max(initial=0) < 2**32
                                          else np.int64)
        np.savez_compressed(out / COUNTS_FILE, keys=self.kgram_keys, counts=counts)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> NGramLM:
        path = Path(path)
        meta = json.loads((path / CONFIG_FILE).read_text())
        if meta.get("format") != "decodekit-ngram":
            raise ValueError(f"{path / CONFIG_FILE} is not a decodekit k-gram model")
        tokenizer = None
        if meta["level"] == "token" and meta["symbols"] is None:
            from decodekit.models.checkpoint import load_tokenizer

            tokenizer = load_tokenizer(path)
        with np.load(path / COUNTS_FILE) as data:
            keys, counts = data["keys"], data["counts"].astype(np.int64)
        config = NGramConfig(meta["order"], meta["smoothing"], meta["constant"])
        return cls(keys, counts, config, vocab_size=meta["vocab_size"], eos_id=meta["eos_id"],
                   level=meta["level"], symbols=meta["symbols"], tokenizer=tokenizer,
                   name=name or meta["name"])


def train_ngram(
    texts: Sequence[str],
    config: NGramConfig,
    *,
    level: str = "char",
    tokenizer: Any | None = None,
    vocabulary: Sequence[str] | None = None,
    eos: str = EOS_SYMBOL,
    name: str | None = None,
) -> NGramLM:
    """Count k-grams over documents. char/word levels build (or take) their own vocabulary,
    with `eos` as its last symbol unless given; token level uses `tokenizer` and its EOS."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    name = name or f"{level}-{config.order}gram"
    if level == "token":
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ValueError("a token-level k-gram model needs a tokenizer with an EOS token")
        seqs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return NGramLM.fit(seqs, config, vocab_size=len(tokenizer),
                           eos_id=int(tokenizer.eos_token_id), tokenizer=tokenizer, name=name)
    split = [list(t) if level == "char" else t.split() for t in texts]
    if vocabulary is None:
        vocabulary = sorted({u for units in split for u in units} - {eos}) + [eos]
    if eos not in vocabulary:
        raise ValueError(f"the vocabulary must contain the end symbol {eos!r}")
    index = {s: i for i, s in enumerate(vocabulary)}
    missing = sorted({u for units in split for u in units if u not in index})
    if missing:
        raise ValueError(f"{missing[:5]!r} are not in the given vocabulary")
    seqs = [[index[u] for u in units] for units in split]
    return NGramLM.fit(seqs, config, vocab_size=len(vocabulary), eos_id=index[eos],
                       level=level, symbols=vocabulary, name=name)
