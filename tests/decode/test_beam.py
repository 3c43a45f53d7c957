import itertools
import math

import pytest
import torch

import decodekit as dk
from decodekit.models.base import Cache, LanguageModel


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


def test_beam_refuses_stop_strings_naming_the_field(tiny_lm):
    """The one check of stop strings (decode/beam.py): the strategy raises before anything
    runs, naming the field, which the server answers as the 400's param."""
    from decodekit.decode.beam import Beam
    from decodekit.decode.sample import UnsupportedField

    with pytest.raises(UnsupportedField, match="stop strings are not supported") as refused:
        Beam(num_beams=2).prepare(tiny_lm, ["a"], dk.SamplingParams(stop=("x",)))
    assert refused.value.field == "stop"
    with pytest.raises(ValueError, match="takes no adapter"):
        Beam().prepare(tiny_lm, ["a"], adapter=lambda logits, state: logits)


class BigramLM(LanguageModel):
    """Next-token log-probs that depend on the last token only: a table small enough to
    work beam search out by hand."""

    name, tokenizer, max_context = "bigram", None, 64

    def __init__(self, table):
        self.logp = torch.tensor(table).log()  # [V, V]: row = last token
        self.vocab_size = self.logp.shape[0]
        self.eos_token_ids = (0,)

    def new_cache(self, batch_size):
        return NoCache()

    def forward(self, tokens, cache, mask=None):
        return self.logp[tokens]  # [B, T, V]


class NoCache(Cache):
    length = 0

    def fork(self, rows):
        return NoCache()

    def select(self, rows):
        pass

    def crop(self, length):
        pass


def test_only_the_top_num_beams_candidates_may_finish():
    # Tokens: 0 EOS, 1 a, 2 b, 3 the prompt. Two beams.
    lm = BigramLM([
        [1.0, 0.0, 0.0, 0.0],
        [0.4, 0.5, 0.1, 0.0],  # after a
        [0.5, 0.3, 0.2, 0.0],  # after b
        [0.0, 0.6, 0.4, 0.0],  # after the prompt
    ])
    # Step 1: beams a (.6), b (.4). Step 2 ranks the candidates a a (.30), a EOS (.24),
    # b EOS (.20), b a (.12): b EOS ranks third, outside the top two, so it may not finish
    # (Hugging Face, fairseq) although a live beam is still missing when it is reached.
    # Step 3: a a a (.15), a a EOS (.12) ranks second and finishes the second hypothesis.
    for alpha in (0.0, 1.0):
        out = dk.beam_search(lm, [[3]], dk.SamplingParams(max_new_tokens=8, n=2),
                             num_beams=2, length_penalty=alpha, early_stopping=True)[0]
        expected = sorted([(math.log(0.24) / 2**alpha, [1, 0]), (math.log(0.12) / 3**alpha, [1, 1, 0])],
                          reverse=True)  # alpha = 1: -0.7068 for a a EOS beats -0.7136 for a EOS
        assert [c.token_ids for c in out] == [ids for _, ids in expected]
        assert [c.score for c in out] == pytest.approx([s for s, _ in expected], abs=1e-6)


@pytest.fixture(scope="module")
def shakespeare_hf():
    """The shipped model through transformers, so decodekit and `generate` see the same logits."""
    from decodekit.models.registry import load_model

    return load_model("shakespeare", backend="hf")


def hf_beam_search(lm, prompt_ids, eos, num_beams, n, alpha, early_stopping, max_new_tokens):
    """transformers' beam search: generated ids (up to the first EOS) and sequences_scores."""
    out = lm.model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False, num_beams=num_beams, num_return_sequences=n, length_penalty=alpha,
        early_stopping=early_stopping, max_new_tokens=max_new_tokens, eos_token_id=eos,
        pad_token_id=lm.eos_token_ids[0], output_scores=True, return_dict_in_generate=True,
    )
    found = []
    for ids, score in zip(out.sequences[:, len(prompt_ids):].tolist(), out.sequences_scores.tolist()):
        found.append((ids[: ids.index(eos) + 1] if eos in ids else ids, score))  # cut the padding
    return found


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("early_stopping", [True, False])
def test_beam_search_equals_transformers(shakespeare_hf, alpha, early_stopping):
    # "\n" is the EOS on both sides: frequent enough that hypotheses finish at every step.
    # decodekit's early_stopping=False is the exact bound, transformers' "never" (its False
    # is a heuristic that may stop before a live beam could still win).
    lm = shakespeare_hf
    [eos] = lm.tokenizer.encode("\n", add_special_tokens=False)
    hf_stopping = True if early_stopping else "never"
    cases = [("the sun", 4, 4, 16), ("HAMLET:\nTo be", 4, 4, 16), ("KING:", 3, 2, 6)]
    for prompt, num_beams, n, max_new_tokens in cases:
        ids = lm.encode(prompt)
        expected = hf_beam_search(lm, ids, eos, num_beams, n, alpha, hf_stopping, max_new_tokens)
        params = dk.SamplingParams(max_new_tokens=max_new_tokens, n=n, stop_token_ids=(eos,),
                                   ignore_eos=True)
        out = dk.beam_search(lm, [ids], params, num_beams=num_beams, length_penalty=alpha,
                             early_stopping=early_stopping)[0]
        assert [c.token_ids for c in out] == [ids for ids, _ in expected], prompt
        assert [c.score for c in out] == pytest.approx([s for _, s in expected], abs=1e-4), prompt


# ---------------------------------------------------------------- beam search on the engine


@pytest.fixture(scope="module")
def toy_native(toy_lm):
    """toy_lm's weights run by NativeLM, so beam search takes the paged engine."""
    from decodekit.models.native import NativeLM

    hf = toy_lm.model
    model = NativeLM.from_state_dict(hf.config.to_dict(), dict(hf.state_dict()), name="toy-native",
                                     eos_token_ids=(0,))
    assert model.supports_paged_kv
    return model


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_wide_beam_on_the_engine_equals_exhaustive_search(toy_native, alpha):
    prompt = [3, 1]
    best = exhaustive(toy_native, prompt, 3, alpha)
    out = dk.beam_search(toy_native, [prompt], dk.SamplingParams(max_new_tokens=3, n=4),
                         num_beams=40, length_penalty=alpha, early_stopping=False)[0]
    assert [c.token_ids for c in out] == [seq for _, seq in best[:4]]
    for c, (score, _) in zip(out, best[:4]):
        assert c.score == pytest.approx(score, abs=1e-4)


def _plain(model, prompt, params, num_beams, alpha, early_stopping):
    from decodekit.decode.beam import BeamSearch, _beam_plain

    ids = model.encode(prompt)
    search = BeamSearch(model, ids, params, num_beams, alpha, early_stopping, None, model.decode)
    return _beam_plain(model, search)


@pytest.mark.parametrize("num_beams,alpha,early_stopping", [(1, 1.0, True), (3, 0.0, False),
                                                            (4, 1.0, True), (5, 2.0, False)])
def test_beam_on_the_engine_equals_the_search_over_a_dense_cache(tiny_lm, num_beams, alpha,
                                                                 early_stopping):
    params = dk.SamplingParams(max_new_tokens=24, n=min(3, num_beams), no_repeat_ngram_size=3)
    prompts = ["ROMEO:", "the sun", "O, what a"]
    engine = dk.beam_search(tiny_lm, prompts, params, num_beams=num_beams, length_penalty=alpha,
                            early_stopping=early_stopping)
    for prompt, got in zip(prompts, engine):
        want = _plain(tiny_lm, prompt, params, num_beams, alpha, early_stopping)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.score for c in got] == pytest.approx([c.score for c in want], abs=1e-4)
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]


def test_concurrent_beam_searches_share_the_engine_steps(tiny_lm):
    """Eight searches submitted together run in one forward per step (not eight), beside a
    sampling request, and each equals its search alone; their blocks all return."""
    from decodekit.decode.beam import BeamProgram, BeamSearch
    from decodekit.engine import Engine, EngineConfig

    params = dk.SamplingParams(max_new_tokens=16, n=2, ignore_eos=True)
    prompts = [f"{word} and" for word in ("love", "death", "king", "queen", "night", "day", "war", "peace")]
    alone = [_plain(tiny_lm, p, params, 4, 1.0, True) for p in prompts]
    engine = Engine(tiny_lm, EngineConfig(num_blocks=512))
    handles = [engine.add(BeamProgram(tiny_lm, BeamSearch(
        tiny_lm, tiny_lm.encode(p), params, 4, 1.0, True, None, tiny_lm.decode), i))
        for i, p in enumerate(prompts)]
    sampling = engine.submit("ROMEO:", dk.SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert engine.steps <= 17  # one forward per step for everything: 1 prefill + 16 tokens
    for handle, want in zip(handles, alone):
        got = handle.result()
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
    [greedy] = dk.generate(tiny_lm, "ROMEO:", dk.SamplingParams(max_new_tokens=16, temperature=0,
                                                                ignore_eos=True))
    assert sampling.result()[0].token_ids == greedy.token_ids
    assert engine.pool.num_used == 0 and not engine.scheduler.running
    assert len(engine.running_kv) == 0


def test_a_cancelled_beam_search_frees_its_blocks(tiny_lm):
    from decodekit.decode.beam import BeamProgram, BeamSearch
    from decodekit.engine import Engine, EngineConfig

    params = dk.SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine = Engine(tiny_lm, EngineConfig(num_blocks=64))
    search = BeamSearch(tiny_lm, tiny_lm.encode("ROMEO:"), params, 4, 1.0, True, None, tiny_lm.decode)
    handle = engine.add(BeamProgram(tiny_lm, search))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_used > 0
    handle.cancel()
    engine.step()
    [best] = handle.result()
    assert best.finish_reason == "cancelled" and 5 <= len(best.token_ids) < 40
    assert engine.pool.num_used == 0 and len(engine.running_kv) == 0


def test_trace_records_each_step_and_changes_nothing(tiny_lm):
    from decodekit.decode.beam import BeamSearch, _beam_plain

    params = dk.SamplingParams(max_new_tokens=8, n=2)
    ids = tiny_lm.encode("ROMEO:")
    search = BeamSearch(tiny_lm, ids, params, 3, 1.0, True, None, tiny_lm.decode)
    search.trace = []
    traced = _beam_plain(tiny_lm, search)
    plain = _plain(tiny_lm, "ROMEO:", params, 3, 1.0, True)
    assert [c.token_ids for c in traced] == [c.token_ids for c in plain]
    assert len(search.trace) == search.steps
    live = 1  # beams before the first step: the prompt
    for candidates in search.trace:
        assert all(0 <= parent < live for parent, *_ in candidates)
        totals = [total for *_, total, _ in candidates]
        assert totals == sorted(totals, reverse=True)  # ranked best first
        live = sum(fate == "live" for *_, fate in candidates)
        assert live <= 3 and {fate for *_, fate in candidates} <= {"live", "finished", "dropped", "pruned"}
