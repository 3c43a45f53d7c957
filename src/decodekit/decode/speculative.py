"""Speculative decoding with token and block verification (REFERENCES.md; seeds 000, 002-004).

A drafter proposes x_1..x_γ with distributions q_1..q_γ; one target forward over the
context and the draft gives p_1..p_{γ+1}; a verification rule keeps τ draft tokens and
draws one extra token y, and the stream x_1..x_τ, y has the target's distribution exactly:

- token verification (Leviathan et al. 2023, Chen et al. 2023): accept x_i with
  probability min(1, p_i(x_i) / q_i(x_i)) until the first rejection;
- block verification (Sun et al. 2024, Algorithm 2): weights P_i = min(P_{i-1} p_i(x_i) /
  q_i(x_i), 1), acceptance probabilities h_i (Eq. 4), τ = the last i whose coin succeeds,
  residual max(P_τ p_{τ+1} - q_{τ+1}, 0); never fewer tokens in expectation (Theorem 2);
- greedy (temperature 0): accept while x_i is the target's argmax; y is the target's argmax,
  so the output equals plain greedy decoding token for token.

p and q are the request's processed distributions (its adapter chain). Adapters that read
the history (penalties, n-gram bans, DRY, min_tokens, mirostat) must see the hypothetical
draft tokens: p_{i+1} is computed with a scratch copy of the sampler state that has
accepted x_1..x_i, and the drafter draws through a scratch copy in the same way
(`drafters.DraftSampler`). So every adapter is handled exactly; nothing is refused.

Requests, and the n samples of each, run one after another, each with its own accepted
length: the target and the drafter each keep one cache row that is cropped back to the
prefix it shares with the next sequence (rejected drafts, or the next sample of the same
prompt), so no prefix is recomputed. Batched verification across rows is not implemented.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decodekit.completion import Completion
from decodekit.decode.drafters import DraftSampler, IncrementalModel, make_drafter, scratch_state
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams
from decodekit.request import Prompt, Row, make_requests, record, to_completion
from decodekit.sampling import SamplerState, draw

# (p [γ+1, V], q [γ, V], draft [γ] long, generator) -> (τ accepted draft tokens, extra token y)
VerifyRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[int, int]]


# -- verification rules ---------------------------------------------------------------------


def draft_ratios(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """p_i(x_i) / q_i(x_i) for i = 1..γ: [γ] float64."""
    gamma = len(draft)
    px = p[:gamma].double().gather(1, draft[:, None])[:, 0]
    qx = q.double().gather(1, draft[:, None])[:, 0]
    assert bool((qx > 0).all()), "a draft token must have positive draft probability"
    return px / qx


def token_acceptance(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """h_i = min(1, p_i(x_i) / q_i(x_i)): [γ]."""
    return draft_ratios(p, q, draft).clamp(max=1.0)


def block_acceptance(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sun et al. 2024, Algorithm 2: (h [γ], weights P_0..P_γ [γ + 1]).

    P_i = min(P_{i-1} p_i(x_i) / q_i(x_i), 1); for i < γ, h_i = Z_i / (Z_i + 1 - P_i) with
    Z_i = Σ_x max(P_i p_{i+1}(x) - q_{i+1}(x), 0) (Eq. 4); h_γ = P_γ. Where Z_i = 0 and
    P_i = 1 the ratio is 0/0; then P_{i+1} = 1 and some later h_j = 1, so τ > i whatever
    h_i is, and we take h_i = 0 so the empty residual is never drawn from.
    """
    gamma = len(draft)
    ratios = draft_ratios(p, q, draft)
    weights = [1.0]
    for ratio in ratios.tolist():
        weights.append(min(weights[-1] * ratio, 1.0))
    P = torch.tensor(weights, dtype=torch.float64)  # [γ + 1]
    Z = (P[1:gamma, None] * p[1:gamma].double() - q[1:gamma].double()).clamp(min=0).sum(-1)
    denominator = Z + 1.0 - P[1:gamma]
    h = torch.where(denominator > 0, Z / denominator.clamp(min=1e-300), 0.0)
    return torch.cat([h, P[gamma:]]), P


def residual(p_next: torch.Tensor, q_next: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """max(weight · p - q, 0), normalised: [V] float64 (weight 1 is token verification's)."""
    mass = (weight * p_next.double() - q_next.double()).clamp(min=0)
    if float(mass.sum()) <= 0:  # p == q up to rounding: the residual is p itself
        return p_next.double() / p_next.double().sum()
    return mass / mass.sum()


def token_verify(p, q, draft, generator) -> tuple[int, int]:
    """Token verification: accept x_i while η_i < h_i; y from the residual or p_{γ+1}."""
    gamma = len(draft)
    eta = torch.rand(gamma, generator=generator, dtype=torch.float64)
    tau = int((eta < token_acceptance(p, q, draft)).long().cumprod(0).sum()) if gamma else 0
    if tau == gamma:
        return tau, int(draw(p[gamma], generator))
    return tau, int(draw(residual(p[tau], q[tau]), generator))


def block_verify(p, q, draft, generator) -> tuple[int, int]:
    """Block verification: τ = the last i with η_i < h_i (0 if none)."""
    gamma = len(draft)
    if gamma == 0:
        return 0, int(draw(p[0], generator))
    h, P = block_acceptance(p, q, draft)
    eta = torch.rand(gamma, generator=generator, dtype=torch.float64)
    hits = (eta < h).nonzero()
    tau = int(hits[-1]) + 1 if len(hits) else 0
    if tau == gamma:
        return tau, int(draw(p[gamma], generator))
    return tau, int(draw(residual(p[tau], q[tau], float(P[tau])), generator))


def greedy_verify(p: torch.Tensor, draft: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: τ = how many x_i equal the target's argmax; y = the next argmax."""
    best = p.argmax(dim=-1)  # [γ + 1]
    tau = int((draft == best[: len(draft)]).long().cumprod(0).sum()) if len(draft) else 0
    return tau, int(best[tau])


VERIFY_RULES: dict[str, VerifyRule] = {"token": token_verify, "block": block_verify}


def tau_distribution(rule: str, p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """P(τ = i | draft) for i = 0..γ [γ + 1] under "token" (stop at the first failed coin) or
    "block" (τ = the last successful coin, h_0 = 1) verification."""
    gamma = len(draft)
    if rule == "token":
        h = torch.cat([token_acceptance(p, q, draft), torch.zeros(1, dtype=torch.float64)])
        survive = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(h[:gamma], 0)])
        return survive * (1 - h)
    if rule != "block":
        raise ValueError(f"rule must be 'token' or 'block', got {rule!r}")
    h = torch.cat([torch.ones(1, dtype=torch.float64), block_acceptance(p, q, draft)[0]])
    fail_after = torch.flip(torch.cumprod(torch.flip(1 - h, [0]), 0), [0])  # Π_{j >= i} (1 - h_j)
    return h * torch.cat([fail_after[1:], torch.ones(1, dtype=torch.float64)])


def expected_accepted(rule: str, p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> float:
    """E[τ | draft]: the accepted draft tokens a rule keeps on average for this block."""
    dist = tau_distribution(rule, p, q, draft)
    return float((dist * torch.arange(len(dist), dtype=torch.float64)).sum())


# -- configuration, statistics, result --------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeConfig:
    """γ (`num_draft_tokens`), the rule, and the adaptive schedule: after a block whose draft
    was all accepted γ += 2, else γ -= 1, kept in [1, max_draft_tokens] (HF's heuristic)."""

    num_draft_tokens: int = 4
    verify: str | VerifyRule = "block"
    adaptive: bool = False
    max_draft_tokens: int = 16

    def __post_init__(self):
        for name in ("num_draft_tokens", "max_draft_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_draft_tokens < self.num_draft_tokens:
            raise ValueError(
                f"max_draft_tokens must be >= num_draft_tokens ({self.num_draft_tokens}), "
                f"got {self.max_draft_tokens}"
            )
        if not callable(self.verify) and self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be 'block', 'token' or a rule, got {self.verify!r}")

    def rule(self) -> VerifyRule:
        return self.verify if callable(self.verify) else VERIFY_RULES[self.verify]

    def next_gamma(self, gamma: int, drafted: int, accepted: int) -> int:
        if not self.adaptive or drafted == 0:
            return gamma
        gamma = gamma + 2 if accepted == drafted else gamma - 1
        return max(1, min(gamma, self.max_draft_tokens))


@dataclass
class SpeculativeStats:
    """What a speculative run did. Block efficiency = tokens emitted per target call."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    alpha_sum: float = 0.0  # Σ over examined positions of Σ_x min(p_i(x), q_i(x))
    alpha_count: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def alpha(self) -> float:
        """Leviathan et al.'s α = E[Σ_x min(p, q)] at the positions verification examined."""
        return self.alpha_sum / self.alpha_count if self.alpha_count else 0.0

    @property
    def block_efficiency(self) -> float:
        return self.emitted_tokens / self.target_calls if self.target_calls else 0.0

    def as_dict(self) -> dict:
        keys = ("drafted_tokens", "accepted_tokens", "emitted_tokens", "target_calls", "draft_calls")
        out: dict = {key: getattr(self, key) for key in keys}
        for key in ("acceptance_rate", "alpha", "block_efficiency"):
            out[key] = round(getattr(self, key), 4)
        for key in ("draft_seconds", "target_seconds", "wall_seconds"):
            out[key] = round(getattr(self, key), 4)
        return out


@dataclass
class SpeculativeResult:
    """Completions shaped as `generate` returns them, and the run's statistics."""

    completions: list[list[Completion]] | list[Completion]
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


# -- the decoding loop ----------------------------------------------------------------------


def history_free(params: SamplingParams) -> bool:
    """True when no active adapter reads the history or other per-step state (see
    sampling/chain.py): penalties, n-gram and bad-word bans, DRY, min_tokens, mirostat."""
    p = params
    penalties = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    bans = bool(p.bad_words) or p.no_repeat_ngram_size > 0 or p.min_new_tokens > 0
    return not (penalties or bans or p.dry_multiplier > 0 or p.mirostat_tau is not None)


def process_block(chain, state: SamplerState, raw: torch.Tensor, draft: list[int]) -> torch.Tensor:
    """Processed target logits [γ+1, V] for raw [γ+1, V]: position i+1 sees x_1..x_i as history."""
    if history_free(state.params):
        return chain(raw, state)  # every position at once: nothing depends on the history
    scratch = scratch_state(state)
    rows = []
    for i in range(len(draft) + 1):
        processed = chain(raw[i : i + 1], scratch)  # [1, V]
        rows.append(processed)
        if i < len(draft):
            scratch.accept(torch.tensor([draft[i]]), processed)
    return torch.cat(rows)


def speculate_row(
    row: Row,
    state: SamplerState,
    target: IncrementalModel,
    drafter,
    config: SpeculativeConfig,
    stats: SpeculativeStats,
) -> None:
    """Generate one sample: draft, verify in one target call, emit x_1..x_τ, y; repeat."""
    request = row.request
    params, prompt, vocab = request.params, request.prompt_ids, target.model.vocab_size
    rule, gamma = config.rule(), config.num_draft_tokens
    while row.finish_reason is None:
        context = prompt + row.token_ids
        room = min(params.max_new_tokens - len(row.token_ids) - 1, target.model.max_context - len(context))
        start = time.perf_counter()
        draft = drafter.propose(context, max(0, min(gamma, room)), DraftSampler(request.chain, state, vocab))
        middle = time.perf_counter()
        raw = target.next_logits(context + draft.tokens, len(draft.tokens) + 1)  # [γ+1, V]
        stats.draft_seconds += middle - start
        stats.target_seconds += time.perf_counter() - middle
        processed = process_block(request.chain, state, raw, draft.tokens)  # [γ+1, V]
        p = torch.softmax(processed.double(), dim=-1)  # [γ+1, V]
        x = torch.as_tensor(draft.tokens, dtype=torch.long)  # [γ]
        if params.greedy:
            tau, y = greedy_verify(processed, x)
        else:
            tau, y = rule(p, draft.probs, x, state.generator)
        emitted = 0
        for i, token in enumerate(draft.tokens[:tau] + [y]):
            chosen = torch.tensor([token])
            state.accept(chosen, processed[i : i + 1])
            # The emitted token is distributed as p_{i+1}: report that as its processed logprob.
            record([row], raw[i : i + 1], processed[i : i + 1], chosen)
            emitted += 1
            if row.finish_reason is None and len(prompt) + len(row.token_ids) >= target.model.max_context:
                row.finish_reason = "length"  # the context window is full
            if row.finish_reason is not None:
                break
        examined = min(tau + 1, len(draft.tokens))
        stats.alpha_sum += float(torch.minimum(p[:examined], draft.probs[:examined]).sum())
        stats.alpha_count += examined
        stats.drafted_tokens += len(draft.tokens)
        stats.accepted_tokens += tau
        stats.emitted_tokens += emitted
        stats.target_calls += 1
        stats.draft_calls += draft.model_calls
        gamma = config.next_gamma(gamma, len(draft.tokens), tau)


def speculative_generate(
    target: LanguageModel,
    draft: object,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    num_draft_tokens: int = 4,
    verify: str | VerifyRule = "block",
    adaptive: bool = False,
    max_draft_tokens: int = 16,
) -> SpeculativeResult:
    """Sample from `target` exactly as `generate` would, drafting with `draft`.

    draft: a LanguageModel over the target's vocabulary (e.g. `load_model("shakespeare-draft")`
    or an `NGramLM`), "prompt-lookup", "self-int4" (the target's own int4 copy, drafters.py),
    "auto" (the embedded `<target>-draft`), a model name,
    or any object with `propose` (drafters.Drafter). verify: "block", "token", or a rule
    `(p, q, draft, generator) -> (τ, y)`. Completions are shaped as `generate` returns them
    (a single string prompt gives its list of n); `result.stats` holds the counters.
    """
    config = SpeculativeConfig(num_draft_tokens, verify, adaptive, max(max_draft_tokens, num_draft_tokens))
    drafter = make_drafter(draft, target)
    single = isinstance(prompts, str)
    prompt_list = [prompts] if single else list(prompts)
    if not prompt_list:
        raise ValueError("prompts must contain at least one prompt")
    start = time.perf_counter()
    stats = SpeculativeStats()
    runner = IncrementalModel(target)
    results: list[list[Completion]] = []
    for request in make_requests(target, prompt_list, params):
        completions = []
        for row in request.rows:
            # One single-row state per sample, all drawing from the request's seeded generator.
            state = SamplerState(request.params, request.prompt_ids, 1, target.vocab_size,
                                 target.eos_token_ids, target.tokenizer)  # fmt: skip
            state.generator = request.state.generator
            speculate_row(row, state, runner, drafter, config, stats)
            completions.append(to_completion(row))
        results.append(completions)
    stats.wall_seconds = time.perf_counter() - start
    return SpeculativeResult(results[0] if single else results, stats)
