"""Controlled decoding: CD-Q / CD-FUDGE value functions; token-wise CD (`ValueTilt` through
`generate`) and blockwise CD (`BlockwiseCD` over a Generator), checked on exact tabular
distributions."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.align.blockwise import BlockwiseCD
from decodekit.align.controlled import (
    ValueTilt,
    generate_reporting,
    keyword_reward,
    kl_terms,
    newline_length_reward,
    orm_reward,
    sample_base,
)
from decodekit.align.value import PrefixValue, cdq_fixed_point, cdq_targets, train_cdq, train_fudge
from decodekit.completion import Completion
from decodekit.decode.sample import generate
from decodekit.meta.budget import Budget
from decodekit.meta.generator import LocalGenerator
from decodekit.models.base import Cache, LanguageModel, next_token_logprobs
from decodekit.params import SamplingParams

# A depth-2 binary tree: tokens 0/1, token 2 is the prompt ("start").
# p(.|start) = (0.25, 0.75), p(.|0) = (0.5, 0.5), p(.|1) = (0.9, 0.1).
POLICY = {(): {0: 0.25, 1: 0.75}, (0,): {0: 0.5, 1: 0.5}, (1,): {0: 0.9, 1: 0.1}}
LEAF_REWARD = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 2.0, (1, 1): -1.0}
# Backward recursion by hand: V(0) = 0.5, V(1) = 0.9*2 - 0.1 = 1.7, V() = 0.25*0.5 + 0.75*1.7.
EXACT = {(): 1.4, (0,): 0.5, (1,): 1.7, **LEAF_REWARD}
P_LEAF = {leaf: POLICY[()][leaf[0]] * POLICY[leaf[:1]][leaf[1]] for leaf in LEAF_REWARD}


class _LastCache(Cache):
    def __init__(self, rows: int):
        self.rows, self._length = rows, 0

    @property
    def length(self) -> int:
        return self._length

    def fork(self, rows):
        new = _LastCache(len(rows))
        new._length = self._length
        return new

    def select(self, rows) -> None:
        self.rows = len(rows)

    def crop(self, length: int) -> None:
        self._length = length


class TreeLM(LanguageModel):
    """Bigram model whose next-token distribution depends on the last token only."""

    name, vocab_size, eos_token_ids, tokenizer, max_context = "tree", 3, (), None, 16

    def __init__(self):
        probs = torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.1, 0.0], [0.25, 0.75, 0.0]])
        self.table = torch.log(probs.clamp_min(1e-30))  # [3, 3]; row = last token

    def new_cache(self, batch_size: int) -> Cache:
        return _LastCache(batch_size)

    def forward(self, tokens, cache, mask=None):
        cache._length += tokens.shape[1]
        return self.table[tokens]  # [B, T, V]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is faster than two (less overhead) and leaves a core free."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class EosTreeLM(TreeLM):
    """The tree with token 0 as EOS: a completion ends at its first 0."""

    eos_token_ids = (0,)


def _tree_samples(n: int, seed: int):
    model = TreeLM()
    samples = sample_base(model, [2], SamplingParams(n=n, max_new_tokens=2, seed=seed), top_k=3)
    samples.rewards = torch.tensor([LEAF_REWARD[tuple(r)] for r in samples.tokens.tolist()])
    return model, samples


def _counts(rows) -> dict[tuple, float]:
    rows = [tuple(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
    return {row: rows.count(row) / len(rows) for row in set(rows)}


def _tokens(completions) -> list[tuple[int, ...]]:
    return [tuple(c.token_ids) for c in completions]


def test_cdq_fixed_point_equals_backward_recursion():
    table = cdq_fixed_point(POLICY.__getitem__, LEAF_REWARD.__getitem__, depth=2)
    assert table == pytest.approx(EXACT, abs=1e-12)
    # One sweep short, the root has not yet seen the leaves.
    short = cdq_fixed_point(POLICY.__getitem__, LEAF_REWARD.__getitem__, depth=2, iterations=2)
    assert short[()] == pytest.approx(0.0)


def test_sample_base_draws_p_with_its_top_k_children():
    model, samples = _tree_samples(4000, seed=1)
    assert _counts(samples.tokens) == pytest.approx(P_LEAF, abs=0.025)
    assert samples.child_ids.shape == samples.child_logp.shape == (4000, 2, 3)
    first = samples.tokens[:, 0]
    for row in (0, 1):  # the children stored before position 1 are p(. | first token)
        ids, logp = samples.child_ids[first == row][0, 1], samples.child_logp[first == row][0, 1]
        children = dict(zip(ids[:2].tolist(), logp[:2].exp().tolist()))
        assert children == pytest.approx(POLICY[(row,)], abs=1e-6)
    with pytest.raises(ValueError, match="one length"):
        sample_base(EosTreeLM(), [2], SamplingParams(n=64, max_new_tokens=2, seed=0))


def test_cdq_training_reaches_the_backward_recursion():
    torch.manual_seed(0)
    _, samples = _tree_samples(256, seed=1)
    value = PrefixValue(3, dim=4, hidden=32, scale=2.0)
    train_cdq(value, samples, steps=600, lr=2e-2, refresh=5)
    got = value(torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])).detach()  # [4, 3]
    assert float(got[0, 0]) == pytest.approx(1.4, abs=0.05)  # root: expectation under p
    assert float(got[0, 1]) == pytest.approx(0.5, abs=0.05)
    assert float(got[2, 1]) == pytest.approx(1.7, abs=0.05)
    # The CD-Q target of a trained V is (close to) V itself: a fixed point.
    target = cdq_targets(value, samples)
    assert torch.allclose(target, value(samples.tokens).detach(), atol=0.08)
    # The list interfaces agree with the tensor one, for prefixes of any length.
    prefixes = [[], [1], [1, 0]]
    assert value.prefix_values(prefixes).tolist() == pytest.approx(got[2].tolist(), abs=1e-6)
    children = value.child_values(prefixes[:2], torch.tensor([[0, 1], [0, 1]])).detach()
    expected = [[got[0, 1], got[2, 1]], [got[2, 2], got[3, 2]]]  # V(0), V(1); V(1, 0), V(1, 1)
    assert torch.allclose(children, torch.tensor(expected), atol=1e-6)


def test_fudge_regresses_onto_expected_reward_of_completions():
    torch.manual_seed(0)
    _, samples = _tree_samples(2000, seed=2)
    # The least-squares target of a prefix is the mean reward of the samples sharing it.
    first = samples.tokens[:, 0]
    for z in (0, 1):
        assert float(samples.rewards[first == z].mean()) == pytest.approx(EXACT[(z,)], abs=0.06)
    value = PrefixValue(3, dim=4, hidden=32, scale=2.0)
    train_fudge(value, samples, steps=400, lr=2e-2)
    got = value(torch.tensor([[0, 0], [1, 0]])).detach()
    assert float(got[0, 0]) == pytest.approx(1.4, abs=0.08)
    assert float(got[0, 1]) == pytest.approx(0.5, abs=0.08)
    assert float(got[1, 1]) == pytest.approx(1.7, abs=0.08)


class _TableValue(PrefixValue):
    """V(prefix + z) read from a table of token tuples (EXACT by default)."""

    def __init__(self, table=EXACT):
        super().__init__(3)
        self.table = table

    def child_values(self, prefixes, ids):
        return torch.tensor([[self.table[(*prefix, int(z))] for z in row]
                             for prefix, row in zip(prefixes, ids.tolist())])


def _tilt_steps(lam: float) -> dict[tuple, dict[int, float]]:
    """The exact token-wise CD policy on the tree: pi(z | prefix) ∝ p(z | prefix) exp(lam V(prefix + z))."""
    steps = {}
    for prefix, p in POLICY.items():
        w = {z: q * math.exp(lam * EXACT[(*prefix, z)]) for z, q in p.items()}
        steps[prefix] = {z: x / sum(w.values()) for z, x in w.items()}
    return steps


def _kl(pi: dict[int, float], p: dict[int, float]) -> float:
    return sum(q * math.log(q / p[z]) for z, q in pi.items() if q > 0)


def test_tokenwise_with_lam_zero_samples_from_p():
    steer = ValueTilt(PrefixValue(3), 0.0)
    out = generate(TreeLM(), [[2]], SamplingParams(n=4000, max_new_tokens=2, seed=3), adapter=steer)[0]
    assert _counts(_tokens(out)) == pytest.approx(P_LEAF, abs=0.025)
    log_ratio, step_kl = kl_terms(TreeLM(), steer, [2], out)
    assert torch.allclose(log_ratio, torch.zeros(4000), atol=1e-5)
    assert torch.allclose(step_kl, torch.zeros(4000), atol=1e-5)


def test_tokenwise_draws_the_exact_tilt_and_its_kl():
    lam = 1.0
    steer = ValueTilt(_TableValue(), lam, top_k=2)
    out = generate(TreeLM(), [[2]], SamplingParams(n=4000, max_new_tokens=2, seed=4), adapter=steer)[0]
    pi = _tilt_steps(lam)
    exact = {leaf: pi[()][leaf[0]] * pi[leaf[:1]][leaf[1]] for leaf in LEAF_REWARD}
    assert exact[(0, 0)] + exact[(0, 1)] == pytest.approx(0.0912, abs=1e-4)  # 0.25 e^0.5 / (...)
    assert _counts(_tokens(out)) == pytest.approx(exact, abs=0.025)
    log_ratio, step_kl = kl_terms(TreeLM(), steer, [2], out)
    for c, ratio, steps in zip(out[:50], log_ratio[:50].tolist(), step_kl[:50].tolist()):
        z1, z2 = c.token_ids
        assert ratio == pytest.approx(math.log(exact[(z1, z2)] / P_LEAF[(z1, z2)]), abs=1e-5)
        assert steps == pytest.approx(_kl(pi[()], POLICY[()]) + _kl(pi[(z1,)], POLICY[(z1,)]), abs=1e-5)
    sequence_kl = sum(q * math.log(q / P_LEAF[leaf]) for leaf, q in exact.items())
    assert float(log_ratio.mean()) == pytest.approx(sequence_kl, abs=0.04)  # Monte Carlo of log pi/p
    assert float(step_kl.mean()) == pytest.approx(sequence_kl, abs=0.02)


def test_tokenwise_honours_temperature_greedy_and_seeds():
    steer = ValueTilt(_TableValue(), 1.0, top_k=2)
    pi0 = _tilt_steps(1.0)[()][0]
    hot = generate(TreeLM(), [[2]], SamplingParams(n=4000, max_new_tokens=1, temperature=0.5, seed=5),
                   adapter=steer)[0]
    sharpened = pi0**2 / (pi0**2 + (1 - pi0) ** 2)  # pi^(1/T), T = 0.5
    assert _counts(_tokens(hot))[(0,)] == pytest.approx(sharpened, abs=0.01)
    # Greedy controlled decoding: argmax of log p + lam V, which here is not p's argmax.
    favour_zero = ValueTilt(_TableValue({(0,): 2.0, (1,): 0.0}), 1.0, top_k=2)
    greedy = SamplingParams(n=2, max_new_tokens=1, temperature=0.0)
    assert _tokens(generate(TreeLM(), [[2]], greedy, adapter=favour_zero)[0]) == [(0,), (0,)]
    assert _tokens(generate(TreeLM(), [[2]], greedy)[0]) == [(1,), (1,)]
    seeded = SamplingParams(n=200, max_new_tokens=2, seed=9)
    runs = [_tokens(generate(TreeLM(), [[2]], seeded.replace(seed=s), adapter=steer)[0]) for s in (9, 9, 10)]
    assert runs[0] == runs[1] != runs[2]


def test_tokenwise_ends_at_eos_with_completions_and_usage():
    steer = ValueTilt(_TableValue(), 1.0, top_k=2)
    out = generate(EosTreeLM(), [[2]], SamplingParams(n=3000, max_new_tokens=2, seed=6), adapter=steer)[0]
    pi = _tilt_steps(1.0)
    for c in out:
        assert c.usage.completion_tokens == len(c.token_ids) and c.usage.prompt_tokens == 1
        if c.token_ids[-1] == 0:  # EOS, first or second
            assert (c.finish_reason, c.stop_reason) == ("stop", 0)
        else:
            assert (c.token_ids, c.finish_reason) == ([1, 1], "length")
    counts = _counts(_tokens(out))
    assert counts[(0,)] == pytest.approx(pi[()][0], abs=0.015)
    assert counts[(1, 0)] == pytest.approx(pi[()][1] * pi[(1,)][0], abs=0.025)


def test_tokenwise_on_the_engine_draws_from_the_tilt(tiny_lm):
    """On the paged engine the adapter sees each row's own tokens: every token's processed
    log-probability is its log pi recomputed from a fresh forward over its path."""
    assert tiny_lm.supports_paged_kv
    torch.manual_seed(0)
    steer = ValueTilt(PrefixValue(tiny_lm.vocab_size, dim=8), 50.0, top_k=16)
    out = generate(tiny_lm, "the", SamplingParams(n=3, max_new_tokens=6, seed=1, ignore_eos=True),
                   adapter=steer)
    prompt = tiny_lm.encode("the")
    paths = next_token_logprobs(tiny_lm, [prompt + c.token_ids for c in out], [len(prompt)] * 3)
    truncated = ValueTilt(steer.value, 0.0, top_k=16)  # the same top-k, no value
    moved = 0.0
    for c, logp in zip(out, paths):
        ids, prefixes = torch.tensor(c.token_ids)[:, None], [c.token_ids[:t] for t in range(6)]
        log_pi = torch.log_softmax(steer.tilt(logp, prefixes), dim=-1).gather(1, ids)[:, 0]
        assert torch.allclose(torch.tensor(c.processed_logprobs), log_pi, atol=1e-4)
        assert torch.allclose(torch.tensor(c.logprobs), logp.gather(1, ids)[:, 0], atol=1e-4)
        plain = torch.log_softmax(truncated.tilt(logp, prefixes), dim=-1).gather(1, ids)[:, 0]
        moved = max(moved, float((log_pi - plain).abs().max()))
    assert moved > 0.1  # the value tilts p


def _count_ones(candidates):
    """Block value: the number of token 1 in the completion so far."""
    return [float(sum(z == 1 for z in c)) for c in candidates]


def _blockwise(model, k, m, params, value=_count_ones):
    cd = BlockwiseCD(LocalGenerator(model), value, k, m)
    return cd, cd.generate([[2]], params.n, params)[0]


def test_blockwise_with_k_one_samples_from_p():
    _, out = _blockwise(TreeLM(), 1, 1, SamplingParams(n=2000, max_new_tokens=2, seed=5))
    assert _counts(_tokens(out)) == pytest.approx(P_LEAF, abs=0.025)


def test_blockwise_keeps_the_best_block():
    # One block of 2 tokens, K = 4: the kept block has the most 1s among 4 base draws.
    _, out = _blockwise(TreeLM(), 4, 2, SamplingParams(n=2000, max_new_tokens=2, seed=6))
    ones = torch.tensor([sum(c.token_ids) for c in out])
    # Under p: P(0 ones) = 0.125, P(1) = 0.125 + 0.675 = 0.8, P(2) = 0.075.
    # Best of 4: P(2) = 1 - 0.925^4, P(0) = 0.125^4.
    assert float((ones == 2).float().mean()) == pytest.approx(1 - 0.925**4, abs=0.03)
    assert float((ones == 0).float().mean()) == pytest.approx(0.125**4, abs=0.01)


def test_blockwise_block_by_block_distribution_and_budget():
    # K = 2 blocks of one token: each position keeps a 1 unless both draws are 0.
    n = 2000
    cd, out = _blockwise(TreeLM(), 2, 1, SamplingParams(n=n, max_new_tokens=2, seed=7))
    first = {0: 0.25**2, 1: 1 - 0.25**2}
    second = {(0,): {0: 0.5**2, 1: 1 - 0.5**2}, (1,): {0: 0.9**2, 1: 1 - 0.9**2}}
    exact = {leaf: first[leaf[0]] * second[leaf[:1]][leaf[1]] for leaf in LEAF_REWARD}
    assert _counts(_tokens(out)) == pytest.approx(exact, abs=0.025)
    assert all(c.finish_reason == "length" and c.usage.completion_tokens == 2 for c in out)
    assert len(out[0].logprobs) == len(out[0].processed_logprobs) == 2
    # Two rounds; each sample is one request per round, drawing K one-token blocks.
    budget = cd.budget
    assert (budget.generator_calls, budget.generated_tokens, budget.scorer_calls) == (2 * n, 4 * n, 4 * n)
    # Seeded: reproducible, sample j's draws fixed by (seed, j) whatever n is.
    again = _blockwise(TreeLM(), 2, 1, SamplingParams(n=200, max_new_tokens=2, seed=7))[1]
    assert _tokens(again) == _tokens(out)[:200]


def test_blockwise_block_ending_in_eos_ends_the_completion():
    n = 2000
    cd, out = _blockwise(EosTreeLM(), 2, 1, SamplingParams(n=n, max_new_tokens=2, seed=8))
    ended = [c for c in out if c.token_ids == [0]]
    assert all((c.finish_reason, c.stop_reason) == ("stop", 0) for c in ended)
    assert len(ended) / n == pytest.approx(0.25**2, abs=0.015)
    for c in out:
        assert c.finish_reason == ("stop" if c.token_ids[-1] == 0 else "length")
    # The second round runs only the samples that did not end.
    assert cd.budget.generated_tokens == 2 * n + 2 * (n - len(ended))


class _Scripted:
    """A Generator whose continuations in round r are `rounds[r]` (texts; token id = index)."""

    def __init__(self, rounds):
        self.rounds, self.prompts, self.budget = rounds, [], Budget()

    def generate(self, prompts, n, params):
        texts = self.rounds[len(self.prompts)]
        self.prompts.append(list(prompts))
        for _ in prompts:
            self.budget.add_generation(1, n)
        return [[Completion([i], t, [-1.0], [-1.0], "length") for i, t in enumerate(texts[:n])]
                for _ in prompts]

    def score(self, prompt, continuations):
        raise AssertionError("not called")


def test_blockwise_text_prompts_and_a_stop_string_across_blocks():
    def last_token(candidates):  # prefers the continuation with token id 1
        return [float(c[-1]) for c in candidates]

    inner = _Scripted([["xa", "ab"], ["zz", "cd"], ["ee", "ff"]])
    cd = BlockwiseCD(inner, last_token, k=2, m=1)
    [[done]] = cd.generate(["P"], 1, SamplingParams(max_new_tokens=3, stop=["bc"]))
    assert inner.prompts == [["P"], ["Pab"]]  # the text prompt grows by the kept block's text
    assert (done.text, done.finish_reason, done.stop_reason) == ("a", "stop", "bc")
    assert done.token_ids == [1, 1] and done.logprobs == [-1.0, -1.0]
    again = BlockwiseCD(_Scripted([["xa", "ab"], ["zz", "cd"], ["ee", "ff"]]), last_token, k=2, m=1)
    [[full]] = again.generate(["P"], 1, SamplingParams(max_new_tokens=3))
    assert (full.text, full.finish_reason, full.usage.completion_tokens) == ("abcdff", "length", 3)


@pytest.mark.parametrize(
    ("kwargs", "name", "error"),
    [({"lam": -1.0}, "lam", ValueError), ({"lam": float("nan")}, "lam", ValueError),
     ({"lam": 1.0, "top_k": 0}, "top_k", ValueError), ({"lam": 1.0, "value": 3}, "value", TypeError)],
)
def test_tokenwise_rejects_bad_input(kwargs, name, error):
    kwargs = {"value": PrefixValue(3), **kwargs}
    with pytest.raises(error, match=f"^{name} "):
        ValueTilt(**kwargs)


@pytest.mark.parametrize(
    ("k", "m", "value", "name", "error"),
    [(0, 2, _count_ones, "k", ValueError), (2, 0, _count_ones, "m", ValueError),
     (1.5, 2, _count_ones, "k", TypeError), (2, 2, 3, "value", TypeError)],
)
def test_blockwise_rejects_bad_input(k, m, value, name, error):
    with pytest.raises(error, match=f"^{name} "):
        BlockwiseCD(LocalGenerator(TreeLM()), value, k=k, m=m)


def test_training_and_value_reject_bad_input():
    _, samples = _tree_samples(4, seed=0)
    with pytest.raises(ValueError, match="steps"):
        train_fudge(PrefixValue(3), samples, steps=0)
    with pytest.raises(ValueError, match="refresh"):
        train_cdq(PrefixValue(3), samples, refresh=0)
    samples.child_ids = None
    with pytest.raises(ValueError, match="CD-Q"):
        train_cdq(PrefixValue(3), samples)
    with pytest.raises(ValueError, match="dim"):
        PrefixValue(3, dim=0)


def test_offline_rewards():
    reward = keyword_reward()
    assert reward("My lord, the KING loves love; lordly") == 3.0  # lord, king, love
    assert keyword_reward(["thee"])("Thee and thee, not theeward") == 2.0
    assert newline_length_reward("ab\ncd") == 2.0
    assert newline_length_reward("abcd") == 4.0
    with pytest.raises(ValueError, match="words"):
        keyword_reward([])


def test_orm_reward_scores_the_completion_for_its_question():
    calls = []
    reward = orm_reward("2+3", lambda q, s: calls.append((q, s)) or 0.25)
    assert reward(" 5") == 0.25
    assert calls == [("2+3", " 5")]


def test_progress_reports_come_within_sampling_and_training(tiny_lm):
    """Issue 35: the callbacks that move `eval alignment`'s bar within a stage. Reporting
    changes nothing: the same seeded completions and the same losses."""
    params = SamplingParams(n=3, max_new_tokens=5, seed=4, ignore_eos=True)
    steer = ValueTilt(PrefixValue(tiny_lm.vocab_size, dim=8), 2.0, top_k=16)
    shares = []
    out = generate_reporting(tiny_lm, "the", params, adapter=steer, on_progress=shares.append)
    assert _tokens(out) == _tokens(generate(tiny_lm, "the", params, adapter=steer))
    assert shares == sorted(shares) and shares[0] > 0 and shares[-1] == 1.0 and len(shares) >= 5
    shares = []
    reported = kl_terms(tiny_lm, steer, "the", out, on_progress=shares.append)
    assert shares == [1 / 3, 2 / 3, 1.0]  # a path at a time
    assert all(torch.equal(a, b) for a, b in zip(reported, kl_terms(tiny_lm, steer, "the", out)))
    shares = []
    samples = sample_base(tiny_lm, "the", params, top_k=4, on_progress=shares.append)
    assert samples.tokens.tolist() == [list(t) for t in _tokens(generate(tiny_lm, "the", params))]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1.0) and len(shares) >= 6
    assert any(0 < share < 0.8 for share in shares)  # during the sampling, not only after it
    samples.rewards = torch.arange(3.0)
    for train in (train_cdq, train_fudge):
        shares, first = [], PrefixValue(tiny_lm.vocab_size, dim=4)
        second = PrefixValue(tiny_lm.vocab_size, dim=4)
        second.load_state_dict(first.state_dict())
        losses = train(first, samples, steps=4, on_progress=shares.append)
        assert shares == [0.25, 0.5, 0.75, 1.0]
        assert losses == train(second, samples, steps=4)
