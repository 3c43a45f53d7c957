"""Contrastive decoding: an expert and an amateur model behind one `LanguageModel`.

Li et al. (2023), seeds 003 and 004 ("Contrastive Decoding"), REFERENCES.md:

    CD(x) = log p_expert(x | x<i) - log p_amateur(x | x<i)   if x is in the plausible head,
            -inf                                             otherwise,
    head  = {x : p_expert(x | x<i) >= alpha * max_x' p_expert(x' | x<i)}

(the adaptive plausibility constraint of seed 004, section 4). Seed 001 presents the same
operation as a sampling adapter, p(. | x) proportional to p_expert / p_antiexpert (Li et al.
2023; Liu et al. 2021, DExperts). We keep its general weighted form,

    CD_beta(x) = log p_expert(x) - beta * log p_amateur(x)       (p proportional to p_e / p_a^beta),

beta = `amateur_weight`: 1 is Li et al., 0 is the expert truncated to its head. O'Brien and
Lewis' (1 + b) log p_e - b log p_a (2023) is beta = b / (1 + b) at sampling temperature
1 / (1 + b). Seed 004's other knobs: the amateur's temperature tau (log p_a = log_softmax(z_a
/ tau)) and its context window (the amateur sees only the last W tokens).

`ContrastiveLM` returns CD scores as its logits, so every decoder runs unchanged on top:
greedy takes the argmax of CD (Li et al.'s greedy search), sampling feeds the scores to the
request's adapter chain (temperature, top-p, ... apply to CD as to any logits), and beam
search sums log_softmax(CD) per step, the log-probability under seed 001's normalised
p_e / p_a over the head (Li et al. sum the unnormalised scores; the argmax per step is the
same). Consequently a completion's `logprobs` are under that normalised contrastive
distribution, not the expert; score text under the expert with `expert.forward` when the
expert's likelihood is wanted (bench/constrained.py does).

Both models keep their own KV caches, advanced by the same tokens: a step costs one token
forward per model and the prefix is never recomputed. The exception is a finite amateur
window: the amateur is then re-run from scratch on each position's last W tokens (so a
step costs W amateur tokens; at a fresh position 0..W-1, as if the window were the whole
context), which is what "the amateur sees only the last W tokens" means.

Where to run (`ContrastiveLM.engine_programs`, the hook of models/base.py): when both
models support paged KV and the amateur sees the whole context, `generate`, `stream` and
`stream_events` run each request as a `ContrastiveProgram` on the expert's persistent
engine (engine/program.py): the amateur's forwards of every contrastive request in flight
run as one batch, then their expert rows join the engine's one forward of the step, beside
any other requests on the expert. Otherwise (a windowed amateur, a model without paged KV)
the plain loop (decode/sample.py) runs `ContrastiveLM.forward` over its `PairCache`. Both
paths sample the same requests (request.py) from the same scores, token for token. Beam
search (`beam_search(cd, ...)`) takes the same hook: each prompt's search a `BeamProgram`
on the expert's engine, every beam an expert sequence (a RunningKV lane) paired with an
amateur one in its member pool, forked and closed together; beam searches and sampling
requests in flight batch together, and the beams equal the plain loop's (`_beam_plain`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from decodekit.decode.beam import BeamProgram, BeamSearch
from decodekit.engine.entry import blocks_alone
from decodekit.engine.program import Feed, Forward, Program, ProgramKV, Seq
from decodekit.models.base import Cache, LanguageModel, left_pad
from decodekit.request import (
    Delta,
    Request,
    Row,
    cancel_rows,
    drop_finished_rows,
    emit,
    sample_rows,
)

NEG_INF = float("-inf")
# Lowest amateur log-probability used: an amateur that gives a head token probability 0
# would make its score +inf (and softmax NaN); clamping keeps it finite and largest.
MIN_AMATEUR_LOGPROB = -1e4


def contrastive_scores(
    expert_logits: torch.Tensor,
    amateur_logits: torch.Tensor,
    alpha: float = 0.1,
    amateur_temperature: float = 1.0,
    amateur_weight: float = 1.0,
) -> torch.Tensor:
    """CD scores [..., V] from expert and amateur logits [..., V] (see the module doc)."""
    expert = expert_logits.double()  # [..., V]
    expert_lp = torch.log_softmax(expert, dim=-1)
    amateur_lp = torch.log_softmax(amateur_logits.double() / amateur_temperature, dim=-1)
    # p_e(x) >= alpha * max p_e  <=>  z_x - max z >= log alpha (the normaliser cancels), tested
    # on the logits in float64 so that the boundary is not decided by rounding; alpha = 0
    # keeps every token the expert gives nonzero probability.
    relative = expert - expert.amax(dim=-1, keepdim=True)
    head = (relative >= (math.log(alpha) if alpha > 0 else NEG_INF)) & (relative > NEG_INF)
    scores = expert_lp - amateur_weight * amateur_lp.clamp(min=MIN_AMATEUR_LOGPROB)
    return scores.masked_fill(~head, NEG_INF).float()


class WindowCache(Cache):
    """What an amateur with a context window needs: each row's tokens [B, L] and mask [B, L]."""

    def __init__(self, batch_size: int):
        # host bookkeeping: the amateur's windows are cut from these as lists
        self.tokens = torch.zeros((batch_size, 0), dtype=torch.long, device="cpu")
        self.mask = torch.zeros((batch_size, 0), dtype=torch.bool, device="cpu")

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def fork(self, rows: Sequence[int]) -> WindowCache:
        other = WindowCache(0)
        other.tokens, other.mask = self.tokens, self.mask
        other.select(rows)
        return other

    def select(self, rows: Sequence[int]) -> None:
        index = torch.tensor(list(rows), dtype=torch.long, device=self.tokens.device)
        self.tokens, self.mask = self.tokens[index], self.mask[index]

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.tokens, self.mask = self.tokens[:, :length], self.mask[:, :length]


class PairCache(Cache):
    """The expert's and the amateur's caches, moved together."""

    def __init__(self, expert: Cache, amateur: Cache):
        self.expert, self.amateur = expert, amateur

    @property
    def length(self) -> int:
        return self.expert.length

    def fork(self, rows: Sequence[int]) -> PairCache:
        return PairCache(self.expert.fork(rows), self.amateur.fork(rows))

    def select(self, rows: Sequence[int]) -> None:
        self.expert.select(rows)
        self.amateur.select(rows)

    def crop(self, length: int) -> None:
        self.expert.crop(length)
        self.amateur.crop(length)


class ContrastiveLM(LanguageModel):
    """A LanguageModel whose logits are the contrastive scores of `expert` against `amateur`.

    alpha in [0, 1] (plausibility cut, Li et al. use 0.1), amateur_temperature > 0,
    amateur_window (None: the amateur sees the whole context; W >= 1: its last W tokens),
    amateur_weight >= 0 (beta of the weighted form). Both models must share a vocabulary.
    """

    def __init__(
        self,
        expert: LanguageModel,
        amateur: LanguageModel,
        alpha: float = 0.1,
        amateur_temperature: float = 1.0,
        amateur_window: int | None = None,
        amateur_weight: float = 1.0,
    ):
        check_same_vocabulary(expert, amateur)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
        if not _positive_number(amateur_temperature):
            raise ValueError(f"amateur_temperature must be a number > 0, got {amateur_temperature!r}")
        if amateur_window is not None and (
            isinstance(amateur_window, bool) or not isinstance(amateur_window, int) or amateur_window < 1
        ):
            raise ValueError(f"amateur_window must be None or an integer >= 1, got {amateur_window!r}")
        if amateur_window is not None and amateur_window > amateur.max_context:
            raise ValueError(
                f"amateur_window must be <= the amateur's context ({amateur.max_context}), "
                f"got {amateur_window}"
            )
        if not (_positive_number(amateur_weight) or amateur_weight == 0):
            raise ValueError(f"amateur_weight must be a finite number >= 0, got {amateur_weight!r}")
        self.expert, self.amateur = expert, amateur
        self.alpha, self.amateur_temperature = float(alpha), float(amateur_temperature)
        self.amateur_window, self.amateur_weight = amateur_window, float(amateur_weight)
        self.name = f"contrastive({expert.name}, {amateur.name})"
        self.device = expert.device
        self.vocab_size = expert.vocab_size
        self.eos_token_ids = expert.eos_token_ids
        self.tokenizer = expert.tokenizer
        windowed = amateur_window is not None
        self.max_context = expert.max_context if windowed else min(expert.max_context, amateur.max_context)

    # Two models per step: no paged KV of its own (supports_paged_kv stays False); it runs on
    # the expert's engine through `engine_programs`, or in the plain loop, whose cache forks
    # and crops when the expert's and the amateur's do (a WindowCache always does).
    @property
    def supports_fork(self) -> bool:
        return self.expert.supports_fork and (self.amateur_window is not None or self.amateur.supports_fork)

    @property
    def supports_crop(self) -> bool:
        return self.expert.supports_crop and (self.amateur_window is not None or self.amateur.supports_crop)

    def new_cache(self, batch_size: int) -> PairCache:
        windowed = self.amateur_window is not None
        amateur = WindowCache(batch_size) if windowed else self.amateur.new_cache(batch_size)
        return PairCache(self.expert.new_cache(batch_size), amateur)

    def forward(
        self, tokens: torch.Tensor, cache: PairCache, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        expert_logits = self.expert.forward(tokens, cache.expert, mask)  # [B, T, V]
        if self.amateur_window is None:
            amateur_logits = self.amateur.forward(tokens, cache.amateur, mask)  # [B, T, V]
        else:
            amateur_logits = self._windowed_amateur(tokens, cache.amateur, mask)
        return self.scores(expert_logits, amateur_logits)

    def scores(self, expert_logits: torch.Tensor, amateur_logits: torch.Tensor) -> torch.Tensor:
        """This pair's CD scores [..., V] (its alpha, amateur temperature and weight)."""
        return contrastive_scores(
            expert_logits, amateur_logits, self.alpha, self.amateur_temperature, self.amateur_weight
        )

    def engine_programs(
        self, requests: Sequence[Request | BeamSearch]
    ) -> tuple[LanguageModel, list[Program]] | None:
        """The requests as programs on the expert's engine, when both models support paged KV
        and the amateur sees the whole context; None (the plain loop) otherwise. A sampling
        request (request.py) runs as a `ContrastiveProgram`; a beam search (beam.py
        `BeamSearch`, the i-th prompt's) as a `BeamProgram` whose beams pair an expert
        sequence with an amateur one, scored by this pair's CD scores."""
        paged = self.expert.supports_paged_kv and self.amateur.supports_paged_kv
        if not paged or self.amateur_window is not None:
            return None
        return self.expert, [
            BeamProgram(self.expert, r, i, members=(self.amateur,), combine=self.scores)
            if isinstance(r, BeamSearch) else ContrastiveProgram(self, r)
            for i, r in enumerate(requests)
        ]

    def _windowed_amateur(
        self, tokens: torch.Tensor, cache: WindowCache, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Amateur logits [B, T, V], each position computed from its last W real tokens only."""
        if mask is None:
            mask = torch.ones_like(tokens, dtype=torch.bool)  # [B, T]
        tokens, mask = tokens.to(cache.tokens.device), mask.to(cache.tokens.device)  # read as lists below
        cache.tokens = torch.cat([cache.tokens, tokens], dim=1)  # [B, L + T]
        cache.mask = torch.cat([cache.mask, mask], dim=1)
        width, (batch, steps) = self.amateur_window, tokens.shape
        windows, places = [], []
        for b in range(batch):
            history = cache.tokens[b, cache.mask[b]].tolist()  # real tokens of row b
            new = int(mask[b].sum())
            positions = mask[b].nonzero()[:, 0].tolist()  # where row b's new real tokens sit
            for j, t in enumerate(positions):
                end = len(history) - new + j + 1
                windows.append(history[max(0, end - width) : end])
                places.append((b, t))
        out = torch.zeros(batch, steps, self.vocab_size, device=self.amateur.device)  # padding stays 0
        if windows:
            window_tokens, window_mask = left_pad(windows, device=self.amateur.device)
            fresh = self.amateur.new_cache(len(windows))
            logits = self.amateur.forward(window_tokens, fresh, window_mask)[:, -1, :]  # [N, V]
            rows, cols = zip(*places, strict=True)
            out[list(rows), list(cols)] = logits
        return out

    def num_parameters(self) -> int:
        return self.expert.num_parameters() + self.amateur.num_parameters()

    def encode(self, text: str) -> list[int]:
        return self.expert.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.expert.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.expert.token_text(token_id)


class ContrastiveProgram(Program):
    """One sampling request (request.py) on the expert's engine, its logits the CD scores.

    Each live row is a pair of sequences: the expert's, decoding over a RunningKV lane, and
    the amateur's, in the amateur's pool on the engine (a member). Every step feeds both the
    row's last token: the amateur forward runs batched with every other program's, then the
    expert's joins the step's one forward (engine/program.py). The prompt runs once; its n
    samples fork both sequences after it, as the plain loop forks its cache. The request's
    chain, seeds, stop strings and logprobs act exactly as in `generate` (`sample_rows`,
    `emit`); a finished row's sequences are closed at once.
    """

    def __init__(self, model: ContrastiveLM, request: Request):
        self.model, self.request = model, request
        self.prompt_index, self.num_samples = request.index, len(request.rows)
        self.rows: list[Row] = []  # the live rows, in the request's state order
        self.seqs: list[tuple[Seq, Seq]] = []  # (expert, amateur) per live row; the prompt's first

    def needs(self, block_size: int) -> list[tuple[LanguageModel, int]]:
        # as a sampling request, plus one block per sample for a copy-on-write of a cached
        # last block (block_pool.py `reserve`)
        blocks = blocks_alone(self.request, block_size) + len(self.request.rows)
        return [(self.model.expert, blocks), (self.model.amateur, blocks)]

    def step(self, kv: ProgramKV):
        model, request = self.model, self.request
        first = not self.rows
        if first:  # the prompt, once for all n samples
            pair = (kv.open(model.expert, request.prompt_ids), kv.open(model.amateur, request.prompt_ids))
            request.cached_prompt_tokens = pair[0].table.length
            self.rows, self.seqs = list(request.rows), [pair]
        experts, amateurs = zip(*self.seqs, strict=True)
        amateur, expert = yield [Forward(model.amateur, [Feed(seq) for seq in amateurs]),
                                 Forward(model.expert, [Feed(seq, lane=True) for seq in experts])]
        scores = model.scores(torch.cat(expert), torch.cat(amateur))  # [R or 1, V]
        parents = [0] * len(self.rows) if first else list(range(len(self.rows)))
        rows = self.rows
        sample_rows(scores[parents], rows)
        deltas = list(emit(rows, model.max_context))
        drop_finished_rows(rows)
        live = [(row, parent) for row, parent in zip(rows, parents, strict=True) if row.finish_reason is None]
        taken: set[int] = set()
        pairs = []
        for _, parent in live:  # forks first: every parent is intact until all are taken
            pair = self.seqs[parent]
            pairs.append((kv.fork(pair[0]), kv.fork(pair[1])) if parent in taken else pair)
            taken.add(parent)
        for i, pair in enumerate(self.seqs):
            if i not in taken:
                kv.close(pair[0])
                kv.close(pair[1])
        for (row, _), pair in zip(live, pairs, strict=True):
            for seq in pair:
                seq.tokens.append(row.token_ids[-1])
        self.rows, self.seqs = [row for row, _ in live], pairs
        self.finished = not self.rows
        return deltas

    def cancel(self) -> list[Delta]:
        """The unfinished samples so far, with finish_reason "cancelled"."""
        return cancel_rows(self.rows or self.request.rows)


def check_same_vocabulary(expert: LanguageModel, amateur: LanguageModel) -> None:
    """Contrastive scores compare token by token: the two models must share one vocabulary."""
    if expert.vocab_size != amateur.vocab_size:
        raise ValueError(
            f"expert {expert.name!r} and amateur {amateur.name!r} must share a vocabulary; "
            f"vocab_size {expert.vocab_size} != {amateur.vocab_size}"
        )
    a, b = expert.tokenizer, amateur.tokenizer
    if (a is None) != (b is None) or (a is not None and a.get_vocab() != b.get_vocab()):
        raise ValueError(
            f"expert {expert.name!r} and amateur {amateur.name!r} must share a tokenizer; "
            "their vocabularies map tokens to different ids"
        )


def _positive_number(value) -> bool:
    is_number = not isinstance(value, bool) and isinstance(value, int | float)
    return is_number and math.isfinite(value) and value > 0
