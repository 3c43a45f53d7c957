"""Penalties and masks: repetition, frequency/presence, n-gram blocking, DRY, bad words,
allowed tokens, logit bias, min tokens; on hand-made histories."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.params import SamplingParams
from decodekit.sampling import processors as P
from decodekit.sampling.adapters import bad_word_sequences, dry_breakers
from decodekit.sampling.chain import SamplerState, build_chain

INF = math.inf
WORDS = ["<eos>", "a", "b", "c", ":", "::", "hello", "world"]


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level Hugging Face tokenizer over WORDS (ids in list order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>")


def banned(logits):
    return [torch.isneginf(row).nonzero().flatten().tolist() for row in logits]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    out = P.repetition_penalty(logits, [[0, 1, 1, 3]], 2.0)
    assert out[0].tolist() == [1.0, -2.0, 0.5, 0.0, 3.0]  # 2 and 4 unseen


def test_repetition_penalty_below_one_rewards_seen_tokens():
    out = P.repetition_penalty(torch.tensor([[2.0, -1.0]]), [[0, 1]], 0.5)
    assert out[0].tolist() == [4.0, -0.5]


def test_frequency_and_presence_count_generated_tokens_per_row():
    logits = torch.zeros(2, 4)
    out = P.frequency_presence(logits, [[0, 0, 2], [3]], 0.5, 0.25)
    # row 0: token 0 twice -> -(2 * 0.5 + 0.25); token 2 once -> -(0.5 + 0.25)
    assert out.tolist() == [[-1.25, 0.0, -0.75, 0.0], [0.0, 0.0, 0.0, -0.75]]


def test_negative_frequency_penalty_encourages_repeats():
    out = P.frequency_presence(torch.zeros(1, 3), [[1, 1, 1]], -0.5, 0.0)
    assert out[0].tolist() == [0.0, 1.5, 0.0]


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (3, [3]),  # trigrams 123, 231, 312; prefix (1, 2) -> 3
        (2, [3]),  # bigrams 12, 23, 31, 12; prefix (2,) -> 3
        (1, [1, 2, 3]),  # every seen token
        (6, []),  # context shorter than n
    ],
)
def test_no_repeat_ngram_bans_completions_of_seen_ngrams(n, expected):
    out = P.no_repeat_ngram(torch.zeros(1, 5), [[1, 2, 3, 1, 2]], n)
    assert banned(out) == [expected]


def test_no_repeat_ngram_counts_overlapping_ngrams():
    # "I am happy ... I am" (seed 004) bans "happy"; "5 5 5" bans a fourth 5
    assert banned(P.no_repeat_ngram(torch.zeros(2, 8), [[1, 2, 3, 4, 1, 2], [5, 5, 5]], 3)) == [
        [3],
        [5],
    ]


def test_bad_words_ban_last_token_when_prefix_ends_context():
    sequences = [(2,), (1, 3), (0, 1, 4)]
    out = P.bad_words(torch.zeros(3, 5), [[0, 1], [4, 1], [3]], sequences)
    assert banned(out) == [[2, 3, 4], [2, 3], [2]]


def test_bad_word_strings_are_tokenized_without_special_tokens(tokenizer):
    assert bad_word_sequences(["a b", "hello", (3, 4)], tokenizer) == [(1, 2), (6,), (3, 4)]
    with pytest.raises(TypeError, match="'hello'"):
        bad_word_sequences(["hello"], None)


def test_allowed_tokens_masks_all_others():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = P.allowed_tokens(logits, [1, 3])
    assert banned(out) == [[0, 2]]
    z = math.exp(2) + math.exp(4)
    assert torch.softmax(out, -1)[0, 1].item() == pytest.approx(math.exp(2) / z)


def test_logit_bias_adds_to_the_given_tokens():
    out = P.logit_bias(torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 2), {0: 1.5, 3: -100.0})
    assert out.tolist() == [[2.5, 2.0, 3.0, -96.0]] * 2


def test_min_tokens_masks_stop_tokens_until_enough_are_generated():
    out = P.min_tokens(torch.zeros(3, 5), [0, 1, 2], 2, (0, 3))
    assert banned(out) == [[0, 3], [0, 3], []]


# DRY (llama.cpp): penalty = multiplier * base ** (L - allowed_length)
MULT, BASE = 0.8, 1.75


def test_dry_match_lengths_follow_the_llama_cpp_example():
    # llama.cpp's comment: "a b c c b c y a b c" has repeat counts 0 0 3 1 0 2 0 0 0 (0)
    context = [1, 2, 3, 3, 2, 3, 4, 1, 2, 3]
    assert P.dry_match_lengths(context, 100).tolist() == [0, 0, 3, 1, 0, 2, 0, 0, 0]
    assert P.dry_match_lengths(context, 2).tolist() == [0, 0, 2, 1, 0, 2, 0, 0, 0]


@pytest.mark.parametrize(
    ("allowed", "expected"),
    [
        # c extends "a b c" (L=3), y extends "b c" (L=2), b extends "c" (L=1)
        (1, {3: MULT * BASE**2, 4: MULT * BASE, 2: MULT}),
        (2, {3: MULT * BASE, 4: MULT}),
        (3, {3: MULT}),
    ],
)
def test_dry_penalises_tokens_that_extend_a_repeat(allowed, expected):
    logits = torch.zeros(1, 6)
    out = P.dry(logits, [[1, 2, 3, 3, 2, 3, 4, 1, 2, 3]], MULT, BASE, allowed)
    assert out[0].tolist() == pytest.approx([-expected.get(t, 0.0) for t in range(6)])


def breakers(strings, texts):
    return P.DryBreakers.from_texts(strings, texts)


# token i of the hand-made vocabulary for DRY breakers is the character str(i)
DIGITS = [str(i) for i in range(10)]


def test_dry_repeat_stops_at_a_sequence_breaker():
    context = [1, 2, 3, 4, 7, 1, 2, 3]  # "1 2 3" repeats: token 4 would extend it (L = 3)
    out = P.dry(torch.zeros(1, 8), [context], MULT, BASE, 2)
    assert out[0, 4].item() == pytest.approx(-MULT * BASE)
    # with 1 a breaker the repeat can only reach back to "2 3" (L = 2)
    out = P.dry(torch.zeros(1, 8), [context], MULT, BASE, 2, breakers(["1"], DIGITS))
    assert out[0, 4].item() == pytest.approx(-MULT)
    # a two-token breaker "34" before the repeat does not shorten it ...
    out = P.dry(torch.zeros(1, 8), [context], MULT, BASE, 2, breakers(["34"], DIGITS))
    assert out[0, 4].item() == pytest.approx(-MULT * BASE)
    # ... but one that ends the context leaves no room for a repeat at all
    out = P.dry(torch.zeros(1, 8), [context], MULT, BASE, 2, breakers(["23"], DIGITS))
    assert out[0, 4].item() == 0.0


def test_dry_never_penalises_a_single_token_breaker():
    context = [5, 6, 7, 5, 6]  # "5 6" repeats; 7 would extend it
    assert P.dry(torch.zeros(1, 8), [context], MULT, BASE, 2)[0, 7].item() == pytest.approx(-MULT)
    out = P.dry(torch.zeros(1, 8), [context], MULT, BASE, 2, breakers(["7"], DIGITS))
    assert out[0, 7].item() == 0


# Breakers on text (llama.cpp): " ROM" + "EO:" holds "ROMEO:", "a\n" + "\nb" holds "\n\n".
TEXTS = [" x", " y", " z", " ROM", "EO:", "ROMEO", ":", "a\n", "\nb", "\n", " ROMEO:"]
X, Y, Z, ROM, EO_COLON, ROMEO, COLON, A_NL, NL_B, NL, ROMEO_COLON = range(len(TEXTS))


class HandTokenizer:
    """A tokenizer over TEXTS that encodes by greedy longest match: "ROMEO:" alone is
    ROMEO + ":" and "\n\n" alone is "\n" + "\n", unlike inside the contexts below."""

    def __len__(self):
        return len(TEXTS)

    def batch_decode(self, ids):
        return ["".join(TEXTS[i] for i in row) for row in ids]

    def encode(self, text, add_special_tokens=False):
        ids = []
        while text:
            i = max((i for i, t in enumerate(TEXTS) if text.startswith(t)), key=lambda i: len(TEXTS[i]))
            ids.append(i)
            text = text[len(TEXTS[i]) :]
        return ids


@pytest.mark.parametrize(
    ("breaker", "context", "expected"),
    [
        # Without breakers " ROM EO: x y" repeats (L = 4) and " z" would extend it: MULT * BASE**2.
        # "ROMEO:" split as " ROM" + "EO:" (alone it is "ROMEO" + ":") cuts it to " x y" (L = 2)
        ("ROMEO:", [ROM, EO_COLON, X, Y, Z, ROM, EO_COLON, X, Y], {Z: MULT}),
        # "\n\n" split as "a\n" + "\nb" (alone "\n" + "\n"): L = 4 cut to L = 2
        ("\n\n", [A_NL, NL_B, X, Y, Z, A_NL, NL_B, X, Y], {Z: MULT}),
        # ":" inside " ROMEO:" (a single-token breaker): L = 3 cut to L = 2
        (":", [ROMEO_COLON, X, Y, Z, ROMEO_COLON, X, Y], {Z: MULT}),
        # "EO: x" ends inside " x": only " y" is left for a repeat, too short to penalise
        ("EO: x", [ROM, EO_COLON, X, Y, Z, ROM, EO_COLON, X, Y], {}),
        # "ROMEO: z" is not in the text: nothing breaks the repeat
        ("ROMEO: z", [ROM, EO_COLON, X, Y, Z, ROM, EO_COLON, X, Y], {Z: MULT * BASE**2}),
        # " ROM" only starts "ROMEO:", so it is penalised like any token (L = 2) ...
        ("ROMEO:", [X, Y, ROM, Z, X, Y], {ROM: MULT}),
        # ... but a token that holds a whole breaker never is
        (" ROM", [X, Y, ROM, Z, X, Y], {}),
    ],
)
def test_dry_matches_breakers_on_text_across_token_boundaries(breaker, context, expected):
    logits = torch.zeros(1, len(TEXTS))
    params = SamplingParams(
        dry_multiplier=MULT, dry_base=BASE, dry_allowed_length=2, dry_sequence_breakers=(breaker,)
    )
    state = SamplerState(params, context, 1, len(TEXTS))
    out = build_chain(params, HandTokenizer())(logits, state)
    assert (-out[0]).tolist() == pytest.approx([expected.get(t, 0.0) for t in range(len(TEXTS))])


def test_dry_exponent_is_capped_so_the_penalty_stays_finite():
    # 60 repeats of one token: L = 59, exponent 58; capped at int(88.72 / ln 1000) = 12
    out = P.dry(torch.zeros(1, 3), [[1] * 60], 1.0, 1000.0, 1)
    assert out[0].tolist() == pytest.approx([0.0, -(1000.0**12), 0.0])


def test_dry_repeat_limit_finds_the_breaker_that_ends_last():
    digits = list(range(10)) * 2  # text "01234567890123456789", one character per token
    limit = lambda strings: P._dry_repeat_limit(digits, breakers(strings, DIGITS))  # noqa: E731
    assert limit(["5"]) == 4  # the last "5" is token 15
    assert limit(["99"]) == 20  # no breaker: the whole context
    # "3456789012345678" (tokens 3-18) starts before the last 16 tokens and ends after the
    # last "7" (token 17), so it is the one that bounds the repeat
    assert limit(["7", "3456789012345678"]) == 1


def test_dry_breakers_come_from_the_tokenizer(tokenizer):
    # ":" is inside tokens ":" (4) and "::" (5); "a b" is in no single token
    found = dry_breakers([":", "a b", ""], tokenizer)
    assert found.strings == (":", "a b")
    assert found.tokens == {4, 5}
    assert found.token_texts[:3] == ("<eos>", "a", "b")
    assert dry_breakers([":"], None) == P.DryBreakers()


@pytest.mark.parametrize(
    "adapter",
    [
        lambda x: P.repetition_penalty(x, [[0, 1]], 1.3),
        lambda x: P.frequency_presence(x, [[0, 1]], 0.5, 0.5),
        lambda x: P.no_repeat_ngram(x, [[0, 1, 0]], 2),
        lambda x: P.bad_words(x, [[0]], [(0, 1)]),
        lambda x: P.allowed_tokens(x, [0]),
        lambda x: P.logit_bias(x, {1: 1.0}),
        lambda x: P.min_tokens(x, [0], 1, [1]),
        lambda x: P.dry(x, [[0, 1, 2, 0, 1]], 1.0, 2.0, 2),
    ],
)
def test_penalties_leave_their_input_unchanged(adapter):
    logits = torch.tensor([[1.0, -2.0, 3.0]])
    out = adapter(logits)
    assert logits.tolist() == [[1.0, -2.0, 3.0]]
    assert not torch.equal(out, logits)
