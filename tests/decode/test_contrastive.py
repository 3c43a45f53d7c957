import json
import math

import pytest
import torch

import decodekit as dk
from decodekit.decode.contrastive import ContrastiveLM, contrastive_scores
from decodekit.models.base import Cache, LanguageModel

NEG_INF = float("-inf")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class CountCache(Cache):
    def __init__(self, rows: int, length: int = 0):
        self.rows, self._length = rows, length

    @property
    def length(self) -> int:
        return self._length

    def fork(self, rows):
        return CountCache(len(rows), self._length)

    def select(self, rows):
        self.rows = len(rows)

    def crop(self, length):
        self._length = length


class FixedLM(LanguageModel):
    """The same next-token logits at every position (a hand-made distribution)."""

    def __init__(self, logits, tokenizer=None, name="fixed", eos=()):
        self.logits = torch.as_tensor(logits, dtype=torch.float32)
        self.vocab_size, self.tokenizer, self.name = len(self.logits), tokenizer, name
        self.eos_token_ids, self.max_context = tuple(eos), 1000

    def new_cache(self, batch_size):
        return CountCache(batch_size)

    def forward(self, tokens, cache, mask=None):
        cache._length += tokens.shape[1]
        return self.logits.expand(*tokens.shape, self.vocab_size).clone()


def logs(p):
    return [math.log(x) if x > 0 else NEG_INF for x in p]


def test_scores_equal_the_formula_with_the_plausibility_cut():
    p_e, p_a = [0.5, 0.3, 0.15, 0.05], [0.6, 0.1, 0.2, 0.1]
    # alpha = 0.25: head = {p_e >= 0.125} = tokens 0, 1, 2
    scores = contrastive_scores(torch.tensor([logs(p_e)]), torch.tensor([logs(p_a)]), alpha=0.25)[0]
    expected = [math.log(0.5 / 0.6), math.log(0.3 / 0.1), math.log(0.15 / 0.2), NEG_INF]
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert int(scores.argmax()) == 1  # the expert's argmax is 0; contrast prefers 1


def test_head_boundary_is_inclusive_and_alpha_one_keeps_only_the_argmax():
    expert = torch.tensor([[0.0, math.log(0.25), math.log(0.25) - 1e-9, -5.0]], dtype=torch.float64)
    amateur = torch.zeros(1, 4)
    scores = contrastive_scores(expert, amateur, alpha=0.25)[0]
    assert torch.isfinite(scores).tolist() == [True, True, False, False]
    top = contrastive_scores(expert, amateur, alpha=1.0)[0]
    assert torch.isfinite(top).tolist() == [True, False, False, False]


def test_amateur_temperature_and_weight():
    p_e, z_a = [0.5, 0.3, 0.2], torch.tensor([[2.0, 0.0, -1.0]])
    tau, beta = 0.5, 0.7
    log_pa = torch.log_softmax(z_a.double() / tau, -1)[0]
    scores = contrastive_scores(torch.tensor([logs(p_e)]), z_a, alpha=0.0,
                                amateur_temperature=tau, amateur_weight=beta)[0]
    expected = [math.log(p) - beta * float(a) for p, a in zip(p_e, log_pa)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)
    # beta = 0 is the expert truncated to its head
    only_expert = contrastive_scores(torch.tensor([logs(p_e)]), z_a, alpha=0.5, amateur_weight=0.0)[0]
    assert only_expert.tolist() == pytest.approx([math.log(0.5), math.log(0.3), NEG_INF], abs=1e-6)


def test_alpha_zero_and_uniform_amateur_reduce_to_the_expert(tiny_lm):
    uniform = FixedLM(torch.zeros(tiny_lm.vocab_size), tiny_lm.tokenizer)
    cd = ContrastiveLM(tiny_lm, uniform, alpha=0.0)
    prompt = tiny_lm.encode("ROMEO: But soft")
    expert = tiny_lm.forward(torch.tensor([prompt]), tiny_lm.new_cache(1))
    scores = cd.forward(torch.tensor([prompt]), cd.new_cache(1))
    torch.testing.assert_close(torch.softmax(scores, -1), torch.softmax(expert, -1), atol=1e-6, rtol=0)
    for params in (dk.SamplingParams(temperature=0, max_new_tokens=15, ignore_eos=True),
                   dk.SamplingParams(seed=4, max_new_tokens=15, ignore_eos=True, n=2)):
        ours = [c.token_ids for c in dk.generate(cd, "ROMEO:", params)]
        theirs = [c.token_ids for c in dk.generate(tiny_lm, "ROMEO:", params)]
        assert ours == theirs


def test_greedy_picks_the_contrastive_argmax():
    tok_free = dict(tokenizer=None, eos=())
    expert = FixedLM(logs([0.5, 0.3, 0.15, 0.05]), **tok_free)
    amateur = FixedLM(logs([0.6, 0.1, 0.2, 0.1]), name="amateur", **tok_free)
    params = dk.SamplingParams(temperature=0, max_new_tokens=3)
    assert dk.generate(expert, [[0]], params)[0][0].token_ids == [0, 0, 0]
    [c] = dk.generate(ContrastiveLM(expert, amateur, alpha=0.25), [[0]], params)[0]
    assert c.token_ids == [1, 1, 1]
    # p proportional to p_e / p_a over the head: 0.5/0.6, 3, 0.75 normalised
    ratios = [0.5 / 0.6, 3.0, 0.75]
    sampled = dk.generate(ContrastiveLM(expert, amateur, alpha=0.25), [[0]],
                          dk.SamplingParams(max_new_tokens=1, seed=0, logprobs=3))[0][0]
    expected = {i: math.log(r / sum(ratios)) for i, r in enumerate(ratios)}
    assert sampled.top_logprobs[0] == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def amateur_lm(tiny_llama_dir, tiny_lm):
    from transformers import LlamaConfig, LlamaForCausalLM

    from decodekit.models.hf import HFModelLM

    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.num_hidden_layers = 1
    torch.manual_seed(5)
    return HFModelLM(LlamaForCausalLM(config), tiny_lm.tokenizer, "amateur")


def full_scores(cd: ContrastiveLM, ids: list[int], window=None) -> torch.Tensor:
    """CD scores of the next token, recomputing both models on the whole context."""
    expert = cd.expert.forward(torch.tensor([ids]), cd.expert.new_cache(1))[0, -1]
    seen = ids if window is None else ids[-window:]
    amateur = cd.amateur.forward(torch.tensor([seen]), cd.amateur.new_cache(1))[0, -1]
    return contrastive_scores(expert, amateur, cd.alpha, cd.amateur_temperature, cd.amateur_weight)


@pytest.mark.parametrize("window", [None, 3])
def test_cached_greedy_equals_recomputing_both_models(tiny_lm, amateur_lm, window):
    cd = ContrastiveLM(tiny_lm, amateur_lm, alpha=0.05, amateur_temperature=0.8, amateur_window=window)
    prompt = tiny_lm.encode("JULIET: O Romeo")
    params = dk.SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    [c] = dk.generate(cd, [prompt], params)[0]
    ids = list(prompt)
    for _ in range(10):
        ids.append(int(full_scores(cd, ids, window).argmax()))
    assert c.token_ids == ids[len(prompt):]
    # beam search with one beam is greedy search on the same scores
    [b] = dk.beam_search(cd, [prompt], params, num_beams=1)[0]
    assert b.token_ids == c.token_ids


def test_window_applies_per_row_of_a_padded_batch(tiny_lm, amateur_lm):
    cd = ContrastiveLM(tiny_lm, amateur_lm, alpha=0.0, amateur_window=2)
    prompts = [tiny_lm.encode("ROMEO: But soft"), tiny_lm.encode("the sun")]
    from decodekit.models.base import left_pad

    tokens, mask = left_pad(prompts)
    scores = cd.forward(tokens, cd.new_cache(2), mask)[:, -1]  # [2, V]
    for row, ids in enumerate(prompts):
        torch.testing.assert_close(scores[row], full_scores(cd, ids, window=2), atol=1e-5, rtol=1e-5)


def test_window_longer_than_the_context_changes_nothing(tiny_lm, amateur_lm):
    params = dk.SamplingParams(seed=2, max_new_tokens=8, ignore_eos=True, n=2, top_k=20)
    plain = ContrastiveLM(tiny_lm, amateur_lm, alpha=0.1)
    wide = ContrastiveLM(tiny_lm, amateur_lm, alpha=0.1, amateur_window=90)
    assert [c.token_ids for c in dk.generate(plain, "ROMEO:", params)] == [
        c.token_ids for c in dk.generate(wide, "ROMEO:", params)
    ]


def test_beam_search_and_n_samples_run_on_contrastive_scores(tiny_lm, amateur_lm):
    cd = ContrastiveLM(tiny_lm, amateur_lm, alpha=0.1)
    beams = dk.beam_search(cd, "ROMEO:", dk.SamplingParams(max_new_tokens=6, n=3), num_beams=3)
    assert len(beams) == 3 and all(len(b.token_ids) <= 6 for b in beams)
    assert [b.score for b in beams] == sorted([b.score for b in beams], reverse=True)
    samples = dk.generate(cd, "ROMEO:", dk.SamplingParams(max_new_tokens=6, n=4, seed=1))
    # every sampled token lies in the expert's plausible head at its step
    for c in samples:
        ids = tiny_lm.encode("ROMEO:")
        for token in c.token_ids:
            assert math.isfinite(float(full_scores(cd, ids)[token]))
            ids.append(token)


def test_bad_arguments(tiny_lm, amateur_lm):
    other_vocab = FixedLM(torch.zeros(tiny_lm.vocab_size + 1), None)
    with pytest.raises(ValueError, match="vocabulary"):
        ContrastiveLM(tiny_lm, other_vocab)
    with pytest.raises(ValueError, match="tokenizer"):
        ContrastiveLM(tiny_lm, FixedLM(torch.zeros(tiny_lm.vocab_size), None))
    for kwargs, name in [({"alpha": 1.5}, "alpha"), ({"alpha": -0.1}, "alpha"),
                         ({"amateur_temperature": 0}, "amateur_temperature"),
                         ({"amateur_window": 0}, "amateur_window"),
                         ({"amateur_window": 10_000}, "amateur_window"),
                         ({"amateur_weight": -1.0}, "amateur_weight")]:
        with pytest.raises(ValueError, match=name):
            ContrastiveLM(tiny_lm, amateur_lm, **kwargs)


def test_embedded_pair_runs_from_the_cli(capsys):
    from decodekit.cli import main
    from decodekit.models.registry import embedded_models

    if not {"shakespeare", "shakespeare-draft"} <= set(embedded_models()):
        pytest.skip("the embedded shakespeare models are not installed")
    code = main(["generate", "ROMEO:\n", "--strategy", "contrastive", "--max-new-tokens", "8", "--json"])
    [c] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # one per line
    assert code == 0 and len(c["token_ids"]) <= 8
    expert, amateur = dk.load_model("shakespeare"), dk.load_model("shakespeare-draft")
    cd = ContrastiveLM(expert, amateur)  # alpha 0.1, as the CLI's default
    ids = expert.encode("ROMEO:\n")
    for token in c["token_ids"]:
        assert token == int(full_scores(cd, ids).argmax())
        ids.append(token)
