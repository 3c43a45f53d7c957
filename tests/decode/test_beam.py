import itertools
import math

import pytest
import torch

import decodekit as dk


def exhaustive(model, prompt, max_len, alpha):
    """All sequences that end in EOS (0) or reach max_len, scored by sum log p / len^alpha."""
    # One batched forward over every full-length sequence gives the log-prob of every prefix.
    full = list(itertools.product(range(model.vocab_size), repeat=max_len))
    ids = torch.tensor([prompt + list(seq) for seq in full])
    logp = torch.log_softmax(model.forward(ids, model.new_cache(len(full))), -1)  # [N, T, V]
    row = {seq: i for i, seq in enumerate(full)}

    def sequence_logprob(seq):
        i = row[tuple(seq) + (0,) * (max_len - len(seq))]
        return sum(float(logp[i, len(prompt) - 1 + k, t]) for k, t in enumerate(seq))

    scored = []
    for length in range(1, max_len + 1):
        for body in itertools.product(range(1, model.vocab_size), repeat=length - 1):
            for last in range(model.vocab_size):
                if length < max_len and last != 0:
                    continue
                seq = list(body) + [last]
                scored.append((sequence_logprob(seq) / length**alpha, seq))
    return sorted(scored, reverse=True)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_wide_beam_equals_exhaustive_search(toy_lm, alpha):
    prompt = [3, 1]
    best = exhaustive(toy_lm, prompt, 3, alpha)
    out = dk.beam_search(toy_lm, [prompt], dk.SamplingParams(max_new_tokens=3, n=4),
                         num_beams=40, length_penalty=alpha, early_stopping=False)[0]
    assert [c.token_ids for c in out] == [seq for _, seq in best[:4]]
    for c, (score, _) in zip(out, best[:4]):
        assert c.score == pytest.approx(score, abs=1e-5)


def test_width_one_equals_greedy(tiny_lm):
    params = dk.SamplingParams(max_new_tokens=15, temperature=0, ignore_eos=True)
    [g] = dk.generate(tiny_lm, "ROMEO:", params)
    [b] = dk.beam_search(tiny_lm, "ROMEO:", params, num_beams=1)
    assert b.token_ids == g.token_ids
    assert b.score == pytest.approx(sum(g.logprobs) / len(g.logprobs), abs=1e-4)


def test_beam_returns_n_best_sorted_and_blocks_ngrams(tiny_lm):
    params = dk.SamplingParams(max_new_tokens=20, n=3, no_repeat_ngram_size=2, ignore_eos=True)
    out = dk.beam_search(tiny_lm, "the sun", params, num_beams=4)
    assert len(out) == 3
    assert [c.score for c in out] == sorted([c.score for c in out], reverse=True)
    prompt = tiny_lm.encode("the sun")
    for c in out:
        ids = prompt + c.token_ids
        bigrams = list(zip(ids, ids[1:]))
        assert len(bigrams) == len(set(bigrams))
        assert math.isfinite(c.score)


def test_beam_bad_input(tiny_lm):
    with pytest.raises(ValueError, match="num_beams must be"):
        dk.beam_search(tiny_lm, "a", num_beams=0)
    with pytest.raises(ValueError, match="n must be <= num_beams"):
        dk.beam_search(tiny_lm, "a", dk.SamplingParams(n=5), num_beams=2)
