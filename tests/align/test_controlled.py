"""Controlled decoding: CD-Q / CD-FUDGE value functions, token-wise and blockwise CD."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.align.controlled import (
    blockwise_cd,
    keyword_reward,
    newline_length_reward,
    orm_reward,
    sample_base,
    tokenwise_cd,
)
from decodekit.align.value import PrefixValue, cdq_fixed_point, cdq_targets, train_cdq, train_fudge
from decodekit.models.base import Cache, LanguageModel

# A depth-2 binary tree: tokens 0/1, token 2 is the prompt ("start").
# p(.|start) = (0.25, 0.75), p(.|0) = (0.5, 0.5), p(.|1) = (0.9, 0.1).
POLICY = {(): {0: 0.25, 1: 0.75}, (0,): {0: 0.5, 1: 0.5}, (1,): {0: 0.9, 1: 0.1}}
LEAF_REWARD = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 2.0, (1, 1): -1.0}
# Backward recursion by hand: V(0) = 0.5, V(1) = 0.9*2 - 0.1 = 1.7, V() = 0.25*0.5 + 0.75*1.7.
EXACT = {(): 1.4, (0,): 0.5, (1,): 1.7, **LEAF_REWARD}


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


def _tree_samples(n: int, seed: int):
    model = TreeLM()
    samples = sample_base(model, [2], n, 2, top_k=3, generator=torch.Generator().manual_seed(seed))
    samples.rewards = torch.tensor([LEAF_REWARD[tuple(r)] for r in samples.tokens.tolist()])
    return model, samples


def _counts(tokens: torch.Tensor) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for row in tokens.tolist():
        out[tuple(row)] = out.get(tuple(row), 0) + 1 / tokens.shape[0]
    return out


def test_cdq_fixed_point_equals_backward_recursion():
    table = cdq_fixed_point(POLICY.__getitem__, LEAF_REWARD.__getitem__, depth=2)
    assert table == pytest.approx(EXACT, abs=1e-12)
    # One sweep short, the root has not yet seen the leaves.
    short = cdq_fixed_point(POLICY.__getitem__, LEAF_REWARD.__getitem__, depth=2, iterations=2)
    assert short[()] == pytest.approx(0.0)


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


def test_tokenwise_with_lam_zero_samples_from_p():
    model = TreeLM()
    out = tokenwise_cd(model, PrefixValue(3), [2], 4000, 2, lam=0.0, top_k=None,
                       generator=torch.Generator().manual_seed(3))
    exact = {leaf: POLICY[()][leaf[0]] * POLICY[leaf[:1]][leaf[1]] for leaf in LEAF_REWARD}
    assert _counts(out.tokens) == pytest.approx(exact, abs=0.025)
    assert torch.allclose(out.log_ratio, torch.zeros(4000), atol=1e-5)


class _TableValue(PrefixValue):
    """V(prefix + z) read from EXACT (prefixes here have one token)."""

    def child_values(self, bag, t, ids):
        return torch.tensor([[EXACT[(int(z),)] for z in row] for row in ids.tolist()])


def test_tokenwise_first_step_is_the_tilt():
    lam = 1.0
    out = tokenwise_cd(TreeLM(), _TableValue(3), [2], 4000, 1, lam=lam, top_k=2,
                       generator=torch.Generator().manual_seed(4))
    w0, w1 = 0.25 * math.exp(lam * 0.5), 0.75 * math.exp(lam * 1.7)
    pi0 = w0 / (w0 + w1)  # 0.0912
    assert float((out.tokens[:, 0] == 0).float().mean()) == pytest.approx(pi0, abs=0.015)
    kl = pi0 * math.log(pi0 / 0.25) + (1 - pi0) * math.log((1 - pi0) / 0.75)
    assert float(out.step_kl[0]) == pytest.approx(kl, abs=1e-5)
    assert float(out.log_ratio.mean()) == pytest.approx(kl, abs=0.03)  # Monte Carlo of log pi/p


def test_blockwise_with_k_one_is_plain_sampling(toy_lm):
    base = sample_base(toy_lm, [1, 2], 5, 7, generator=torch.Generator().manual_seed(5))
    block = blockwise_cd(toy_lm, PrefixValue(6), [1, 2], 5, 7, k=1, m=3,
                         generator=torch.Generator().manual_seed(5))
    assert torch.equal(block.tokens, base.tokens)


class _CountValue(PrefixValue):
    """V(prefix) = number of token 1 in it."""

    def forward(self, tokens):
        counts = (tokens == 1).float().cumsum(dim=1)
        return torch.cat([torch.zeros(tokens.shape[0], 1), counts], dim=1)


def test_blockwise_keeps_the_best_block():
    # One block of 2 tokens, K = 4: the kept block has the most 1s among 4 base draws.
    out = blockwise_cd(TreeLM(), _CountValue(3), [2], 3000, 2, k=4, m=2,
                       generator=torch.Generator().manual_seed(6))
    ones = (out.tokens == 1).sum(dim=1)
    # Under p: P(0 ones) = 0.125, P(1) = 0.125 + 0.675 = 0.8, P(2) = 0.075.
    # Best of 4: P(2) = 1 - 0.925^4, P(0) = 0.125^4.
    assert float((ones == 2).float().mean()) == pytest.approx(1 - 0.925**4, abs=0.03)
    assert float((ones == 0).float().mean()) == pytest.approx(0.125**4, abs=0.01)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"lam": -1.0}, "lam"), ({"lam": float("nan")}, "lam"), ({"lam": 1.0, "top_k": 0}, "top_k")],
)
def test_tokenwise_rejects_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        tokenwise_cd(TreeLM(), PrefixValue(3), [2], 2, 2, **kwargs)


@pytest.mark.parametrize(
    ("k", "m", "name", "error"), [(0, 2, "k", ValueError), (2, 0, "m", ValueError), (1.5, 2, "k", TypeError)]
)
def test_blockwise_rejects_bad_input(k, m, name, error):
    with pytest.raises(error, match=f"^{name} "):
        blockwise_cd(TreeLM(), PrefixValue(3), [2], 2, 2, k=k, m=m)


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
