import pytest
import torch

import decodekit as dk
from decodekit.models.base import prefill


def test_greedy_equals_argmax_of_full_forward(tiny_lm):
    prompt = tiny_lm.encode("ROMEO: But")
    [c] = dk.generate(tiny_lm, [prompt], dk.SamplingParams(temperature=0, max_new_tokens=12,
                                                           ignore_eos=True))[0]
    ids = list(prompt)
    for _ in range(12):
        logits = tiny_lm.forward(torch.tensor([ids]), tiny_lm.new_cache(1))[0, -1]
        ids.append(int(logits.argmax()))
    assert c.token_ids == ids[len(prompt):]
    assert c.finish_reason == "length"
    assert len(c.logprobs) == len(c.processed_logprobs) == 12
    assert all(lp == 0.0 for lp in c.processed_logprobs)  # greedy: one-hot processed distribution


def test_same_seed_same_output_and_different_seeds_differ(tiny_lm):
    params = dk.SamplingParams(max_new_tokens=20, seed=7, n=3)
    a = dk.generate(tiny_lm, "JULIET:", params)
    b = dk.generate(tiny_lm, "JULIET:", params)
    c = dk.generate(tiny_lm, "JULIET:", params.replace(seed=8))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert len({tuple(x.token_ids) for x in a}) > 1  # the n samples differ


def test_seeded_sample_is_batch_invariant(tiny_lm):
    params = dk.SamplingParams(max_new_tokens=16, seed=3, top_k=50)
    [alone] = dk.generate(tiny_lm, "the sun", params)
    others = dk.SamplingParams(max_new_tokens=5, seed=11)
    batch = dk.generate(tiny_lm, ["JULIET: O Romeo, Romeo", "the sun", "x"], [others, params, others])
    assert batch[1][0].token_ids == alone.token_ids


def test_raw_and_processed_logprobs(tiny_lm):
    params = dk.SamplingParams(max_new_tokens=6, seed=1, top_k=3, logprobs=2, ignore_eos=True)
    [c] = dk.generate(tiny_lm, "ROMEO:", params)
    prompt = tiny_lm.encode("ROMEO:")
    logits, cache = prefill(tiny_lm, [prompt])
    raw = torch.log_softmax(logits[0], -1)
    top3 = logits[0].topk(3)
    processed = torch.log_softmax(top3.values, -1)
    first = c.token_ids[0]
    assert c.logprobs[0] == pytest.approx(float(raw[first]), abs=1e-5)
    assert c.processed_logprobs[0] == pytest.approx(
        float(processed[top3.indices.tolist().index(first)]), abs=1e-5)
    assert set(c.top_logprobs[0]) == set(raw.topk(2).indices.tolist())


def test_stream_concatenates_to_generate_text(tiny_lm):
    params = dk.SamplingParams(max_new_tokens=30, seed=5, stop=("e s",))
    [c] = dk.generate(tiny_lm, "ROMEO:", params)
    pieces = list(dk.stream(tiny_lm, "ROMEO:", params))
    assert "".join(pieces) == c.text
    assert len(pieces) > 1


@pytest.mark.parametrize("heal", [False, True])  # healing decodes whole, not incrementally
def test_stream_events_carry_the_tokens_of_their_text(tiny_lm, heal):
    from decodekit.decode.sample import stream_events

    params = dk.SamplingParams(max_new_tokens=30, seed=5, stop=("e s",), logprobs=2, n=2)
    deltas = list(stream_events(tiny_lm, ["ROMEO:"], params, heal=heal))
    for sample in range(2):
        mine = [d for d in deltas if d.sample_index == sample]
        [c] = [d.completion for d in mine if d.completion is not None]
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert [x for d in mine for x in d.logprobs] == c.logprobs
        assert [x for d in mine for x in d.top_logprobs] == c.top_logprobs
        text, sent = "", 0
        for d in mine[:-1]:  # a delta's tokens have all their text out by its end
            text, sent = text + d.text, sent + len(d.token_ids)
            # (healed ids re-spell the prompt's last token, which is not in the text)
            assert heal or text.startswith(tiny_lm.decode(c.token_ids[:sent]))
        assert sum(bool(d.token_ids) for d in mine) > 1


def test_stop_string_split_across_tokens(tiny_lm):
    base = dk.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    [full] = dk.generate(tiny_lm, "JULIET:", base)
    pieces = [tiny_lm.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # a boundary after token j where both sides have text: the stop string spans it
    j = next(j for j in range(3, len(pieces) - 1)
             if len(pieces[j]) > len(pieces[j - 1]) and len(pieces[j + 1]) > len(pieces[j]))
    stop = pieces[j][-1] + pieces[j + 1][len(pieces[j])]
    [cut] = dk.generate(tiny_lm, "JULIET:", base.replace(stop=(stop,)))
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert "".join(dk.stream(tiny_lm, "JULIET:", base.replace(stop=(stop,)))) == cut.text


def test_eos_and_stop_token_finish(tiny_lm):
    base = dk.SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    [full] = dk.generate(tiny_lm, "the", base)
    token = full.token_ids[4]
    [c] = dk.generate(tiny_lm, "the", base.replace(stop_token_ids=(token,)))
    assert c.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == token


def test_prompt_longer_than_context_is_rejected(tiny_lm):
    long_prompt = list(range(5, 5 + tiny_lm.max_context))
    with pytest.raises(ValueError, match="context is 96"):
        dk.generate(tiny_lm, [long_prompt])


def test_generation_stops_at_context_end(tiny_lm):
    prompt = [5] * (tiny_lm.max_context - 4)
    [[c]] = dk.generate(tiny_lm, [prompt], dk.SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert len(c.token_ids) == 4 and c.finish_reason == "length"


def test_bad_token_ids_are_rejected(tiny_lm):
    with pytest.raises(ValueError, match="outside"):
        dk.generate(tiny_lm, [[10**6]])
    with pytest.raises(ValueError, match=r"logit_bias must hold token ids in the vocabulary \[0, \d+\)"):
        dk.generate(tiny_lm, "a", dk.SamplingParams(logit_bias={10**6: 1.0}))


def test_a_callers_adapter_runs_first_in_the_chain(tiny_lm):
    """`adapter=` changes the logits before the params' adapters: a greedy request takes
    the token the adapter boosts, every step, and its processed logprobs say so."""

    def boost(logits, state):  # [R, V]; the state holds each row's tokens so far
        assert [len(g) for g in state.generated] == [len(state.generated[0])] * len(logits)
        return logits.clone().index_fill_(-1, torch.tensor([7]), 1e4)

    greedy = dk.SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    [c] = dk.generate(tiny_lm, "the", greedy, adapter=boost)
    assert c.token_ids == [7, 7, 7] and c.processed_logprobs == pytest.approx([0.0] * 3, abs=1e-6)
    assert dk.generate(tiny_lm, "the", greedy)[0].token_ids != [7, 7, 7]
    with pytest.raises(TypeError, match="^adapter must be a callable"):
        dk.generate(tiny_lm, "the", greedy, adapter="tilt")


def test_incremental_detokenising_equals_decoding_everything(tiny_lm):
    import random

    from decodekit.text import TextTracker

    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tiny_lm.vocab_size) for _ in range(rng.randrange(1, 40))]
        tracker = TextTracker(tiny_lm.decode)
        for token in ids:
            tracker.push(token)
        assert tracker.text == tiny_lm.decode(ids)
