"""The chain built from SamplingParams, the request's SamplerState, and parameter errors."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.params import DEFAULT_ORDER, SamplingParams
from decodekit.sampling import SamplerState, build_chain, select_tokens

PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])  # [1, 5]


def run(params, logits=LOGITS, prompt=(1,), rows=1, eos=(0,)):
    state = SamplerState(params, prompt, rows, logits.shape[-1], eos)
    return build_chain(params)(logits.repeat(rows, 1), state), state


def dist(logits):
    return torch.softmax(logits.double(), dim=-1).tolist()


def test_default_params_leave_the_distribution_unchanged():
    out, _ = run(SamplingParams())
    assert torch.equal(out, LOGITS) and out.data_ptr() != LOGITS.data_ptr()


def test_order_decides_whether_temperature_acts_before_top_p():
    # temperature 0.5 squares and renormalises p: [0.16, 0.09, ...] / 0.285 = [0.561, ...]
    first = SamplingParams(temperature=0.5, top_p=0.5)
    (row,) = dist(run(first)[0])
    assert row == pytest.approx([1, 0, 0, 0, 0])  # 0.561 >= 0.5: only the top survives
    order = list(DEFAULT_ORDER)
    order.remove("temperature")
    order.insert(order.index("top_p") + 1, "temperature")  # llama.cpp's "temperature last"
    (row,) = dist(run(first.replace(order=tuple(order)))[0])
    # top-p first keeps {0.4, 0.3} (0.4 < 0.5); temperature 0.5 then gives 0.16 : 0.09
    assert row == pytest.approx([0.64, 0.36, 0, 0, 0])


def test_adapters_missing_from_order_are_not_applied():
    params = SamplingParams(top_k=1, order=tuple(n for n in DEFAULT_ORDER if n != "top_k"))
    out, _ = run(params)
    assert torch.equal(out, LOGITS)


def test_chain_combines_penalties_and_truncation():
    # prompt holds token 0 with logit log 0.4: penalty 2 doubles its (negative) logit
    params = SamplingParams(repetition_penalty=2.0, top_k=2)
    out, _ = run(params, prompt=(0,))
    p = [0.4**2, 0.3]  # exp(2 log 0.4) = 0.16
    assert dist(out)[0] == pytest.approx([p[0] / sum(p), p[1] / sum(p), 0, 0, 0])


def test_temperature_zero_selects_the_argmax_from_a_one_hot_distribution():
    params = SamplingParams(temperature=0.0, seed=3)
    out, state = run(params, logits=torch.tensor([[0.1, 2.0, -1.0, 2.0]]))
    assert dist(out) == [[0.0, 1.0, 0.0, 0.0]]
    assert select_tokens(out, state).tolist() == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_enough_are_generated():
    params = SamplingParams(min_new_tokens=2, stop_token_ids=(3,))
    state = SamplerState(params, [1], 1, 5, eos_token_ids=[0])
    chain = build_chain(params)
    masked = []
    for token in (2, 2, 2):
        out = chain(LOGITS, state)
        masked.append(torch.isneginf(out[0]).nonzero().flatten().tolist())
        state.accept(torch.tensor([token]), out)
    assert masked == [[0, 3], [0, 3], []]
    ignoring = SamplingParams(min_new_tokens=1, stop_token_ids=(3,), ignore_eos=True)
    assert SamplerState(ignoring, [1], 1, 5, [0]).stop_token_ids == (3,)


def test_penalties_see_prompt_and_accepted_tokens():
    params = SamplingParams(no_repeat_ngram_size=3, frequency_penalty=1.0)
    state = SamplerState(params, [1, 2, 3], 2, 5)
    chain = build_chain(params)
    state.accept(torch.tensor([1, 4]), LOGITS.repeat(2, 1))
    state.accept(torch.tensor([2, 4]), LOGITS.repeat(2, 1))
    assert state.generated == [[1, 2], [4, 4]]
    out = chain(torch.zeros(2, 5), state)
    # row 0: context 1 2 3 1 2 -> trigram (1, 2, 3) is banned; generated 1, 2 once each
    # row 1: context 1 2 3 4 4 -> no trigram starts with (4, 4); token 4 generated twice
    assert out.tolist() == [[0.0, -1.0, -1.0, -math.inf, 0.0], [0.0, 0.0, 0.0, 0.0, -2.0]]


def test_mirostat_mu_starts_at_two_tau_and_follows_the_chosen_surprise():
    params = SamplingParams(mirostat_tau=3.0, mirostat_eta=0.1, seed=0)
    state = SamplerState(params, [1], 1, 5)
    chain = build_chain(params)
    assert state.mu.tolist() == [6.0]
    out = chain(LOGITS, state)  # mu = 6 > every surprise (max 4.32 bits): nothing removed
    assert dist(out)[0] == pytest.approx(PROBS)
    state.accept(torch.tensor([2]), out)
    surprise = -math.log2(0.15)  # 2.737 bits
    mu = 6.0 - 0.1 * (surprise - 3.0)
    assert state.mu.item() == pytest.approx(mu)
    # force mu under the surprise of token 2 (2.74) but above token 1's (1.74)
    state.mu = torch.tensor([2.0], dtype=torch.float64)
    out = chain(LOGITS, state)
    assert dist(out)[0] == pytest.approx([4 / 7, 3 / 7, 0, 0, 0])
    state.accept(torch.tensor([1]), out)
    assert state.mu.item() == pytest.approx(2.0 - 0.1 * (-math.log2(3 / 7) - 3.0))


def test_select_rows_copies_histories_and_mu():
    params = SamplingParams(mirostat_tau=2.0)
    state = SamplerState(params, [1], 3, 5)
    state.mu = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    state.accept(torch.tensor([0, 1, 2]), LOGITS.repeat(3, 1))
    mu_after = state.mu.tolist()
    state.select_rows([2, 2, 0])
    assert state.generated == [[2], [2], [0]]
    assert state.mu.tolist() == [mu_after[2], mu_after[2], mu_after[0]]
    state.generated[0].append(4)  # rows are copies, not aliases
    assert state.generated[1] == [2]


def test_dry_in_the_chain_uses_tokenizer_breakers():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, ":": 3}, unk_token="a"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner)
    params = SamplingParams(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)

    def penalties(prompt, tok):
        state = SamplerState(params, prompt, 1, 4)
        return (-build_chain(params, tok)(torch.zeros(1, 4), state)).tolist()

    # "a b c : a b": "a b" repeats and c would extend it; ":" lies before the repeat
    assert penalties([0, 1, 2, 3, 0, 1], None) == [[0.0, 0.0, 1.0, 0.0]]
    assert penalties([0, 1, 2, 3, 0, 1], tokenizer) == [[0.0, 0.0, 1.0, 0.0]]
    # "a : b c a : b": "a : b" repeats (L = 3, penalty 2^1) unless ":" breaks it
    assert penalties([0, 3, 1, 2, 0, 3, 1], None) == [[0.0, 0.0, 2.0, 0.0]]
    assert penalties([0, 3, 1, 2, 0, 3, 1], tokenizer) == [[0.0, 0.0, 0.0, 0.0]]


def test_token_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError, match=r"\[7\]"):
        SamplerState(SamplingParams(logit_bias={7: 1.0}), [1], 1, 5)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("temperature", -0.5, r"temperature must be in \[0, inf\], got -0.5"),
        ("top_k", -2, r"top_k must be an integer >= -1, got -2"),
        ("min_p", 2.0, r"min_p .* got 2.0"),
        ("repetition_penalty", 0.0, r"repetition_penalty .* got 0.0"),
    ],
)
def test_bad_params_are_rejected_with_the_value(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**{field: value})


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


@pytest.mark.parametrize(("field", "value"), [("order", {}), ("bad_words", {}), ("stop_token_ids", 5),
                                              ("ignore_eos", "x"), ("dry_sequence_breakers", [5]),
                                              ("allowed_token_ids", {1: 2}), ("order", [3])])
def test_wrong_types_are_type_errors_naming_the_field(field, value):
    with pytest.raises((TypeError, ValueError), match=field):
        SamplingParams(**{field: value})


def _zipf_logits(rows, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]) + 1
    return -1.3 * ranks.double().log().float() + 0.5 * torch.randn(rows, vocab, generator=generator)


def _chain_and_one_by_one(params, rows):
    """The chain's output for rows [R, V], and the adapters' run one by one over the whole
    vocabulary (chain_stages), each from a fresh state."""
    from decodekit.sampling.chain import chain_stages

    out = build_chain(params)(rows, SamplerState(params, (1,), rows.shape[0], rows.shape[-1]))
    state = SamplerState(params, (1,), rows.shape[0], rows.shape[-1])
    want = rows
    for _, adapter in chain_stages(params):
        want = adapter(want, state)
    return out, want


def _draws_equal_the_whole_rows(out, seeds=5):
    """Draws from a chain's output (among its kept tokens where it carries them) equal the
    whole-vocabulary draw's for the same seeds."""
    from decodekit.sampling.select import draw_logits_rows, draw_rows

    rows = out.shape[0]
    whole = torch.softmax(out.double(), dim=-1)
    return all(torch.equal(draw_logits_rows(out, [(torch.Generator().manual_seed(seed), rows)]),
                           draw_rows(whole, [(torch.Generator().manual_seed(seed), rows)]))
               for seed in range(seeds))  # fmt: skip


def _kept_logprobs_equal_the_whole_rows(out):
    """The chosen tokens' processed logprobs from a compacted output's kept tokens
    (select.py `chosen_logprobs`) equal the whole rows' log-softmax at them, for every kept token."""
    from decodekit.sampling.select import chosen_logprobs

    values, ids = out.kept
    whole = torch.log_softmax(out.clone(), dim=-1)  # a clone carries no kept tokens: the whole rows
    for place in range(ids.shape[1]):
        index = ids[:, place : place + 1]
        finite = values[:, place].isfinite()
        assert torch.allclose(chosen_logprobs(out, index)[finite], whole.gather(-1, index)[finite, 0],
                              rtol=0, atol=2e-6)  # fmt: skip


@pytest.mark.parametrize("fields", [
    {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8,
     "order": ("top_k", "top_p", "min_p", "temperature")},  # llama.cpp's defaults
    {"top_k": 50, "typical_p": 0.9, "epsilon": 1e-3},
    {"top_k": 5, "min_tokens_to_keep": 9, "top_p": 0.5, "eta": 1e-3},  # min_keep past k
    {"top_k": 30, "temperature": 0.0, "order": ("top_k", "temperature")},  # greedy among them
])  # fmt: skip
def test_a_chain_after_a_top_k_runs_on_its_kept_tokens_with_the_same_result(fields):
    """At a large vocabulary on the CPU a chain goes on from a top-k with its kept tokens
    alone (chain.py `_compaction`, processors.py `top_k_kept`): the processed logits equal
    the adapters run one by one over the whole vocabulary, on Zipf rows, rows tied at the
    k-th within and past TIES_LOOKED_AT places (the second falls back to the whole row), a
    row with fewer finite logits than it keeps, and rows tied at the maximum; the output
    carries the kept tokens for the draw only when every row could be compacted."""
    from decodekit.sampling import processors as P

    params = SamplingParams(seed=0, **fields)
    logits = _zipf_logits(4, 151_936, 0)
    logits[1, :12] = logits[1].max() + 1.0  # 12 tied at the top
    tied_past = _zipf_logits(1, 151_936, 1)
    order = tied_past[0].argsort(descending=True)
    tied_past[0, order[:200]] = 5.0  # 200 tied at the top: past the window for any k < 184
    few = torch.full((1, 151_936), P.NEG_INF)
    few[0, :3] = torch.tensor([1.0, 3.0, 2.0])
    for rows, compacts in ((logits, True), (torch.cat([logits, tied_past]), False), (few, False)):
        out, want = _chain_and_one_by_one(params, rows)
        assert torch.equal(out, want)
        assert hasattr(out, "kept") == compacts
        if compacts:  # the kept tokens are the output's finite ones, with their values
            values, ids = out.kept
            assert torch.equal(P.expand_kept(rows, values, ids), out)
            _kept_logprobs_equal_the_whole_rows(out)


def test_a_top_k_followed_by_an_adapter_that_reads_token_ids_is_not_compacted():
    """logit_bias after top_k reads token ids (not index-free): the chain runs over the
    whole vocabulary (its output carries no kept tokens), and equals the adapters run one
    by one."""
    params = SamplingParams(top_k=20, logit_bias={7: 30.0}, order=("top_k", "logit_bias"))
    out, want = _chain_and_one_by_one(params, _zipf_logits(2, 151_936, 2))
    assert torch.equal(out, want) and not hasattr(out, "kept")


def test_draws_among_a_top_ks_kept_tokens_follow_the_distribution_and_the_whole_rows_tokens(monkeypatch):
    """The draw from a compacted chain's output (select.py `draw_logits_rows` with `kept`)
    follows softmax over the kept tokens (hand-computed: top-3 of a 40-token distribution,
    renormalised), and gives the tokens the whole-vocabulary draw gives for the same seeds at
    151,936 tokens."""
    from decodekit.sampling import chain as chain_module
    from decodekit.sampling.select import draw_logits_rows

    probs = [0.3, 0.2, 0.1] + [0.4 / 37] * 37
    logits = torch.tensor([[math.log(p) for p in probs]]).repeat(20_000, 1)
    monkeypatch.setattr(chain_module, "COMPACT_MIN_VOCAB", 0)
    params = SamplingParams(top_k=3)
    out = build_chain(params)(logits, SamplerState(params, (1,), 20_000, 40))
    assert hasattr(out, "kept")
    tokens = draw_logits_rows(out, [(torch.Generator().manual_seed(0), 20_000)])
    counts = torch.bincount(tokens, minlength=40).tolist()
    assert sum(counts[3:]) == 0
    for count, p in zip(counts[:3], [0.5, 1 / 3, 1 / 6]):  # within 4.5 standard errors
        assert abs(count / 20_000 - p) < 4.5 * math.sqrt(p * (1 - p) / 20_000), (counts[:3], p)
    monkeypatch.undo()

    params = SamplingParams(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8,
                            order=("top_k", "top_p", "min_p", "temperature"))  # fmt: skip
    rows = _zipf_logits(16, 151_936, 3)
    out = build_chain(params)(rows, SamplerState(params, (1,), 16, rows.shape[-1]))
    assert hasattr(out, "kept")
    assert _draws_equal_the_whole_rows(out)


def test_a_chain_after_a_top_p_runs_on_its_kept_tokens_where_rows_are_peaked():
    """A top-p keeps the tokens of its partial sort where every row is peaked (processors.py
    `top_p_kept`): the chain goes on with those, its output equal to the adapters run one by
    one and its draws to the whole row's for the same seeds; a flat row in the batch (its
    first 1,024 tokens short of p) sends the whole batch over the vocabulary, with the same
    result. Ties at the cut are kept together."""
    params = SamplingParams(top_p=0.8, temperature=0.7, min_p=0.02, order=("top_p", "temperature", "min_p"))
    peaked = _zipf_logits(6, 151_936, 4) * 1.3
    peaked[2, :30] = peaked[2].max() + 0.5  # 30 tied at the top, holding more than p
    flat = torch.randn(1, 151_936, generator=torch.Generator().manual_seed(5)) * 0.1
    for rows, compacts in ((torch.cat([peaked, flat]), False), (peaked, True)):
        out, want = _chain_and_one_by_one(params, rows)
        assert torch.equal(out, want) and hasattr(out, "kept") == compacts
    assert bool(torch.isfinite(want[2, :30]).all())  # the tied tokens, all kept
    assert _draws_equal_the_whole_rows(out)  # the peaked rows' compacted output
    _kept_logprobs_equal_the_whole_rows(out)


def test_a_chain_after_a_min_p_runs_on_its_kept_tokens_where_few_can_pass():
    """A min-p's kept tokens are a row's largest logits, as many as pass, so where no row keeps
    more than 256 its chain goes on with the `topk_rows` of that many (processors.py
    `min_p_kept`): the output equals the adapters run one by one, with ties at the maximum,
    tokens exactly at the threshold and a row keeping 101 tokens, and draws and processed
    logprobs equal the whole row's; a row where too many pass (a flat one) sends the batch over
    the whole vocabulary, with the same output. Fails when fewer tokens than pass are searched."""
    params = SamplingParams(min_p=0.1, temperature=0.8, top_p=0.9, order=("min_p", "temperature", "top_p"))
    peaked = _zipf_logits(5, 151_936, 6) * 1.5
    top = peaked[3].max()
    peaked[3, :4] = top  # four at the maximum
    peaked[3, 10:13] = top + math.log(0.1)  # three exactly at a tenth of it (in float32)
    peaked[4] = -40.0  # a row keeping near 1 / t tokens, the bound min-p's search relies on:
    peaked[4, 0], peaked[4, 100:300:2] = 0.0, math.log(0.1) + 1e-3  # one, and 100 just above a tenth
    flat = torch.randn(1, 151_936, generator=torch.Generator().manual_seed(7)) * 0.1
    for rows, compacts in ((torch.cat([peaked, flat]), False), (peaked, True)):
        out, want = _chain_and_one_by_one(params, rows)
        assert torch.equal(out, want) and hasattr(out, "kept") == compacts
    assert _draws_equal_the_whole_rows(out)  # the peaked rows' compacted output
    _kept_logprobs_equal_the_whole_rows(out)
