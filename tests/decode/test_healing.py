import pytest
import torch

import decodekit as dk
from decodekit.decode.healing import HealingMask, heal_prompt, token_bytes
from decodekit.models.base import Cache, LanguageModel

pytest.importorskip("llguidance")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class HistoryCache(Cache):
    def __init__(self, last: torch.Tensor):
        self.last = last  # [B] the last token of each row

    @property
    def length(self) -> int:
        return 0

    def fork(self, rows):
        return HistoryCache(self.last[list(rows)])

    def select(self, rows):
        self.last = self.last[list(rows)]

    def crop(self, length):
        raise NotImplementedError


class BigramLM(LanguageModel):
    """log (count(a b) + 0.01) from the tokenised training text of the tiny tokenizer: a model
    that has seen how the tokenizer splits its text, which a random model has not."""

    def __init__(self, tokenizer, text):
        ids = tokenizer.encode(text * 3)
        self.vocab_size, self.tokenizer, self.name = len(tokenizer), tokenizer, "bigram"
        self.eos_token_ids, self.max_context = (tokenizer.eos_token_id,), 512
        counts = torch.full((self.vocab_size, self.vocab_size), 0.01)
        for a, b in zip(ids, ids[1:]):
            counts[a, b] += 1
        self.table = counts.log()

    def new_cache(self, batch_size):
        return HistoryCache(torch.zeros(batch_size, dtype=torch.long))

    def forward(self, tokens, cache, mask=None):
        return self.table[tokens]  # [B, T, V]: the next token depends on the last one only


@pytest.fixture(scope="module")
def bigram(tiny_lm, tiny_text):
    return BigramLM(tiny_lm.tokenizer, tiny_text)


def pieces(model, ids):
    return [model.decode([t]) for t in ids]


def test_healing_picks_the_natural_merged_token(bigram):
    prompt = "JULIET: O Ro"  # ends inside " Romeo", one token in the tokenizer
    ids = bigram.encode(prompt)
    assert pieces(bigram, ids)[-1] == " Ro"
    natural = bigram.encode("JULIET: O Romeo")[-1]
    assert bigram.decode([natural]) == " Romeo"
    params = dk.SamplingParams(temperature=0, max_new_tokens=4)
    [plain] = dk.generate(bigram, prompt, params)
    assert plain.token_ids[0] != natural  # " Ro" + " Romeo" is not a split the model knows
    [healed] = dk.generate(bigram, prompt, params, heal=True)
    assert healed.token_ids[0] == natural
    assert healed.text.startswith("meo")
    assert bigram.decode(ids[:-1] + healed.token_ids) == prompt + healed.text
    [beam] = dk.beam_search(bigram, prompt, dk.SamplingParams(max_new_tokens=4), num_beams=2, heal=True)
    assert beam.token_ids[0] == natural and beam.text.startswith("meo")


def test_allowed_tokens_start_with_or_are_a_prefix_of_the_removed_text(tiny_lm):
    mask = HealingMask(token_bytes(tiny_lm), b" Ro", 1)
    assert pieces(tiny_lm, mask.allowed_for(b" Ro").nonzero()[:, 0].tolist()) == [" ", " Ro", " Romeo"]
    mask.accept(torch.tensor([tiny_lm.tokenizer.convert_tokens_to_ids("Ġ")]))  # " " covers 1 byte
    assert mask.remaining == [b"Ro"]
    assert set(pieces(tiny_lm, mask.allowed_for(b"Ro").nonzero()[:, 0].tolist())) == {"R", "Ro"}
    logits = torch.zeros(1, tiny_lm.vocab_size)
    assert torch.isfinite(mask.apply(logits)[0]).sum() == 2
    mask.accept(torch.tensor([tiny_lm.tokenizer.convert_tokens_to_ids("Ro")]))
    assert mask.remaining == [b""] and torch.equal(mask.apply(logits), logits)  # healed: no mask


@pytest.mark.parametrize("heal", [True, 2])
def test_every_sample_reproduces_the_prompt_text(tiny_lm, heal):
    prompt = "ROMEO: But so"
    ids = tiny_lm.encode(prompt)
    params = dk.SamplingParams(max_new_tokens=6, n=4, seed=3, ignore_eos=True)
    for c in dk.generate(tiny_lm, prompt, params, heal=heal):
        assert tiny_lm.decode(ids[: -int(heal)] + c.token_ids) == prompt + c.text
        assert c.usage.prompt_tokens == len(ids) - int(heal)
    for c in dk.beam_search(tiny_lm, prompt, params.replace(n=2), num_beams=2, heal=heal):
        assert tiny_lm.decode(ids[: -int(heal)] + c.token_ids) == prompt + c.text
    streamed = "".join(dk.stream(tiny_lm, prompt, params.replace(n=1), heal=heal))
    assert streamed == dk.generate(tiny_lm, prompt, params.replace(n=1), heal=heal)[0].text


def test_nothing_to_heal_leaves_generation_unchanged(tiny_lm):
    params = dk.SamplingParams(max_new_tokens=5, seed=1)
    one_token = [tiny_lm.encode("ROMEO")[-1]]
    assert dk.generate(tiny_lm, [one_token], params, heal=True)[0][0].token_ids == dk.generate(
        tiny_lm, [one_token], params)[0][0].token_ids
    mask, ids, _ = heal_prompt(tiny_lm, one_token, 1, True)
    assert mask is None and ids == one_token


def test_bad_heal_values(tiny_lm):
    for bad in (-1, 1.5, "yes"):
        with pytest.raises(ValueError, match="heal"):
            dk.generate(tiny_lm, "ROMEO:", dk.SamplingParams(max_new_tokens=2), heal=bad)


@pytest.mark.parametrize("prompt, word", [("ROMEO:\nWherefore art th", " thou"),
                                          ("HAMLET:\nGood my lo", " lord"),
                                          ("ROMEO:\nI will not st", " stay")])
def test_embedded_model_heals_to_the_natural_token(prompt, word):
    from decodekit.models.registry import embedded_models

    if "shakespeare" not in embedded_models():
        pytest.skip("the embedded shakespeare model is not installed")
    model = dk.load_model("shakespeare")
    ids = model.encode(prompt)
    natural = model.encode(prompt[: prompt.rindex(" ")] + word)[-1]
    assert model.decode([natural]) == word and model.decode([ids[-1]]) != word
    params = dk.SamplingParams(temperature=0, max_new_tokens=3)
    [plain] = dk.generate(model, prompt, params)
    [healed] = dk.generate(model, prompt, params, heal=True)
    assert healed.token_ids[0] == natural != plain.token_ids[0]
    assert model.decode(ids[:-1] + healed.token_ids) == prompt + healed.text
