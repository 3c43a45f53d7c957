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

On a target with paged KV (NativeLM) every request is a `SpeculativeProgram` on the
target's persistent engine: each engine step is one round for every live sample of every
speculative request, the γ draft positions as γ batched forwards of the draft model (its
own block pool on the engine), the verification as the samples' feeds in the step's one
target forward; rejected tokens are cropped from both block tables. Other targets run the
samples one after another, target and drafter each keeping one cache row cropped back to
the prefix it shares with the next sequence. Either way a row may decode plainly while its
speculation does not pay (`fallback`, speculation_gate.py). Both run the same round (`settle_block`), and
sample i draws from its own generator seeded `seed + i` (`row_state`), batched or alone.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from decodekit.completion import Completion
from decodekit.decode.drafters import (
    Draft,
    Drafter,
    DraftSampler,
    IncrementalModel,
    ModelDrafter,
    common_prefix,
    empty_draft,
    make_drafter,
    sample_drafter,
    scratch_state,
)
from decodekit.decode.sample import Run, completion_deltas, engine_route
from decodekit.decode.speculation_gate import SpeculationGate, StepBatch, StepCosts
from decodekit.decode.verification import VERIFY_RULES, VerifyRule, greedy_verify
from decodekit.engine.program import Feed, Forward, Program, ProgramKV, Seq
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams
from decodekit.request import (
    Delta,
    Prompt,
    Request,
    Row,
    cancel_rows,
    emit,
    make_requests,
    record,
    to_completion,
)
from decodekit.sampling import SamplerState
from decodekit.sampling.adapters import active_adapters

# -- configuration, statistics, result --------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeConfig:
    """γ (`num_draft_tokens`), the rule, and the adaptive schedule: after a block whose draft
    was all accepted γ += 2, else γ -= 1, kept in [1, max_draft_tokens] (HF's heuristic).
    fallback: each row decodes plainly while its measured acceptance does not pay for a
    block's measured cost, and re-probes now and then (speculation_gate.py); None (the
    default): unless the request is seeded and samples (`falls_back`)."""

    num_draft_tokens: int = 4
    verify: str | VerifyRule = "block"
    adaptive: bool = False
    max_draft_tokens: int = 16
    trace: Callable[[BlockTrace], None] | None = None  # called with every verified block
    fallback: bool | None = None  # a row decodes plainly while speculation does not pay

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
        if self.fallback is not None and not isinstance(self.fallback, bool):
            raise TypeError(f"fallback must be True, False or None (automatic), got {self.fallback!r}")

    def falls_back(self, params: SamplingParams) -> bool:
        """Whether a request's rows may switch to plain decoding: `fallback`, or by default
        unless the request is seeded and samples. The switches follow measured time
        (speculation_gate.py), so such a request's draws would not repeat; its distribution
        would be the target's all the same."""
        if self.fallback is not None:
            return self.fallback
        return params.greedy or params.seed is None

    def rule(self) -> VerifyRule:
        return self.verify if callable(self.verify) else VERIFY_RULES[self.verify]

    def next_gamma(self, gamma: int, drafted: int, accepted: int) -> int:
        if not self.adaptive or drafted == 0:
            return gamma
        gamma = gamma + 2 if accepted == drafted else gamma - 1
        return max(1, min(gamma, self.max_draft_tokens))


@dataclass
class BlockTrace:
    """One verified block, as `settle_block` saw it (`speculative_generate(trace=...)`; the
    lab draws it): the draft x [γ] and its probabilities q [γ, V], the target's processed
    logits [γ+1, V] and probabilities p, τ and y, and the state of the row's generator
    before the rule drew its uniforms (None at T = 0), so another rule can be run on the same
    draft and the same uniforms."""

    row: Row
    draft: list[int]
    q: torch.Tensor
    processed: torch.Tensor
    p: torch.Tensor
    tau: int
    y: int
    generator_state: torch.Tensor | None


@dataclass
class SpeculativeStats:
    """What a speculative run did. Block efficiency = tokens emitted per target call."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    plain_steps: int = 0  # steps a row decoded without a draft: speculation did not pay (fallback)
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
        keys = ("drafted_tokens", "accepted_tokens", "emitted_tokens", "target_calls", "draft_calls",
                "plain_steps")
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
    """True when no adapter of the chain reads the history or other per-step state (each
    adapter declares it: sampling/adapters.py `reads_history`)."""
    return not any(adapter.reads_history for adapter in active_adapters(params))


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
            scratch.accept(torch.tensor([draft[i]], device=processed.device), processed)
    return torch.cat(rows)


def row_state(request: Request, sample: int, model: LanguageModel) -> SamplerState:
    """One sample's sampler state, with its own generator seeded `seed + sample` (the request's
    seed, or its fresh one): sample i of a request draws exactly what a one-sample request
    with seed `seed + i` draws, whether the rows run one after another or batched."""
    state = SamplerState(request.params, request.prompt_ids, 1, model.vocab_size,
                         model.eos_token_ids, model.tokenizer)  # fmt: skip
    state.generator = torch.Generator().manual_seed(request.state.seed + sample)
    return state


def draft_budget(row: Row, gamma: int, max_context: int) -> int:
    """How many tokens to draft now: γ, but none past max_new_tokens - 1 (the block's extra
    token y is always emitted) or the target's context window."""
    generated = len(row.token_ids)
    context = len(row.request.prompt_ids) + generated
    room = min(row.request.params.max_new_tokens - generated - 1, max_context - context)
    return max(0, min(gamma, room))


def settle_block(
    row: Row,
    state: SamplerState,
    raw: torch.Tensor,
    draft: Draft,
    config: SpeculativeConfig,
    stats: SpeculativeStats,
    max_context: int,
) -> int:
    """Verify one block and emit x_1..x_τ, y into the row; returns τ.

    raw: the target's logits [γ+1, V] after the context's last token and each draft token.
    """
    params = row.request.params
    processed = process_block(row.request.chain, state, raw, draft.tokens)  # [γ+1, V]
    p = torch.softmax(processed.double(), dim=-1)  # [γ+1, V]
    # Verification runs where the target's logits are; a draft from another device (an
    # n-gram model on the CPU) is moved once.
    draft = Draft(draft.tokens, draft.probs.to(p.device), draft.model_calls)
    x = torch.tensor(draft.tokens, dtype=torch.long, device=p.device)  # [γ]
    uniforms = state.generator.get_state() if config.trace is not None and not params.greedy else None
    if params.greedy:
        tau, y = greedy_verify(processed, x)
    else:
        tau, y = config.rule()(p, draft.probs, x, state.generator)
    if config.trace is not None:
        config.trace(BlockTrace(row, list(draft.tokens), draft.probs, processed, p, tau, y, uniforms))
    emitted = 0
    for i, token in enumerate(draft.tokens[:tau] + [y]):
        chosen = torch.tensor([token], device=processed.device)
        state.accept(chosen, processed[i : i + 1])
        # The emitted token is distributed as p_{i+1}: report that as its processed logprob.
        record([row], raw[i : i + 1], processed[i : i + 1], chosen)
        emitted += 1
        if row.finish_reason is None and len(row.request.prompt_ids) + len(row.token_ids) >= max_context:
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
    return tau


def speculate_row(
    row: Row,
    state: SamplerState,
    target: IncrementalModel,
    drafter: Drafter,
    config: SpeculativeConfig,
    stats: SpeculativeStats,
) -> None:
    """Generate one sample over a model's own cache: draft, verify in one target call, emit
    x_1..x_τ, y (`settle_block`); repeat. With the fallback a gate chooses each round's
    draft length, 0 (a plain step) while speculation does not pay (speculation_gate.py)."""
    request, model = row.request, target.model
    gamma = config.num_draft_tokens
    gate, costs = (SpeculationGate(), StepCosts()) if config.falls_back(request.params) else (None, None)
    step = 0
    while row.finish_reason is None:
        step += 1
        context = request.prompt_ids + row.token_ids
        start = time.perf_counter()
        length = gamma if gate is None else gate.draft_tokens(gamma, costs, step)
        budget = draft_budget(row, length, model.max_context)
        if budget:
            draft = drafter.propose(context, budget, DraftSampler(request.chain, state, model.vocab_size))
        else:
            draft = empty_draft(model.vocab_size, model.device)
        middle = time.perf_counter()
        raw = target.next_logits(context + draft.tokens, len(draft.tokens) + 1)  # [γ+1, V]
        stats.draft_seconds += middle - start
        stats.target_seconds += time.perf_counter() - middle
        tau = settle_block(row, state, raw, draft, config, stats, model.max_context)
        gamma = config.next_gamma(gamma, len(draft.tokens), tau)
        if gate is not None:
            if len(context) > len(request.prompt_ids):  # the first round's seconds include the prompt's
                costs.record(time.perf_counter() - start, len(draft.tokens))
            gate.settle(len(draft.tokens), tau, gamma, costs, step)
            stats.plain_steps += not draft.tokens


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding as a strategy (sample.py `Run`), the arguments of `speculative_generate`.

    draft: a LanguageModel over the target's vocabulary (e.g. `load_model("shakespeare-draft")`
    or an `NGramLM`), "prompt-lookup", "self-int4" (the target's own int4 copy, drafters.py),
    "auto" (the embedded `<target>-draft`), a model name, or any object with `propose`
    (drafters.Drafter). verify: "block", "token", or a rule `(p, q, draft, generator) -> (τ,
    y)`. trace: called with each verified block (`BlockTrace`). fallback: a row whose
    speculation does not pay decodes plainly until a probe says it does (speculation_gate.py);
    None: unless the request is seeded and samples (`SpeculativeConfig.falls_back`).
    """

    draft: object = "auto"
    num_draft_tokens: int = 4
    verify: str | VerifyRule = "block"
    adaptive: bool = False
    max_draft_tokens: int = 16
    trace: Callable[[BlockTrace], None] | None = None
    fallback: bool | None = None

    def prepare(
        self,
        target: LanguageModel,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        constraint: object = None,
        heal: bool | int = False,
        adapter: object = None,
    ) -> SpeculativeRun:
        """One request per prompt, every argument checked, routed: a `SpeculativeProgram` each on
        a paged-KV target's engine, else the plain loop (`speculate_row`, sample after sample)."""
        if constraint is not None or heal or adapter is not None:
            raise ValueError("speculative decoding takes no constraint, heal or adapter")
        start = time.perf_counter()
        config = speculative_config(self.num_draft_tokens, self.verify, self.adaptive, self.max_draft_tokens,
                                    self.trace, self.fallback)  # fmt: skip
        drafter = make_drafter(self.draft, target)
        requests = make_requests(target, list(prompts), params)
        check_length_dependent_rope(target, requests)
        route = engine_route(target, requests, lambda _, r: SpeculativeProgram(target, drafter, r, config),
                             delegate=False)  # verification needs the target's own logits  # fmt: skip
        stats = SpeculativeStats()

        def plain() -> Iterator[Delta]:
            runner = IncrementalModel(target)
            for request in requests:
                for row in request.rows:
                    speculate_row(row, row_state(request, row.sample, target), runner, drafter, config, stats)
                yield from completion_deltas(request.index, [to_completion(row) for row in request.rows])

        return SpeculativeRun(requests, [len(r.rows) for r in requests], route, plain, stats, start)


@dataclass
class SpeculativeRun(Run):
    """A speculative run (sample.py `Run`) and its statistics."""

    plain_stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    start: float = 0.0  # when `prepare` began: wall_seconds counts building the drafter

    def stats(self) -> SpeculativeStats:
        """The counters so far: the programs' merged on the engine, the plain loop's otherwise."""
        programs = self.route[1] if self.route is not None else []
        stats = merged_stats([program.stats for program in programs]) if programs else self.plain_stats
        stats.wall_seconds = time.perf_counter() - self.start
        return stats


def speculative_generate(
    target: LanguageModel,
    draft: object,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    num_draft_tokens: int = 4,
    verify: str | VerifyRule = "block",
    adaptive: bool = False,
    max_draft_tokens: int = 16,
    trace: Callable[[BlockTrace], None] | None = None,
    fallback: bool | None = None,
) -> SpeculativeResult:
    """Sample from `target` exactly as `generate` would, drafting with `draft` (the arguments:
    `Speculative`). Completions are shaped as `generate` returns them (a single string prompt
    gives its list of n); `result.stats` holds the counters. A paged-KV target runs every
    sample batched on its engine (`SpeculativeProgram`), another one after another over its
    own cache; sample i draws as seed + i (`row_state`).
    """
    single = isinstance(prompts, str)
    prompt_list = [prompts] if single else list(prompts)
    if not prompt_list:
        raise ValueError("prompts must contain at least one prompt")
    strategy = Speculative(draft, num_draft_tokens, verify, adaptive, max_draft_tokens, trace, fallback)
    run = strategy.prepare(target, prompt_list, params)
    results = run.completions()
    return SpeculativeResult(results[0] if single else results, run.stats())


def check_length_dependent_rope(target: LanguageModel, requests: list[Request]) -> None:
    """Refuse a prompt longer than a dynamic-NTK or LongRoPE target's threshold (its trained
    positions; LongRoPE's switch to its long factors). Past it a forward's frequencies depend
    on its length: a verification gives each token its own
    length's, as decoding does (batch.py `build_batch`), but a prompt's tokens share the
    prompt's length, and speculation prefills all but the prompt's last token, so their keys
    would not be the ones plain decoding computes."""
    rope = getattr(getattr(target, "config", None), "rope", None)
    if rope is None or rope.threshold is None:
        return
    for request in requests:
        if len(request.prompt_ids) > rope.threshold:
            raise ValueError(
                f"speculative decoding is exact only for prompts within a {rope.kind}-RoPE model's "
                f"{rope.threshold} trained positions; this prompt has {len(request.prompt_ids)} "
                "tokens: shorten it or decode without speculation"
            )


def speculative_config(num_draft_tokens, verify, adaptive, max_draft_tokens, trace=None,
                       fallback=None) -> SpeculativeConfig:  # fmt: skip
    longest = max(max_draft_tokens, num_draft_tokens)
    return SpeculativeConfig(num_draft_tokens, verify, adaptive, longest, trace, fallback)


def merged_stats(parts: list[SpeculativeStats]) -> SpeculativeStats:
    """The counters of programs that ran batched, summed; their seconds are the longest
    program's (they waited on the same forwards)."""
    total = SpeculativeStats()
    for part in parts:
        for key, value in vars(part).items():
            merge = max if key.endswith("_seconds") else operator.add
            setattr(total, key, merge(getattr(total, key), value))
    return total


# -- on the paged engine ------------------------------------------------------------------------


def speculative_programs(
    target: LanguageModel,
    draft: object,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    num_draft_tokens: int = 4,
    verify: str | VerifyRule = "block",
    adaptive: bool = False,
    max_draft_tokens: int = 16,
    fallback: bool | None = None,
) -> list[SpeculativeProgram]:
    """One `SpeculativeProgram` per prompt (the arguments of `speculative_generate`), to run on
    the target's engine (`Engine.add`, `engine.engine.run_requests`); each streams
    its samples' deltas and keeps its own `stats`. Raises ValueError/TypeError for bad input."""
    if engine_route(target, [], delegate=False) is None:
        raise TypeError(f"speculative programs run on a paged-KV target, got {type(target).__name__}")
    strategy = Speculative(draft, num_draft_tokens, verify, adaptive, max_draft_tokens, None, fallback)
    return strategy.prepare(target, prompts, params).route[1]


@dataclass(eq=False)
class SpecRow:
    """One sample on the engine: its row, sampler state, γ, sequences and the block being built."""

    row: Row
    state: SamplerState
    gamma: int
    drafter: Drafter | None  # a drafter that proposes in Python; None with a paged draft model
    target: Seq | None = None
    draft: Seq | None = None
    budget: int = 0
    sampler: DraftSampler | None = None
    tokens: list[int] = field(default_factory=list)  # this block's draft
    probs: list[torch.Tensor] = field(default_factory=list)  # their q [V] each
    model_calls: int = 0  # the Python drafter's, for this block
    gate: SpeculationGate | None = None  # with `fallback`: how many tokens it drafts this step

    @property
    def context(self) -> list[int]:
        return self.row.request.prompt_ids + self.row.token_ids


class SpeculativeProgram(Program):
    """A request's speculative decoding on the paged engine (engine/program.py).

    Every engine step is one round for each live sample: γ draft forwards (one token per
    sample each, a yielded forward on the draft model, so the drafts of every speculative
    program on the engine run together), then one target forward over each sample's context
    tail and draft with the logits of every position (joining the step's single forward),
    then `settle_block` per sample, as the plain loop does. Rejected tokens are cropped from
    both sequences. A drafter without paged KV (prompt lookup, a k-gram, the target itself)
    proposes in Python, one per sample. The prompt is prefilled once (all but its last
    token, on both models) and forked into the n samples. With the fallback each sample's
    gate (speculation_gate.py) sets its draft length per step; a sample without a draft
    feeds one token on a RunningKV lane, sampled by the engine with the step's other rows
    when it is its request's only one, and its draft model catches up when it drafts again.
    """

    def __init__(self, target: LanguageModel, drafter: Drafter, request: Request, config: SpeculativeConfig):
        self.target, self.request, self.config = target, request, config
        self.stats = SpeculativeStats()
        self.prompt_index, self.num_samples = request.index, len(request.rows)
        # A draft model on the engine: with paged KV, not the target (its forwards are the
        # step's), and long enough for the prompt (else every draft is empty).
        model = getattr(drafter, "model", None)
        paged = isinstance(drafter, ModelDrafter) and model is not target and model.supports_paged_kv and (
            len(request.prompt_ids) <= model.max_context)
        self.draft_model = model if paged else None
        # One sample: its request's own state (the same seed as `row_state`'s), so the engine
        # can sample its plain steps with the step's other rows (program.py `Feed.row`).
        self.single = len(request.rows) == 1
        self.fallback = config.falls_back(request.params)
        self.rows = [SpecRow(row, request.state if self.single else row_state(request, row.sample, target),
                             config.num_draft_tokens, None if paged else sample_drafter(drafter),
                             gate=SpeculationGate() if self.fallback else None)
                     for row in request.rows]  # fmt: skip
        self.costs = StepCosts()  # this program's step seconds, plain and speculative (fallback)
        self.switch_seconds = 0.0  # this step's seconds of switching rows back to speculation
        self.steps = 0  # its decode steps so far: the gates' clock
        self.started = False

    def needs(self, block_size: int) -> list[tuple[LanguageModel, int]]:
        prompt, params = len(self.request.prompt_ids), self.request.params
        shared = (prompt - 1) // block_size  # the prefilled prompt's full blocks
        longest = min(prompt + params.max_new_tokens, self.target.max_context)
        per_row = -(-longest // block_size) - shared + 1  # + a copy-on-write
        blocks = shared + len(self.rows) * per_row
        models = [self.target] + ([self.draft_model] if self.draft_model is not None else [])
        return [(model, blocks) for model in models]

    def step(self, kv: ProgramKV):
        start = time.perf_counter()
        first = not self.started  # its seconds include the prompt's: not a cost sample
        if first:
            self.started = True
            if (yield from self._prefill(kv)):
                self.stats.target_seconds += time.perf_counter() - start
                return []  # the step's target forward prefilled the prompt
        live = [r for r in self.rows if r.row.finish_reason is None]
        vocab, window = self.target.vocab_size, self.target.max_context
        self.steps += 1
        self.switch_seconds = 0.0
        for r in live:
            gamma = r.gamma if r.gate is None else r.gate.draft_tokens(r.gamma, self.costs, self.steps)
            r.budget = draft_budget(r.row, gamma, window)
            r.sampler = DraftSampler(self.request.chain, r.state, vocab) if r.budget else None
            r.tokens, r.probs, r.model_calls = [], [], 0
        yield from self._draft(live, kv)
        middle = time.perf_counter()
        self.stats.draft_seconds += middle - start
        # The step's rows, for the gates' share of its cost (speculation_gate.py), rows of
        # programs without the fallback too.
        batch = kv.shared.setdefault(StepBatch, StepBatch())
        batch.join(self, [len(r.tokens) for r in live], sum(r.target.lane is None for r in live), kv.lanes())
        for r in live:
            if r.tokens:
                switched = time.perf_counter()
                kv.leave_lane(r.target)  # a block is verified over its KV blocks
                self.switch_seconds += time.perf_counter() - switched
            r.target.tokens += r.tokens
        # With the fallback a row without a draft decodes as a sampling row does: on a lane, and
        # sampled by the engine with the step's other rows when it is its request's only one.
        plain = [self.fallback and not r.tokens for r in live]
        feeds = [Feed(r.target, every=not alone, lane=alone, row=r.row if alone and self.single else None)
                 for r, alone in zip(live, plain, strict=True)]  # fmt: skip
        [logits] = yield [Forward(self.target, feeds)]  # per row [count >= γ+1, V]
        self.stats.target_seconds += time.perf_counter() - middle
        taus = []
        for r, raw, feed in zip(live, logits, feeds, strict=True):
            if feed.row is not None:  # the engine sampled its token
                tau = 0
                self.stats.emitted_tokens += 1
                self.stats.target_calls += 1
            else:
                probs = torch.stack(r.probs) if r.probs else empty_draft(vocab, raw.device).probs
                draft = Draft(r.tokens, probs, len(r.tokens) if r.drafter is None else r.model_calls)
                raw = raw[len(raw) - len(r.tokens) - 1 :]  # [γ+1, V]
                tau = settle_block(r.row, r.state, raw, draft, self.config, self.stats, window)
            taus.append(tau)
            r.gamma = self.config.next_gamma(r.gamma, len(r.tokens), tau)
            if r.target.lane is not None:
                r.target.tokens.append(r.row.token_ids[-1])  # a plain step: nothing to crop
            else:
                follow(kv, r.target, r.context)  # rejected draft tokens out, y in
            if r.row.finish_reason is not None:
                for seq in (r.target, r.draft):
                    if seq is not None:
                        kv.close(seq)
        batch.settled = True  # the next join is the next step's
        if self.fallback:
            if not first:  # less the switch back (once per plain stretch, not per draft token)
                seconds = time.perf_counter() - start - self.switch_seconds
                self.costs.record(seconds, batch.longest, batch.drafting)
            for r, tau in zip(live, taus, strict=True):
                r.gate.settle(len(r.tokens), tau, r.gamma, self.costs, self.steps, batch.rows, batch.drafting)
                self.stats.plain_steps += not r.tokens
        self.finished = all(r.row.finish_reason is not None for r in self.rows)
        return list(emit([r.row for r in live], self.target.max_context))

    def _prefill(self, kv: ProgramKV):
        """Open the prompt (but its last token) on the target and draft model, compute what
        the prefix cache lacks, and fork it into the samples. Returns whether the target's
        forward was used."""
        head = self.request.prompt_ids[:-1]
        models = [self.target] + ([self.draft_model] if self.draft_model is not None else [])
        bases = [kv.open(model, head) for model in models]
        pending = [seq for seq in bases if seq.pending]
        if pending:
            yield [Forward(seq.model, [Feed(seq)]) for seq in pending]
        forks = [[base] + [kv.fork(base) for _ in self.rows[1:]] for base in bases]
        for r, seqs in zip(self.rows, zip(*forks, strict=True), strict=True):
            r.target, r.draft = seqs[0], seqs[1] if len(seqs) > 1 else None
            for seq in seqs:
                seq.tokens.append(self.request.prompt_ids[-1])
        return bool(pending) and pending[0] is bases[0]

    def _draft(self, live: list[SpecRow], kv: ProgramKV):
        """This round's draft of every live sample that drafts: in Python, or one draft-model
        forward per position over the samples still drafting (each first follows its context:
        the last block's rejected tokens out, the tokens of its plain steps in)."""
        for r in live:
            if r.drafter is not None and r.budget:
                draft = r.drafter.propose(r.context, r.budget, r.sampler)
                r.tokens, r.probs, r.model_calls = draft.tokens, list(draft.probs), draft.model_calls
        for r in live:
            if r.draft is not None and r.budget:
                follow(kv, r.draft, r.context)
                # The draft model's context window, as `ModelDrafter.propose` limits it.
                r.budget = min(r.budget, self.draft_model.max_context - len(r.context) + 1)
        # A draft model behind by more than a block's two tokens (the row's plain steps) catches
        # up in a forward of its own, timed apart: a cost of switching back to speculation once,
        # not of each draft token (the gate's c). Its last token is the first draft forward's.
        behind = [r for r in live if r.draft is not None and r.budget and r.draft.pending > 2]
        if behind:
            held = [r.draft.tokens.pop() for r in behind]
            switched = time.perf_counter()
            yield [Forward(self.draft_model, [Feed(r.draft) for r in behind])]
            self.switch_seconds += time.perf_counter() - switched
            for r, token in zip(behind, held, strict=True):
                r.draft.tokens.append(token)
        while drafting := [r for r in live if r.draft is not None and len(r.tokens) < r.budget]:
            [logits] = yield [Forward(self.draft_model, [Feed(r.draft) for r in drafting])]
            for r, out in zip(drafting, logits, strict=True):
                token, q = r.sampler.draw(out[-1])
                r.tokens.append(token)
                r.probs.append(q)
                r.draft.tokens.append(token)

    def cancel(self) -> list[Delta]:
        return cancel_rows([r.row for r in self.rows])


def follow(kv: ProgramKV, seq: Seq, context: list[int]) -> None:
    """Point `seq` at `context`: keep the KV of the prefix they share (never the last token's,
    whose logits the next round needs) and make the rest pending."""
    computed = seq.tokens[: seq.table.length]
    keep = min(common_prefix(computed, context), len(context) - 1)
    kv.crop(seq, keep)
    seq.tokens += context[keep:]
