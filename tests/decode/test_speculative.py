"""Speculative decoding: both verification rules are lossless (by exact enumeration and by
chi-square against the target's exact sequence distribution), greedy output equals plain
greedy decoding, drafters propose what they should, caches roll back without recomputing."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from fractions import Fraction

import pytest
import torch

import decodekit as dk
from decodekit.decode.drafters import IncrementalModel, PromptLookupDrafter
from decodekit.decode.speculative import SpeculativeConfig, speculative_generate, speculative_programs
from decodekit.decode.verification import (
    block_acceptance,
    block_verify,
    expected_accepted,
    residual,
    tau_distribution,
    token_verify,
)
from decodekit.models.base import Cache, LanguageModel
from decodekit.sampling import SamplerState, build_chain, draw

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- a tabular language model: logits of the next token given the previous two ---------------


class HistoryCache(Cache):
    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    @property
    def length(self) -> int:
        return len(self.rows[0])

    def fork(self, rows):
        return HistoryCache([list(self.rows[r]) for r in rows])

    def select(self, rows):
        self.rows = [list(self.rows[r]) for r in rows]

    def crop(self, length: int):
        self.rows = [row[:length] for row in self.rows]


class TableLM(LanguageModel):
    """logits(next | a, b) = table[a, b] for the two previous tokens; `start` (= V) stands
    before the first token. Counts the tokens it is fed, to check cache reuse."""

    def __init__(self, table: torch.Tensor, name: str = "table"):
        self.table = table  # [V + 1, V, V]
        self.vocab_size = table.shape[-1]
        self.name, self.tokenizer, self.eos_token_ids, self.max_context = name, None, (), 1000
        self.fed = 0

    def new_cache(self, batch_size: int) -> HistoryCache:
        return HistoryCache([[] for _ in range(batch_size)])

    def forward(self, tokens, cache, mask=None):
        assert mask is None or bool(mask.all())
        out = []
        for row, new in zip(cache.rows, tokens.tolist(), strict=True):
            start = len(row)
            row.extend(new)
            previous = [self.vocab_size] + row
            out.append(torch.stack([self.table[previous[t], row[t]] for t in range(start, len(row))]))
        self.fed += tokens.numel()
        return torch.stack(out).float()  # [B, T, V]

    def probs(self, context: list[int]) -> torch.Tensor:
        previous = self.vocab_size if len(context) < 2 else context[-2]
        return torch.softmax(self.table[previous, context[-1]].double(), dim=-1)


def table_lm(seed: int, vocab: int = 4, sharpness: float = 1.5, name: str = "table") -> TableLM:
    generator = torch.Generator().manual_seed(seed)
    return TableLM(sharpness * torch.randn(vocab + 1, vocab, vocab, generator=generator), name)


def sequence_distribution(model: TableLM, prompt: list[int], length: int, params=None) -> dict:
    """Exact probability of every continuation of `length` tokens under the (processed) model."""
    params = params or dk.SamplingParams()
    chain = build_chain(params)
    out = {}
    for seq in itertools.product(range(model.vocab_size), repeat=length):
        state = SamplerState(params, prompt, 1, model.vocab_size)
        prob = 1.0
        for i, token in enumerate(seq):
            context = prompt + list(seq[:i])
            logits = torch.log(model.probs(context)).float()[None]
            processed = chain(logits, state)
            prob *= float(torch.softmax(processed.double(), -1)[0, token])
            state.accept(torch.tensor([token]), processed)
        out[seq] = prob
    return out


def chi_square_pvalue(counts: Counter, expected: dict, total: int) -> float:
    """Pearson's test, pooling cells of expected count < 5 into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, prob in expected.items():
        if total * prob < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += total * prob
        else:
            stat += (counts.get(key, 0) - total * prob) ** 2 / (total * prob)
            cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    assert sum(counts.values()) == total
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- exact enumeration ---------------------------------------------------------------------------


def block_inputs(p_of, q_of, context, draft):
    p = torch.stack([p_of(context + draft[:i]) for i in range(len(draft) + 1)])  # [γ+1, V]
    q = torch.stack([q_of(context + draft[:i]) for i in range(len(draft))])  # [γ, V]
    return p, q


def enumerated_accepted(rule: str, p_of, q_of, vocab: int, gamma: int, context=()) -> float:
    """E[τ] by enumerating every draft block."""
    total = 0.0
    for draft in itertools.product(range(vocab), repeat=gamma):
        draft = list(draft)
        p, q = block_inputs(p_of, q_of, list(context), draft)
        q_draft = math.prod(float(q[i, x]) for i, x in enumerate(draft))
        total += q_draft * expected_accepted(rule, p, q, torch.tensor(draft))
    return total


def output_distribution(rule: str, p_of, q_of, vocab: int, gamma: int, wrong=False) -> dict:
    """Exact distribution of one block's output x_1..x_τ, y continued by the target to γ + 1
    tokens: lossless means this is the target's distribution of γ + 1 tokens."""
    out: Counter = Counter()
    for draft in itertools.product(range(vocab), repeat=gamma):
        draft = list(draft)
        p, q = block_inputs(p_of, q_of, [], draft)
        q_draft = math.prod(float(q[i, x]) for i, x in enumerate(draft))
        _, P = block_acceptance(p, q, torch.tensor(draft))
        for tau, w in enumerate(tau_distribution(rule, p, q, torch.tensor(draft)).tolist()):
            if tau == gamma or wrong:
                ys = p[tau]
            else:
                ys = residual(p[tau], q[tau], float(P[tau]) if rule == "block" else 1.0)
            for y in range(vocab):
                prefix = draft[:tau] + [y]
                for rest in itertools.product(range(vocab), repeat=gamma - tau):
                    seq, prob = prefix + list(rest), q_draft * w * float(ys[y])
                    for i in range(tau + 1, gamma + 1):
                        prob *= float(p_of(seq[:i])[seq[i]])
                    out[tuple(seq)] += prob
    return out


CONTEXT_FREE_P = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
CONTEXT_FREE_Q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)


def test_enumeration_gives_published_10_9_and_11_9():
    # REFERENCES.md: target (1/3, 2/3), draft (2/3, 1/3), γ = 2.
    # By hand for token verification: α = Σ min(p, q) = 2/3, E[τ] = α + α² = 10/9.
    def p_of(_):
        return CONTEXT_FREE_P

    def q_of(_):
        return CONTEXT_FREE_Q

    token = enumerated_accepted("token", p_of, q_of, 2, 2)
    block = enumerated_accepted("block", p_of, q_of, 2, 2)
    assert Fraction(token).limit_denominator(100) == Fraction(10, 9)
    assert Fraction(block).limit_denominator(100) == Fraction(11, 9)
    assert token == pytest.approx(10 / 9, abs=1e-12) and block == pytest.approx(11 / 9, abs=1e-12)


@pytest.mark.parametrize("rule, verify, expected", [("token", token_verify, 10 / 9),
                                                    ("block", block_verify, 11 / 9)])
def test_simulated_verification_agrees_with_enumeration(rule, verify, expected):
    generator = torch.Generator().manual_seed(0)
    p, q = CONTEXT_FREE_P.expand(3, 2), CONTEXT_FREE_Q.expand(2, 2)
    taus = []
    for _ in range(6000):
        draft = torch.multinomial(q, 1, generator=generator)[:, 0]  # x_i ~ q_i
        taus.append(verify(p, q, draft, generator)[0])
    taus = torch.tensor(taus, dtype=torch.float64)
    half_width = 4 * float(taus.std()) / math.sqrt(len(taus))  # ±4 standard errors
    assert abs(float(taus.mean()) - expected) < half_width
    assert half_width < 1 / 18  # narrow enough to tell 10/9 from 11/9


def random_conditionals(seed: int, vocab: int, sharpness: float = 2.0):
    """A context-dependent distribution p(. | prefix) as a function, from a seeded table."""
    table = torch.softmax(sharpness * torch.randn(
        vocab**3, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), -1)

    def of(prefix):
        key = sum(t * vocab**i for i, t in enumerate(prefix)) + len(prefix) * 7
        return table[key % vocab**3]

    return of


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_one_block_is_exactly_lossless(rule, gamma):
    p_of, q_of = random_conditionals(1, 3), random_conditionals(2, 3)
    got = output_distribution(rule, p_of, q_of, 3, gamma)
    for seq, prob in got.items():
        exact = math.prod(float(p_of(list(seq[:i]))[seq[i]]) for i in range(gamma + 1))
        assert prob == pytest.approx(exact, abs=1e-12)
    # sanity: drawing y from p instead of the residual is not lossless
    wrong = output_distribution(rule, p_of, q_of, 3, gamma, wrong=True)
    gap = max(abs(wrong[s] - math.prod(float(p_of(list(s[:i]))[s[i]]) for i in range(gamma + 1)))
              for s in wrong)
    assert gap > 1e-3


def test_block_never_accepts_fewer_than_token():
    # Sun et al. 2024, Theorem 2, on context-dependent tables.
    for seed in range(4):
        p_of, q_of = random_conditionals(10 + seed, 3), random_conditionals(20 + seed, 3)
        token = enumerated_accepted("token", p_of, q_of, 3, 3)
        block = enumerated_accepted("block", p_of, q_of, 3, 3)
        assert block >= token - 1e-12


def test_rule_edge_cases():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)  # a draft the target never makes
    for verify in (token_verify, block_verify):
        tau, y = verify(p, q, torch.tensor([2]), generator)
        assert tau == 0 and y in (0, 1)  # residual max(p - q, 0) = p_1
    # identical distributions accept everything
    same = p[:1].clone()
    h, weights = block_acceptance(p, same, torch.tensor([0]))
    assert h.tolist() == [1.0] and weights.tolist() == [1.0, 1.0]
    assert token_verify(p, same, torch.tensor([1]), generator)[0] == 1
    # an empty draft is one plain step from p_1
    assert block_verify(p[:1], q[:0], torch.tensor([], dtype=torch.long), generator)[0] == 0
    assert draw(torch.tensor([0.0, 0.0, 1.0]), generator) == 2


def test_block_acceptance_by_hand():
    # γ = 2, context-free p = (1/3, 2/3), q = (2/3, 1/3), draft (a, a): P_1 = 1/2, P_2 = 1/4;
    # Z_1 = Σ max(P_1 p - q, 0) = max(1/6 - 2/3, 0) + max(1/3 - 1/3, 0) = 0, h_1 = 0 / (1/2) = 0.
    # draft (b, a): P_1 = 1, Z_1 = max(1/3-2/3,0) + max(2/3-1/3,0) = 1/3, h_1 = 1, P_2 = 1/2.
    p, q = CONTEXT_FREE_P.expand(3, 2), CONTEXT_FREE_Q.expand(2, 2)
    h, P = block_acceptance(p, q, torch.tensor([0, 0]))
    torch.testing.assert_close(h, torch.tensor([0.0, 0.25], dtype=torch.float64))
    torch.testing.assert_close(P, torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64))
    h, P = block_acceptance(p, q, torch.tensor([1, 0]))
    torch.testing.assert_close(h, torch.tensor([1.0, 0.5], dtype=torch.float64))
    # residual at τ = 1 with P_1 = 1: max(p - q, 0) = (0, 1/3), normalised
    expected = torch.tensor([0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(residual(p[1], q[1], float(P[1])), expected)
    # no residual mass (P_1 p <= q everywhere, where h_1 = 0 keeps it from being drawn): p itself
    torch.testing.assert_close(residual(p[1], q[1], 0.5), CONTEXT_FREE_P)


@pytest.mark.parametrize("rule", ["token", "block"])
def test_verify_draws_tau_and_y_as_the_formulas_say(rule):
    # V = 3, γ = 2, draft (a, c): p_1 = (1/3, 2/3, 0), q_1 = (2/3, 1/3, 0); p_2 = (1/2, 1/2, 0),
    # q_2 = (0.2, 0.1, 0.7); c is impossible under the target, so τ <= 1.
    # token: h_1 = 1/2. τ = 0 -> y from max(p_1 - q_1, 0) = b; τ = 1 -> y from (0.3, 0.4, 0) / 0.7.
    # block: P_1 = 1/2, Z_1 = 0.05 + 0.15 = 0.2, h_1 = 0.2 / (0.2 + 1/2) = 2/7; τ = 1 -> y from
    #        max(P_1 p_2 - q_2, 0) = (0.05, 0.15, 0) / 0.2 = (1/4, 3/4, 0).
    p = torch.tensor([[1 / 3, 2 / 3, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[2 / 3, 1 / 3, 0], [0.2, 0.1, 0.7]], dtype=torch.float64)
    if rule == "token":
        verify, h, second = token_verify, 1 / 2, (3 / 7, 4 / 7)
    else:
        verify, h, second = block_verify, 2 / 7, (1 / 4, 3 / 4)
    taus = tau_distribution(rule, p, q, torch.tensor([0, 2]))
    torch.testing.assert_close(taus, torch.tensor([1 - h, h, 0.0], dtype=torch.float64))
    expected = {(0, 1): 1 - h, (1, 0): h * second[0], (1, 1): h * second[1]}
    generator = torch.Generator().manual_seed(1)
    counts = Counter(verify(p, q, torch.tensor([0, 2]), generator) for _ in range(3000))
    assert set(counts) <= set(expected)
    assert chi_square_pvalue(counts, expected, 3000) > 1e-3


# -- the real pipeline against the target's exact sequence distribution -----------------------


def sample_sequences(target, draft, params, verify, samples: int, gamma: int = 2, fallback: bool = False):
    result = speculative_generate(target, draft, [[1, 2]], params.replace(n=samples),
                                  num_draft_tokens=gamma, verify=verify, fallback=fallback)
    return Counter(tuple(c.token_ids) for c in result.completions[0]), result.stats


def wrong_residual(p, q, draft, generator):
    """Token verification that draws y from p_{τ+1} instead of the residual: not lossless."""
    tau, _ = token_verify(p, q, draft, generator)
    return tau, int(draw(p[tau], generator))


SAMPLES = 1200  # a wrong residual gives p ~ 1e-50 here; the right rules p ~ U(0, 1)


@pytest.mark.parametrize("verify", ["token", "block", wrong_residual])
def test_sequences_match_target_distribution(verify):
    target, drafter = table_lm(0), table_lm(1, name="draft")
    params = dk.SamplingParams(max_new_tokens=3, seed=123)
    counts, stats = sample_sequences(target, drafter, params, verify, SAMPLES)
    pvalue = chi_square_pvalue(counts, sequence_distribution(target, [1, 2], 3), SAMPLES)
    if verify is wrong_residual:
        assert pvalue < 1e-6  # the test has the power to catch a wrong residual
    else:
        assert pvalue > 1e-3
        assert 0 < stats.acceptance_rate < 1 and stats.block_efficiency > 1


def test_adapters_keep_the_processed_distribution():
    # temperature, top-k, top-p, and a presence penalty that depends on the (draft) history
    target, drafter = table_lm(0), table_lm(1, name="draft")
    params = dk.SamplingParams(max_new_tokens=3, seed=5, temperature=0.8, top_k=3, top_p=0.9,
                               presence_penalty=1.0)
    expected = sequence_distribution(target, [1, 2], 3, params)
    assert sum(p == 0 for p in expected.values()) > 0  # truncation removed some sequences
    counts, _ = sample_sequences(target, drafter, params, "block", SAMPLES)
    assert chi_square_pvalue(counts, expected, SAMPLES) > 1e-3
    assert all(expected[seq] > 0 for seq in counts)


def test_prompt_lookup_sampling_is_lossless():
    target = table_lm(3, vocab=3, sharpness=2.5)
    params = dk.SamplingParams(max_new_tokens=3, seed=9)
    result = speculative_generate(target, "prompt-lookup", [[0, 1, 2, 0, 1]],
                                  params.replace(n=SAMPLES), num_draft_tokens=2, verify="token",
                                  fallback=False)
    counts = Counter(tuple(c.token_ids) for c in result.completions[0])
    expected = sequence_distribution(target, [0, 1, 2, 0, 1], 3)
    assert chi_square_pvalue(counts, expected, SAMPLES) > 1e-3
    assert result.stats.drafted_tokens > 0 and result.stats.draft_calls == 0


# -- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("verify, gamma, adaptive", [("block", 3, False), ("token", 1, False),
                                                      ("block", 2, True)])
def test_greedy_equals_target_greedy_on_tiny_llamas(tiny_lm, tiny_draft_lm, verify, gamma, adaptive):
    params = dk.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    [plain] = dk.generate(tiny_lm, "ROMEO: But soft", params)
    for fallback in (False, True):  # rows that switch to plain steps (speculation_gate.py) too
        result = speculative_generate(tiny_lm, tiny_draft_lm, "ROMEO: But soft", params, gamma, verify,
                                      adaptive, fallback=fallback)  # fmt: skip
        [spec] = result.completions
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
        assert result.stats.emitted_tokens == 24
        assert result.stats.accepted_tokens > 0 or fallback  # the perturbed draft agrees often


def test_greedy_with_repetition_penalty_and_prompt_lookup(tiny_lm):
    params = dk.SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True,
                               repetition_penalty=1.3)
    prompt = "the sun. the sun. the sun."
    [plain] = dk.generate(tiny_lm, prompt, params)
    result = speculative_generate(tiny_lm, "prompt-lookup", prompt, params, num_draft_tokens=4)
    assert result.completions[0].token_ids == plain.token_ids


@pytest.fixture(scope="module")
def tiny_draft_lm(tiny_llama_dir):
    """The tiny Llama with its weights perturbed: a different model that often agrees."""
    from transformers import LlamaForCausalLM

    from decodekit.models.hf import HFModelLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(0.3 * weight.std() * torch.randn(weight.shape, generator=generator))
    return HFModelLM(model, None, "tiny-draft")


def test_embedded_pair_greedy_equals_target_greedy():
    from decodekit.models.registry import embedded_models

    if not {"shakespeare", "shakespeare-draft"} <= set(embedded_models()):
        pytest.skip("the embedded shakespeare pair is not built")
    target = dk.load_model("shakespeare")
    params = dk.SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    [plain] = dk.generate(target, "ROMEO:", params)
    for verify in ("block", "token"):
        result = speculative_generate(target, "auto", "ROMEO:", params, 4, verify)
        assert result.completions[0].token_ids == plain.token_ids


@pytest.mark.usefixtures("torch_kernels_only")  # names PyTorch's kernels
def test_self_int4_draft_keeps_greedy_output(tiny_lm):
    # The target's own int4 copy (packed int4 kernel, bfloat16 activations) as the draft:
    # greedy output is the target's token for token, and the target stays float.
    from decodekit.decode.drafters import self_draft
    from decodekit.models.qlinear import kernel_counts

    params = dk.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    [plain] = dk.generate(tiny_lm, "ROMEO:", params)
    result = speculative_generate(tiny_lm, "self-int4", "ROMEO:", params, 4, fallback=False)
    assert result.completions[0].token_ids == plain.token_ids
    assert result.stats.accepted_tokens > 0
    assert kernel_counts(tiny_lm.net) == {}  # the target was not touched
    drafter = self_draft(tiny_lm)
    assert kernel_counts(drafter.model.net) == {"int4pack": 8, "int8pack": 1}  # its head in int8
    assert drafter.model.net.embed_tokens.weight is tiny_lm.net.embed_tokens.weight  # shared
    # Sampling through the self-draft (exact for any draft: the tests above): seeded runs repeat
    # (without the fallback, whose switches follow the clock: speculation_gate.py).
    sampled = dk.SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=3)
    a = speculative_generate(tiny_lm, drafter, "ROMEO:", sampled, 3, fallback=False).completions[0]
    b = speculative_generate(tiny_lm, "self-int4", "ROMEO:", sampled, 3, fallback=False).completions[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16


def test_self_draft_needs_a_native_model(toy_lm):
    with pytest.raises(ValueError, match="a self-draft needs a NativeLM target, got"):
        speculative_generate(toy_lm, "self-int4", [[1, 2]], dk.SamplingParams(max_new_tokens=2))


# -- drafters, caches, statistics ------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_last_match():
    drafter = PromptLookupDrafter(max_ngram=3)
    context = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert drafter.lookup(context, 3) == [4, 5, 6]  # the later of the two earlier [1, 2, 3]
    assert drafter.lookup(context, 10) == [4, 5, 6, 7, 1, 2, 3]  # up to the end of the context
    assert drafter.lookup([5, 1, 2, 8, 4, 2], 2) == [8, 4]  # falls back to the 1-gram [2]
    assert drafter.lookup([1, 2, 3, 4], 3) == []  # no earlier match
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_caches_roll_back_and_no_prefix_is_recomputed():
    target, drafter = table_lm(0, name="target"), table_lm(1, name="draft")
    prompt = [1, 2, 0, 3]
    params = dk.SamplingParams(max_new_tokens=40, seed=2)
    result = speculative_generate(target, drafter, [prompt], params, num_draft_tokens=3)
    stats = result.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # rejections happened
    # target: the prompt and γ drafts once, then y and the next γ drafts per block
    assert target.fed == len(prompt) + stats.drafted_tokens + stats.target_calls - 1
    # draft: one call per draft token; catch-up is y, plus x_γ after a full acceptance
    assert stats.draft_calls == stats.drafted_tokens
    assert drafter.fed <= len(prompt) + stats.drafted_tokens + stats.target_calls
    assert stats.emitted_tokens == 40 == len(result.completions[0][0].token_ids)


def test_incremental_model_shares_prefixes_between_samples():
    model = table_lm(0)
    runner = IncrementalModel(model)
    first = runner.next_logits([1, 2, 3, 0], 2)
    runner.next_logits([1, 2, 3, 0, 1, 1], 1)
    assert model.fed == 6
    again = runner.next_logits([1, 2, 3, 0], 2)  # crop back to [1, 2], run 3, 0 again
    assert model.fed == 8
    torch.testing.assert_close(again, first)
    direct = model.forward(torch.tensor([[1, 2, 3, 0]]), model.new_cache(1))[0, -2:]
    torch.testing.assert_close(first, direct)


def test_identical_draft_accepts_everything():
    target = table_lm(4)
    params = dk.SamplingParams(max_new_tokens=10, seed=0)
    result = speculative_generate(target, target, [[1, 2]], params, num_draft_tokens=4, fallback=False)
    stats = result.stats
    # blocks of γ + 1 = 5 tokens: 10 tokens in 2 target calls
    assert (stats.target_calls, stats.accepted_tokens, stats.drafted_tokens) == (2, 8, 8)
    assert stats.block_efficiency == 5.0 and stats.acceptance_rate == 1.0
    assert stats.alpha == pytest.approx(1.0)


def test_ngram_drafter():
    ngram = pytest.importorskip("decodekit.models.ngram")
    target = table_lm(0)
    docs = [dk.generate(target, [[1, 2]], dk.SamplingParams(max_new_tokens=12, seed=s))[0][0].token_ids
            for s in range(20)]
    drafter = ngram.NGramLM.fit(docs, ngram.NGramConfig(3), vocab_size=4, eos_id=0)
    params = dk.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    [plain] = dk.generate(target, [[1, 2]], params)[0]
    result = speculative_generate(target, drafter, [[1, 2]], params, num_draft_tokens=3)
    assert result.completions[0][0].token_ids == plain.token_ids
    assert result.stats.draft_calls > 0


def test_cli_speculative_equals_plain_greedy(tiny_llama_dir, capsys):
    from decodekit.cli import main

    base = ["generate", "ROMEO: But soft", "--model", str(tiny_llama_dir), "--strategy", "greedy",
            "--max-new-tokens", "10", "--json"]  # fmt: skip
    assert main(base) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # one per line
    for extra in (["--draft-model", "prompt-lookup", "--num-draft-tokens", "3", "--verify", "token"],
                  ["--draft-model", str(tiny_llama_dir), "--adaptive"]):
        assert main(base + extra) == 0
        out = capsys.readouterr()
        assert json.loads(out.out)["token_ids"] == plain[0]["token_ids"]
        stats = json.loads(out.err)["speculative"]
        assert stats["emitted_tokens"] == len(plain[0]["token_ids"])
    assert stats["acceptance_rate"] == 1.0  # the target drafting for itself
    assert main(base + ["--draft-model", "prompt-lookup", "--strategy", "beam"]) == 2


def test_draft_with_another_vocabulary_is_refused(tiny_lm):
    ngram = pytest.importorskip("decodekit.models.ngram")
    chars = ngram.train_ngram(["to be or not to be"], ngram.NGramConfig(2), level="char")
    with pytest.raises(ValueError, match="its own vocabulary"):  # a character-level k-gram
        speculative_generate(tiny_lm, chars, "ROMEO:")


def test_adaptive_gamma_schedule():
    config = SpeculativeConfig(num_draft_tokens=4, adaptive=True, max_draft_tokens=7)
    assert config.next_gamma(4, 4, 4) == 6  # full acceptance: +2
    assert config.next_gamma(6, 6, 6) == 7  # capped
    assert config.next_gamma(4, 4, 2) == 3  # a rejection: -1
    assert config.next_gamma(1, 1, 0) == 1  # floor
    assert config.next_gamma(4, 0, 0) == 4  # an empty draft says nothing
    assert SpeculativeConfig(num_draft_tokens=4).next_gamma(4, 4, 4) == 4  # fixed γ


def test_bad_arguments():
    target = table_lm(0)
    with pytest.raises(ValueError, match="verify"):
        speculative_generate(target, target, [[1]], verify="tree")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, target, [[1]], num_draft_tokens=0)
    with pytest.raises(ValueError, match="vocab_size 5"):
        speculative_generate(target, table_lm(0, vocab=5), [[1]])
    with pytest.raises(TypeError, match="draft must be"):
        speculative_generate(target, 3.5, [[1]])
    with pytest.raises(ValueError, match="no default draft"):
        speculative_generate(target, "auto", [[1]])


def test_each_embedded_target_names_its_draft():
    from decodekit.models.registry import default_draft

    assert default_draft("shakespeare") == "shakespeare-draft"  # <name>-draft
    assert default_draft("shakespeare-large") == "shakespeare-large-draft"  # its entry's "draft"
    assert default_draft("arith") is None and default_draft("no-such-model") is None


# -- batched on the engine (issue 14) ---------------------------------------------------------


@pytest.fixture(scope="module")
def paged_pair(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama and a perturbed copy as its draft, both NativeLM (paged KV) in the
    batch-invariant mode, so a row's logits, and so its draws, do not depend on its batch."""
    import shutil

    from transformers import LlamaForCausalLM

    from decodekit.models.native import NativeLM

    path = tmp_path_factory.mktemp("tiny-draft")
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(0.3 * weight.std() * torch.randn(weight.shape, generator=generator))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama_dir / name).exists():
            shutil.copy(tiny_llama_dir / name, path / name)
    target = NativeLM.from_pretrained(tiny_llama_dir, batch_invariant=True)
    draft = NativeLM.from_pretrained(path, name="tiny-paged-draft", batch_invariant=True)
    return target, draft


PROMPTS = ["ROMEO: But soft", "JULIET: O Romeo", "the sun. the sun.", "Deny thy father"]


def outcome(completion):
    return completion.token_ids, completion.logprobs, completion.finish_reason


@pytest.mark.parametrize("draft, verify, adaptive", [("model", "block", False),
                                                      ("model", "token", True),
                                                      ("prompt-lookup", "block", False)])
def test_batched_rows_equal_single_row_runs(paged_pair, draft, verify, adaptive):
    # 4 prompts x n = 2 samples: 8 rows in one batch; sample i of a request seeded s draws
    # what a one-sample request seeded s + i draws alone.
    from decodekit.engine.engine import engine_for

    target, drafter = paged_pair
    drafter = drafter if draft == "model" else draft
    params = dk.SamplingParams(n=2, max_new_tokens=14, temperature=1.0, seed=7)
    engine = engine_for(target)
    steps = engine.steps
    # fallback=False: rows that switch to plain decoding at steps the clock chooses draw
    # other uniforms (speculation_gate.py); the batching is what this test compares
    batched = speculative_generate(target, drafter, PROMPTS, params, 3, verify, adaptive, fallback=False)
    batched_steps = engine.steps - steps
    singles, single_steps = [], 0
    for prompt in PROMPTS:
        for sample in range(2):
            steps = engine.steps
            one = speculative_generate(target, drafter, prompt, params.replace(n=1, seed=7 + sample),
                                       3, verify, adaptive, fallback=False)  # fmt: skip
            single_steps += engine.steps - steps
            singles.append((one.completions[0], one.stats))
    rows = [c for completions in batched.completions for c in completions]
    assert [outcome(c) for c in rows] == [outcome(c) for c, _ in singles]
    assert len({tuple(c.token_ids) for c in rows}) > 1
    for key in ("drafted_tokens", "accepted_tokens", "emitted_tokens", "target_calls", "draft_calls"):
        assert getattr(batched.stats, key) == sum(getattr(s, key) for _, s in singles), key
    assert batched.stats.drafted_tokens > 0
    assert batched.stats.accepted_tokens > 0 or draft == "prompt-lookup"  # a random model rarely copies
    # the rows ran together: the batch took as many steps as its longest row, not their sum
    assert batched_steps * 4 <= single_steps


def test_batched_greedy_equals_plain_greedy_and_streams(paged_pair):
    from decodekit.engine.engine import run_requests

    target, drafter = paged_pair
    params = dk.SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, stop=["zz"])
    plain = dk.generate(target, PROMPTS, params)
    result = speculative_generate(target, drafter, PROMPTS, params, 4)
    assert [c[0].token_ids for c in result.completions] == [c[0].token_ids for c in plain]
    assert result.stats.emitted_tokens == sum(len(c[0].token_ids) for c in plain)
    # the deltas of a program add up to its completion (streaming)
    programs = speculative_programs(target, drafter, PROMPTS[:2], params, 4)
    texts, finals = ["", ""], {}
    for delta in run_requests(target, programs):
        texts[delta.prompt_index] += delta.text
        if delta.completion is not None:
            finals[delta.prompt_index] = delta.completion
    assert texts == [finals[0].text, finals[1].text] == [c[0].text for c in plain[:2]]


def test_speculative_programs_refuse_what_they_cannot_run(paged_pair):
    target, drafter = paged_pair
    with pytest.raises(TypeError, match="paged-KV target"):
        speculative_programs(table_lm(0), table_lm(1), [[1]])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_programs(target, drafter, ["ROMEO:"], num_draft_tokens=0)


def test_cancelled_program_ends_its_samples_and_frees_their_blocks(paged_pair):
    from decodekit.engine.engine import Engine

    target, drafter = paged_pair
    params = dk.SamplingParams(n=2, max_new_tokens=40, ignore_eos=True, temperature=0)
    [program] = speculative_programs(target, drafter, ["ROMEO:"], params, 2)
    engine = Engine(target)
    handle = engine.add(program)
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0 and engine.members.of(drafter).pool.num_used > 0
    handle.cancel()
    engine.step()
    completions = handle.result(timeout=5)
    assert [c.finish_reason for c in completions] == ["cancelled"] * 2
    assert 0 < len(completions[0].token_ids) < 40
    assert engine.pool.num_used == 0 and engine.members.of(drafter).pool.num_used == 0


# -- speculation that switches itself off (speculation_gate.py) --------------------------------


@pytest.mark.parametrize("verify", ["block", wrong_residual])
def test_a_row_that_switches_keeps_the_target_distribution(verify):
    # With the fallback a row's first two rounds are plain, its third a probe block of one
    # draft token, its fourth plain again (the budget leaves no draft for the last token):
    # every sequence of 4 switches mode twice, and must still follow the target's distribution.
    target, drafter = table_lm(2, vocab=3), table_lm(3, vocab=3, name="draft")
    params = dk.SamplingParams(max_new_tokens=4, seed=11)
    counts, stats = sample_sequences(target, drafter, params, verify, SAMPLES, fallback=True)
    assert stats.drafted_tokens == SAMPLES and stats.plain_steps >= 2 * SAMPLES  # one probe each
    pvalue = chi_square_pvalue(counts, sequence_distribution(target, [1, 2], 4), SAMPLES)
    if verify is wrong_residual:
        assert pvalue < 1e-6  # the probe's block alone has the power to catch a wrong rule
    else:
        assert pvalue > 1e-3
