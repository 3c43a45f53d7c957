"""Beam search with length normalisation (seeds 003, 004).

Keeps the `num_beams` best prefixes by summed log-probability. Each step ranks the
2 * num_beams best continuations; one that emits EOS (or a stop token) among the top
`num_beams` of them leaves the beam with score Σ log p / |y|^α, where |y| counts
generated tokens only, the final EOS included (counting the prompt is a bug once
reported against Hugging Face). Lower-ranked EOS candidates are dropped: they only
make room for live beams, as in Hugging Face and fairseq (at the last step every
top-`num_beams` continuation finishes, with reason "length").

The adapter chain of `SamplingParams` is applied before scoring, so n-gram blocking
(`no_repeat_ngram_size`), bad words, logit bias and penalties work; temperature is
ignored (set to 1).

early_stopping=True stops once `num_beams` hypotheses have finished (the usual
choice); False stops only when no live beam can still beat the worst kept
hypothesis, which makes a wide enough beam equal exhaustive search (transformers'
early_stopping="never"; its False is a heuristic that may stop sooner).

A token mask (`constraint=` or `heal=`, as in `generate`) is applied before the chain; a
hypothesis whose constraint is complete leaves the beam like one that emits EOS.

`Beam(num_beams, length_penalty, early_stopping)` is the strategy (sample.py `Run`): its `prepare`
builds one `BeamSearch` per prompt and routes them, as `BeamProgram`s on an engine or
`_beam_plain` over the model's own cache; `beam_search` runs it to the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from decodekit.completion import Completion, Usage
from decodekit.decode.constrained import Constraint, token_mask
from decodekit.decode.sample import Run, UnsupportedField, completion_deltas, engine_route
from decodekit.engine.program import Feed, Forward, Program
from decodekit.models.base import LanguageModel, prefill
from decodekit.params import SamplingParams
from decodekit.request import Delta, Prompt, encode_prompt
from decodekit.sampling import SamplerState, build_chain
from decodekit.sampling.chain import Chain


@dataclass
class Hypothesis:
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)  # raw model log-probs
    scores: list[float] = field(default_factory=list)  # processed log-probs (what beam sums)
    finish_reason: str = "length"
    stop_reason: int | None = None  # the EOS or stop token that ended it
    total: float = 0.0  # sum(scores), added up as they come

    def normalised(self, alpha: float) -> float:
        return self.total / (max(len(self.tokens), 1) ** alpha)


@dataclass(frozen=True)
class Beam:
    """Beam search as a strategy (sample.py `Run`): `num_beams` kept per step, a finished
    hypothesis scored Σ log p / |y|^length_penalty, `early_stopping` (module docstring)."""

    num_beams: int = 4
    length_penalty: float = 1.0
    early_stopping: bool = True

    def prepare(
        self,
        model: LanguageModel,
        prompts: Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        constraint: Constraint | None = None,
        heal: bool | int = False,
        adapter: Chain | None = None,
    ) -> Run:
        """One search per prompt, every argument checked, routed: every prompt's search batched
        on an engine, or None: the plain loop (sample.py `engine_route`)."""
        if adapter is not None:
            raise ValueError("beam search takes no adapter: it ranks by the params' own chain")
        params = params or SamplingParams()
        searches = beam_searches(model, prompts, params, num_beams=self.num_beams,
                                 length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                                 constraint=constraint, heal=heal)  # fmt: skip
        route = engine_route(model, searches, lambda i, search: BeamProgram(model, search, i))

        def plain() -> Iterator[Delta]:
            for i, search in enumerate(searches):
                yield from completion_deltas(i, _beam_plain(model, search))

        return Run(searches, [params.n] * len(searches), route, plain)


def beam_search(
    model: LanguageModel,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | None = None,
    *,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    early_stopping: bool = True,
    constraint: Constraint | None = None,
    heal: bool | int = False,
) -> list[Completion] | list[list[Completion]]:
    """The `params.n` best hypotheses (n <= num_beams) per prompt, best first, with `score` set."""
    single = isinstance(prompts, str)
    prompt_list = [prompts] if single else list(prompts)
    strategy = Beam(num_beams, length_penalty, early_stopping)
    results = strategy.prepare(model, prompt_list, params, constraint=constraint, heal=heal).completions()
    return results[0] if single else results


def beam_searches(
    model: LanguageModel,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    *,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    early_stopping: bool = True,
    constraint: Constraint | None = None,
    heal: bool | int = False,
) -> list[BeamSearch]:
    """One search per prompt, every argument checked (`Beam.prepare` routes them)."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if params.n > num_beams:
        raise ValueError(f"n must be <= num_beams ({num_beams}), got {params.n}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if params.stop:
        raise UnsupportedField("stop", "beam search stops on EOS and stop_token_ids; stop strings are not "
                               "supported")
    searches = []
    for prompt in prompts:
        ids = encode_prompt(model, prompt, params.truncate_prompt_tokens)
        mask, ids, decode = token_mask(model, ids, 1, constraint, heal, params.ignore_eos)
        searches.append(BeamSearch(model, ids, params, num_beams, length_penalty, early_stopping,
                                   mask, decode))
    return searches


class BeamSearch:
    """The search itself, whatever computes the logits: `advance(logits)` takes the live
    beams' next-token logits [K, V] and returns, for each next beam, the index of the beam
    it extends (its token in `tokens`), or None when the search is over (`completions`)."""

    def __init__(self, model, prompt_ids, params, num_beams, alpha, early_stopping, mask, decode):
        params = params.replace(temperature=1.0)
        params.check_vocab(model.vocab_size)
        self.prompt_ids, self.params, self.num_beams = prompt_ids, params, num_beams
        self.alpha, self.early_stopping, self.mask, self.decode = alpha, early_stopping, mask, decode
        self.chain = build_chain(params, model.tokenizer)
        self.state = SamplerState(params, prompt_ids, 1, model.vocab_size, model.eos_token_ids,
                                  model.tokenizer)  # fmt: skip
        eos = set() if params.ignore_eos else set(model.eos_token_ids)
        self.stop_ids = set(params.stop_token_ids) | eos
        self.max_steps = min(params.max_new_tokens, model.max_context - len(prompt_ids))
        self.beams = [Hypothesis([])]
        self.finished: list[Hypothesis] = []
        self.tokens: list[int] = []  # each live beam's last token
        self.steps = 0
        # Set to a list to record each step's ranked candidates (the lab draws the tree):
        # (parent beam, token, processed log-prob, total, fate: live/finished/dropped/pruned).
        self.trace: list[list[tuple]] | None = None

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        params, num_beams, mask, beams = self.params, self.num_beams, self.mask, self.beams
        allowed = logits if mask is None else mask.apply(logits)  # the mask comes first
        processed = self.chain(allowed, self.state)  # [K, V]
        scores = torch.log_softmax(processed, dim=-1)
        raw = torch.log_softmax(logits, dim=-1)
        totals = torch.tensor([b.total for b in beams], device=scores.device)[:, None] + scores  # [K, V]
        # 2K candidates (one more K per extra stop token, as Hugging Face keeps) leave at least
        # K that do not stop, to refill the live beams.
        width = max(2, 1 + len(self.stop_ids)) * num_beams
        best = totals.flatten().topk(min(width, totals.numel()))
        # One read on the host: the candidates' indices, raw and processed log-probs, totals;
        # the removed (-inf) ones dropped there, not counted on the device first.
        picked = [best.indices, raw.flatten()[best.indices], scores.flatten()[best.indices], best.values]
        host = torch.stack([column.double() for column in picked]).tolist()
        finite = [i for i, total in enumerate(host[3]) if math.isfinite(total)]
        indices = [int(host[0][i]) for i in finite]
        raw_values, score_values = [host[1][i] for i in finite], [host[2][i] for i in finite]
        vocab = totals.shape[1]
        self.steps += 1
        last = self.steps == self.max_steps  # every candidate stops: out of length
        parents, tokens, next_beams, fates = [], [], [], []
        for rank, flat in enumerate(indices):
            parent, token = divmod(flat, vocab)
            beam = beams[parent]
            score = score_values[rank]
            grown = Hypothesis(beam.tokens + [token], beam.logprobs + [raw_values[rank]],
                               beam.scores + [score], total=beam.total + score)  # fmt: skip
            ends = token in self.stop_ids and len(grown.tokens) > params.min_new_tokens or (
                mask is not None and token not in self.stop_ids and mask.completes(parent, token)
            )
            if ends or last:
                # A hypothesis finishes only from the top num_beams candidates (Hugging Face's
                # `_update_finished_beams`, fairseq's `finalize_hypos` over the first beam_size);
                # the candidates below are only there to refill the live beams.
                if rank < num_beams:
                    if ends:
                        grown.finish_reason = "stop"  # EOS, a stop token, or a complete constraint
                        grown.stop_reason = token if token in self.stop_ids else None
                    self.finished = _keep_best(self.finished + [grown], num_beams, self.alpha)
                fates.append("finished" if rank < num_beams else "dropped")
            elif token not in self.stop_ids:
                parents.append(parent)
                tokens.append(token)
                next_beams.append(grown)
                fates.append("live")
            else:
                fates.append("dropped")
            if len(next_beams) == num_beams or (last and rank + 1 == num_beams):
                break
        if self.trace is not None:
            fates += ["pruned"] * (len(score_values) - len(fates))
            ranked = [divmod(flat, vocab) for flat in indices]
            self.trace.append([(parent, token, score, beams[parent].total + score, fate)
                               for (parent, token), score, fate in zip(ranked, score_values, fates)])
        self.beams = next_beams
        if not next_beams or _done(self.finished, next_beams, num_beams, self.alpha,
                                   self.early_stopping, self.steps, self.max_steps):  # fmt: skip
            self.beams = []  # out of length, or stopped early: live beams cannot beat the finished ones
            return None
        self.state.select_rows(parents)
        self.state.accept(tokens, processed[parents])  # host ints: no copy to the device and back
        if mask is not None:
            mask.select_rows(parents)
            mask.accept(tokens)
        self.tokens = tokens
        return parents

    def completions(self) -> list[Completion]:
        """The n best hypotheses, best first."""
        best = _keep_best(self.finished + self.beams, self.num_beams, self.alpha)
        return [_completion(self.decode, h, self.prompt_ids, self.alpha) for h in best[: self.params.n]]


def _beam_plain(model: LanguageModel, search: BeamSearch) -> list[Completion]:
    """The search over a model's own cache (models without paged KV)."""
    logits, cache = prefill(model, [search.prompt_ids])  # [1, V]
    while (parents := search.advance(logits)) is not None:
        cache.select(parents)
        tokens = torch.tensor(search.tokens, device=logits.device)[:, None]  # [K, 1]
        logits = model.forward(tokens, cache)[:, -1, :]  # [K, V]
    return search.completions()


class BeamProgram(Program):
    """The search on the paged engine (engine/program.py): each beam is a sequence of
    `model` (the engine's) with a RunningKV lane; a step feeds every live beam its last
    token, together with whatever else the engine runs; a beam extended by two candidates
    forks (full blocks shared, the dense row copied), a beam extended by none is closed.

    A search whose scores combine several models (a ContrastiveLM: its expert on the
    engine, its amateur a member, decode/contrastive.py `engine_programs`) gives the others
    as `members` and `combine(logits of model, logits of each member) -> scores [K, V]`:
    each beam then holds one sequence per model, fed, forked and closed together, the
    members' forwards batched with every other program's before the engine's own."""

    def __init__(self, model: LanguageModel, search: BeamSearch, prompt_index: int = 0,
                 members: Sequence[LanguageModel] = (), combine: Callable | None = None):
        if bool(members) != (combine is not None):
            raise ValueError("members and combine go together: the members' logits must be combined")
        self.model, self.search = model, search
        self.models, self.combine = (model, *members), combine
        self.prompt_index, self.num_samples = prompt_index, search.params.n
        self.beams: list[list] = []  # each live beam's sequences, one per model in `models`

    def needs(self, block_size: int) -> list[tuple[LanguageModel, int]]:
        prompt = len(self.search.prompt_ids)
        longest = prompt + self.search.max_steps
        per_beam = -(-longest // block_size) - prompt // block_size + 1  # + a copy-on-write
        # parents and their forks live together for a moment: up to 2K tables
        return [(m, prompt // block_size + 2 * self.search.num_beams * per_beam) for m in self.models]

    def step(self, kv):
        if not self.beams:
            self.beams = [[kv.open(m, self.search.prompt_ids) for m in self.models]]
        results = yield [Forward(m, [Feed(beam[i], lane=m is kv.model) for beam in self.beams])
                         for i, m in enumerate(self.models)]  # fmt: skip
        logits = [torch.cat(r) for r in results]  # per model [K, V]
        parents = self.search.advance(logits[0] if self.combine is None else self.combine(*logits))
        if parents is None:
            self.finished = True
            return self._deltas()
        taken: set[int] = set()
        grown = []
        for parent in parents:  # forks first: every parent is intact until all are taken
            beam = self.beams[parent]
            grown.append([kv.fork(seq) for seq in beam] if parent in taken else beam)
            taken.add(parent)
        for i, beam in enumerate(self.beams):
            if i not in taken:
                for seq in beam:
                    kv.close(seq)
        for beam, token in zip(grown, self.search.tokens, strict=True):
            for seq in beam:
                seq.tokens.append(token)
        self.beams = grown
        return []

    def cancel(self) -> list[Delta]:
        """The best hypotheses so far, with finish_reason "cancelled"."""
        for beam in self.search.beams:
            beam.finish_reason = "cancelled"
        return self._deltas()

    def _deltas(self) -> list[Delta]:
        return [Delta(self.prompt_index, i, c.text, c, list(c.token_ids), list(c.logprobs))
                for i, c in enumerate(self.search.completions())]  # fmt: skip


def _keep_best(hypotheses: list[Hypothesis], num_beams: int, alpha: float) -> list[Hypothesis]:
    return sorted(hypotheses, key=lambda h: h.normalised(alpha), reverse=True)[:num_beams]


def _done(finished, beams, num_beams, alpha, early_stopping, length, max_length) -> bool:
    """Whether search can stop: enough finished hypotheses and, unless early, no live beam can win."""
    if len(finished) < num_beams:
        return False
    if early_stopping:
        return True
    worst = finished[-1].normalised(alpha)
    best_total = max(b.total for b in beams)  # log-probs are <= 0: totals only fall
    # The best a live beam can reach: its total, divided by the most favourable length.
    reach = max_length if alpha > 0 else length + 1
    return best_total / (reach**alpha) <= worst


def _completion(decode, h: Hypothesis, prompt_ids, alpha) -> Completion:
    text_ids = h.tokens[:-1] if h.stop_reason is not None else h.tokens
    return Completion(
        token_ids=h.tokens,
        text=decode(text_ids),
        logprobs=h.logprobs,
        processed_logprobs=h.scores,
        finish_reason=h.finish_reason,
        usage=Usage(len(prompt_ids), len(h.tokens)),
        stop_reason=h.stop_reason,
        score=h.normalised(alpha),
    )
