"""NGramLM: seed 000's add-constant example, hand-computed Kneser-Ney, normalisation, cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decodekit.models.base import left_pad, prefill
from decodekit.models.ngram import NGramConfig, NGramLM, train_ngram

SEED_VOCAB = ["I", "food", "coffee", "eat", "drink", "tea", "$"]
TEXT = ["the cat sat on the mat.", "the dog sat on the log!", "a cat and a dog."]


def word_model(order: int, smoothing: str = "add-constant", data=("I drink coffee",)) -> NGramLM:
    config = NGramConfig(order, smoothing, constant=1.0)
    return train_ngram(list(data), config, level="word", vocabulary=SEED_VOCAB, eos="$")


def next_probs(model: NGramLM, text: str) -> torch.Tensor:
    logits, _ = prefill(model, [model.encode(text)])
    return torch.softmax(logits[0].double(), dim=-1)  # [V]


def test_add_constant_reproduces_seed_000_unigram_example():
    # seed 000: data {I drink coffee $}, c = 1, n = 4, v = 7: p(x) = (count(x) + 1) / 11
    probs = next_probs(word_model(order=1), "tea")
    expected = torch.tensor([2, 1, 2, 1, 2, 1, 2], dtype=torch.float64) / 11
    torch.testing.assert_close(probs, expected)


def test_add_constant_bigram_by_hand():
    model = word_model(order=2)  # events: ($ I) (I drink) (drink coffee) (coffee $)
    probs = next_probs(model, "I")
    assert probs[SEED_VOCAB.index("drink")].item() == pytest.approx((1 + 1) / (1 + 7))
    assert probs[SEED_VOCAB.index("tea")].item() == pytest.approx(1 / 8)
    # an unseen context gets the uniform distribution
    torch.testing.assert_close(next_probs(model, "tea"), torch.full((7,), 1 / 7, dtype=torch.float64))


def test_kneser_ney_by_hand():
    # vocabulary {a, b, $}, documents "a b" and "b": bigram events ($ a) (a b) (b $) ($ b) (b $)
    config = NGramConfig(2, "kneser-ney")
    model = train_ngram(["a b", "b"], config, level="word", vocabulary=["a", "b", "$"], eos="$")
    # top order: n1 = 3, n2 = 1, D = 3/5. Continuation counts N1+(. w): a 1, b 2, $ 1; D1 = 1/2
    # unigram: max(N - 1/2, 0)/4 + (1/2 * 3/4) * 1/3  ->  a 0.25, b 0.5, $ 0.25
    # p(w | $) = max(c - 0.6, 0)/2 + 0.6 * 2/2 * p1(w);  p(w | b) = ... + 0.6 * 1/2 * p1(w)
    tokens = torch.tensor([[2, 1]])  # "$ b": contexts $ then b
    probs = torch.softmax(model.forward(tokens, model.new_cache(1))[0].double(), dim=-1)
    torch.testing.assert_close(probs[0], torch.tensor([0.35, 0.5, 0.15], dtype=torch.float64))
    torch.testing.assert_close(probs[1], torch.tensor([0.075, 0.15, 0.775], dtype=torch.float64))


def test_kneser_ney_unigram_uses_raw_counts():
    # order 1: counts a 1, b 2, $ 2 (n = 5), n1 = 1, n2 = 2, D = 1/5
    config = NGramConfig(1, "kneser-ney")
    model = train_ngram(["a b", "b"], config, level="word", vocabulary=["a", "b", "$"], eos="$")
    torch.testing.assert_close(
        next_probs(model, "a"), torch.tensor([0.2, 0.4, 0.4], dtype=torch.float64)
    )


@pytest.mark.parametrize("smoothing", ["add-constant", "kneser-ney"])
@pytest.mark.parametrize("order", [0, 1, 2, 3, 4])
def test_probabilities_sum_to_one_for_random_contexts(smoothing, order):
    vocabulary = sorted(set("".join(TEXT)) | set("xyzQ")) + ["<eos>"]  # xyzQ never seen
    model = train_ngram(TEXT, NGramConfig(order, smoothing, 0.5), vocabulary=vocabulary,
                        eos="<eos>")
    gen = torch.Generator().manual_seed(order)
    tokens = torch.randint(0, model.vocab_size, (4, 12), generator=gen)  # mostly unseen
    seen = torch.tensor([model.encode("the cat sat on the ")])  # seen contexts too
    for batch in (tokens, seen):
        logits = model.forward(batch, model.new_cache(batch.shape[0]))  # [B, T, V]
        assert logits.dtype == torch.float32 and logits.shape[-1] == model.vocab_size
        probs = torch.exp(logits.double())
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2], dtype=torch.float64))
        assert (probs > 0).all()


@pytest.mark.parametrize("smoothing", ["add-constant", "kneser-ney"])
def test_token_probs_and_perplexity_match_forward(smoothing):
    model = train_ngram(TEXT, NGramConfig(3, smoothing))
    doc = model.encode("the cat sat on a log.")
    ids = torch.tensor([[model.eos_id] + doc + [model.eos_id]])  # EOS = start-of-document
    logp = torch.log_softmax(model.forward(ids, model.new_cache(1))[0, :-1].double(), dim=-1)
    nll = -logp.gather(-1, ids[0, 1:, None]).mean().item()
    assert model.perplexity([doc]) == pytest.approx(np.exp(nll), rel=1e-6)  # float32 logits


def test_higher_order_fits_training_text_better():
    models = [train_ngram(TEXT, NGramConfig(k)) for k in (1, 3)]
    ppl = [m.perplexity([m.encode(TEXT[0])]) for m in models]
    assert ppl[1] < ppl[0] / 2


def test_save_load_round_trip(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    models = [
        train_ngram(TEXT, NGramConfig(3, "kneser-ney"), name="chars"),
        word_model(2),
        train_ngram(TEXT, NGramConfig(2, "add-constant", 0.1), level="token", tokenizer=tokenizer),
    ]
    for i, model in enumerate(models):
        model.save(tmp_path / str(i))
        loaded = NGramLM.load(tmp_path / str(i))
        assert (loaded.name, loaded.config, loaded.vocab_size) == (
            model.name, model.config, model.vocab_size)
        ids = torch.tensor([model.encode("the cat" if i != 1 else "I drink tea")])
        torch.testing.assert_close(
            loaded.forward(ids, loaded.new_cache(1)), model.forward(ids, model.new_cache(1)),
            rtol=0, atol=0,
        )
        assert loaded.decode(ids[0].tolist()) == model.decode(ids[0].tolist())


def test_char_level_encode_decode():
    model = train_ngram(TEXT, NGramConfig(2))
    assert model.decode(model.encode("a dog.") + [model.eos_id]) == "a dog."
    with pytest.raises(ValueError, match="vocabulary"):
        model.encode("zebra")


def test_left_padding_fork_select_crop_match_fresh_runs():
    model = train_ngram(TEXT, NGramConfig(3, "kneser-ney"))
    a, b = model.encode("the cat"), model.encode("a dog")
    fresh = model.forward(torch.tensor([a + b]), model.new_cache(1))[0]  # [T, V]

    # left padding: row 1 holds only "at" (padded); its logits equal an unpadded run
    tokens, mask = left_pad([a, a[-2:]])
    cache = model.new_cache(2)
    padded = model.forward(tokens, cache, mask)
    alone = model.forward(torch.tensor([a[-2:]]), model.new_cache(1))[0]
    torch.testing.assert_close(padded[1, -2:], alone)

    # fork rows [0, 0, 1] and continue each with b
    forked = cache.fork([0, 0, 1])
    assert forked.length == cache.length and forked.history.shape[0] == 3
    out = model.forward(torch.tensor([b, b, b]), forked)
    torch.testing.assert_close(out[0], fresh[len(a):])
    torch.testing.assert_close(out[1], fresh[len(a):])
    # select in place keeps and reorders rows; the original cache is untouched by the fork
    forked.select([2])
    assert forked.history.shape[0] == 1 and cache.history.shape == (2, len(a))

    # crop: roll row 0 back to "the", then continue with " cat" + b: same as fresh
    single = model.new_cache(1)
    model.forward(torch.tensor([a]), single)
    single.crop(3)
    rest = model.forward(torch.tensor([a[3:] + b]), single)[0]
    torch.testing.assert_close(rest, fresh[3:])
    with pytest.raises(ValueError, match="crop length"):
        single.crop(single.length + 1)


def test_order_zero_is_uniform():
    model = train_ngram(TEXT, NGramConfig(0))
    probs = next_probs(model, "the")
    torch.testing.assert_close(probs, torch.full_like(probs, 1 / model.vocab_size))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"order": -1}, "order"), ({"order": 2, "smoothing": "witten-bell"}, "smoothing"),
     ({"order": 2, "constant": 0.0}, "constant")],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NGramConfig(**kwargs)
