"""The Q head on hidden states (align/qvalue.py): CD-Q and CD-FUDGE training on a tabular
tree whose exact Q is known, and the value contracts ValueTilt and BlockwiseCD read, on a
tiny NativeLM."""

from __future__ import annotations

import pytest
import torch

from decodekit.align.blockwise import BlockwiseCD
from decodekit.align.controlled import ValueTilt, sample_base
from decodekit.align.qvalue import (
    HiddenValue,
    QHead,
    add_hidden_states,
    q_targets,
    train_q_cdq,
    train_q_fudge,
)
from decodekit.align.value import BaseSamples, cdq_fixed_point
from decodekit.decode.sample import generate
from decodekit.meta.generator import LocalGenerator
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# A depth-2 binary tree (as in test_controlled.py): p(.|()) = (0.25, 0.75),
# p(.|0) = (0.5, 0.5), p(.|1) = (0.9, 0.1); a reward at each leaf.
POLICY = {(): {0: 0.25, 1: 0.75}, (0,): {0: 0.5, 1: 0.5}, (1,): {0: 0.9, 1: 0.1}}
LEAF_REWARD = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 2.0, (1, 1): -1.0}
STATES = {(): 0, (0,): 1, (1,): 2}  # a one-hot "hidden state" per prefix: Q is a table


def _tree(n: int, seed: int) -> BaseSamples:
    """n base samples of the tree, with one-hot states and the exact children of p."""
    gen = torch.Generator().manual_seed(seed)
    first = (torch.rand(n, generator=gen) < POLICY[()][1]).long()
    second_p1 = torch.where(first == 0, POLICY[(0,)][1], POLICY[(1,)][1])
    second = (torch.rand(n, generator=gen) < second_p1).long()
    tokens = torch.stack([first, second], dim=1)  # [N, 2]
    rewards = torch.tensor([LEAF_REWARD[tuple(row)] for row in tokens.tolist()])
    prefixes = [[(), (int(a),)] for a in first]
    hidden = torch.eye(3)[torch.tensor([[STATES[s] for s in row] for row in prefixes])]  # [N, 2, 3]
    probs = torch.tensor([[[POLICY[s][0], POLICY[s][1]] for s in row] for row in prefixes])
    child_ids = torch.tensor([0, 1]).expand(n, 2, 2)
    return BaseSamples(tokens, rewards, child_ids.clone(), probs.log(), hidden)


def _table(head: QHead) -> dict[tuple, float]:
    """The head's Q(s, z) as {s + (z,): value}, each s with its states from the root."""
    e = torch.eye(3)
    paths = {(): e[[0]], (0,): e[[0, 1]], (1,): e[[0, 2]]}  # [t + 1, 3]
    table = {}
    with torch.no_grad():
        for s, states in paths.items():
            q = head(states[None])[0, -1]  # [2 tokens]
            table.update({(*s, z): float(q[z]) for z in (0, 1)})
    return table


def test_cdq_training_reaches_the_exact_q():
    exact = cdq_fixed_point(POLICY.__getitem__, LEAF_REWARD.__getitem__, depth=2)
    samples = _tree(256, seed=1)
    torch.manual_seed(0)
    head = QHead(3, 2, width=16)
    losses = train_q_cdq(head, samples, epochs=400, lr=2e-2, batch_size=512)
    got = _table(head)
    # Q(s, z) = V(s + z): the root's children use p's exact children, not the sampled leaves.
    assert got == pytest.approx({k: exact[k] for k in got}, abs=0.03)
    assert losses[-1] < losses[0]
    # At the fixed point the target of every sampled pair is (close to) its own Q.
    q = head(samples.hidden).detach()  # [N, 2, 2]
    chosen = q.gather(-1, samples.tokens[..., None])[..., 0]
    assert torch.allclose(chosen, q_targets(q, samples, torch.arange(256), cdq=True), atol=0.03)


def test_fudge_training_reaches_the_mean_reward_of_the_samples():
    samples = _tree(256, seed=2)
    torch.manual_seed(0)
    head = QHead(3, 2, width=16)
    train_q_fudge(head, samples, epochs=400, lr=2e-2, batch_size=512)
    got = _table(head)
    tokens, rewards = samples.tokens, samples.rewards
    for z in (0, 1):  # least squares: the mean reward of the samples through s + z
        assert got[(z,)] == pytest.approx(float(rewards[tokens[:, 0] == z].mean()), abs=0.03)
        for w in (0, 1):
            through = (tokens[:, 0] == z) & (tokens[:, 1] == w)
            assert got[(z, w)] == pytest.approx(float(rewards[through].mean()), abs=0.03)
    # FUDGE's root children are sample means: off the exact Q by the sampling noise.
    assert got[(0,)] != pytest.approx(0.5, abs=1e-3)


def test_training_rejects_bad_input():
    samples = _tree(8, seed=0)
    with pytest.raises(ValueError, match="epochs"):
        train_q_fudge(QHead(3, 2), samples, epochs=0)
    with pytest.raises(ValueError, match="lr"):
        train_q_fudge(QHead(3, 2), samples, lr=0.0)
    samples.child_ids = None
    with pytest.raises(ValueError, match="CD-Q"):
        train_q_cdq(QHead(3, 2), samples)
    samples.hidden = None
    with pytest.raises(ValueError, match="add_hidden_states"):
        train_q_fudge(QHead(3, 2), samples)
    with pytest.raises(ValueError, match="width"):
        QHead(3, 2, width=0)
    with pytest.raises(ValueError, match="memory"):
        QHead(3, 2, memory=0)
    with pytest.raises(TypeError, match="head"):
        HiddenValue(None, [1], torch.nn.Linear(3, 2))


def _random_head(model, seed: int = 0) -> QHead:
    torch.manual_seed(seed)
    head = QHead(model.config.hidden_size, model.vocab_size, width=8, memory=4)
    torch.nn.init.normal_(head.out.weight, std=1.0)
    return head


def test_hidden_value_reads_the_states_of_each_prefix(tiny_lm):
    prompt = tiny_lm.encode("the")
    samples = sample_base(tiny_lm, prompt, SamplingParams(n=3, max_new_tokens=5, seed=0, ignore_eos=True),
                          top_k=4)
    add_hidden_states(tiny_lm, prompt, samples, chunk=2)
    assert samples.hidden.shape == (3, 5, tiny_lm.config.hidden_size)
    head = _random_head(tiny_lm)
    value = HiddenValue(tiny_lm, prompt, head, chunk=2)
    rows = samples.tokens.tolist()
    q_all = head(samples.hidden).detach()  # [3, 5, V]: Q(s_t, .) from the states s_0..s_t
    for t in range(5):
        assert torch.allclose(value.q_values([r[:t] for r in rows]), q_all[:, t], atol=1e-4)
    # Rows of different lengths (left-padded, chunked) agree with each row alone.
    mixed = [rows[0][:1], rows[1][:4], [], rows[2]]
    ids = torch.tensor([[0, 5], [7, 2], [3, 3], [1, 9]])
    together = value.child_values(mixed, ids)
    alone = torch.cat([value.child_values([m], ids[i : i + 1]) for i, m in enumerate(mixed)])
    assert together.shape == (4, 2) and torch.allclose(together, alone, atol=1e-4)
    # A completion's value is Q of its last token given the rest; the empty one E_p[Q(prompt, .)].
    got = value.prefix_values([rows[0][:3], rows[1], [], rows[2][:1]])
    probs = torch.softmax(tiny_lm.forward(torch.tensor([prompt]), tiny_lm.new_cache(1))[0, -1], dim=-1)
    expected = [q_all[0, 2, rows[0][2]], q_all[1, 4, rows[1][4]], q_all[2, 0] @ probs,
                q_all[2, 0, rows[2][0]]]
    assert got.tolist() == pytest.approx([float(x) for x in expected], abs=1e-4)


def test_hidden_value_steers_tokenwise_and_blockwise_decoding(tiny_lm):
    params = SamplingParams(n=4, max_new_tokens=6, seed=1, ignore_eos=True)
    fresh = QHead(tiny_lm.config.hidden_size, tiny_lm.vocab_size, baseline=-3.0)
    untrained = HiddenValue(tiny_lm, "the", fresh)
    assert torch.equal(untrained.q_values([[], [4, 5]]), torch.full((2, tiny_lm.vocab_size), -3.0))
    [plain] = generate(tiny_lm, ["the"], params)
    [same] = generate(tiny_lm, ["the"], params, adapter=ValueTilt(untrained, 5.0))
    assert [c.token_ids for c in same] == [c.token_ids for c in plain]  # a constant Q leaves p as it is
    # A head that likes one token: the tilt puts nearly all mass on it.
    head = QHead(tiny_lm.config.hidden_size, tiny_lm.vocab_size)
    with torch.no_grad():
        head.out.bias[7] = 1.0
    liked = HiddenValue(tiny_lm, "the", head)
    [steered] = generate(tiny_lm, ["the"], params, adapter=ValueTilt(liked, 30.0))
    assert all(c.token_ids == [7] * 6 for c in steered)
    # Blockwise, Q(s, z) = z / V: of K blocks the kept one ends in the largest id.
    by_id = QHead(tiny_lm.config.hidden_size, tiny_lm.vocab_size)
    with torch.no_grad():
        by_id.out.bias.copy_(torch.arange(tiny_lm.vocab_size) / tiny_lm.vocab_size)
    value = HiddenValue(tiny_lm, "the", by_id).prefix_values
    last = {}
    for k in (1, 8):
        out = BlockwiseCD(LocalGenerator(tiny_lm), value, k=k, m=2).generate(["the"], 16, params)[0]
        last[k] = sum(c.token_ids[i] for c in out for i in (1, 3, 5)) / 48
    assert last[8] > last[1] + 0.1 * tiny_lm.vocab_size


def test_models_without_hidden_states_say_so():
    class Bare(LanguageModel):
        name, vocab_size, eos_token_ids, tokenizer, max_context = "bare", 3, (), None, 8

        def new_cache(self, batch_size):
            raise AssertionError("not called")

        def forward(self, tokens, cache, mask=None):
            raise AssertionError("not called")

    with pytest.raises(TypeError, match="model 'bare' \\(Bare\\) does not expose hidden states"):
        Bare().hidden_states(torch.zeros(1, 2, dtype=torch.long))


def test_training_reports_its_progress_after_every_minibatch():
    """Issue 35: `eval alignment --value hidden` moves its bar within a training."""
    samples = _tree(64, seed=1)
    shares = []
    torch.manual_seed(0)
    train_q_cdq(QHead(3, 2, width=8), samples, epochs=2, batch_size=32, on_progress=shares.append)
    assert shares == pytest.approx([i / 8 for i in range(1, 9)])  # 64 samples of 2 pairs, 16 a batch
