"""Selectors: categorical draws match the processed distribution, seeds reproduce, and a
request's draws belong to its own generator."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.params import SamplingParams
from decodekit.sampling import (
    SamplerState,
    build_chain,
    draw,
    logprobs_of,
    sample_categorical,
    select_tokens,
    top_logprobs,
)

PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])  # [1, 5]


def chi_square(counts, expected_probs):
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, expected_probs))


def draw_counts(params, rows):
    """`rows` parallel samples of one step through the chain: counts per token."""
    state = SamplerState(params, [1], rows, 5)
    processed = build_chain(params)(LOGITS.repeat(rows, 1), state)
    tokens = select_tokens(processed, state)
    return torch.bincount(tokens, minlength=5).tolist()


def test_draws_follow_the_raw_distribution():
    counts = draw_counts(SamplingParams(seed=1234), 20_000)
    # 5 categories: df = 4, critical value at alpha = 0.001 is 18.47
    assert chi_square(counts, PROBS) < 18.47
    # the test can fail: the same counts are far from a uniform distribution
    assert chi_square(counts, [0.2] * 5) > 18.47


def test_draws_follow_the_processed_distribution():
    # temperature 0.5 then top-k 4: p^2 over the four most likely, [0.16, 0.09, 0.0225, 0.01]
    counts = draw_counts(SamplingParams(seed=99, temperature=0.5, top_k=4), 20_000)
    squared = [p * p for p in PROBS[:4]]
    expected = [q / sum(squared) for q in squared]
    assert counts[4] == 0  # a removed token is never drawn
    # 4 categories: df = 3, critical value at alpha = 0.001 is 16.27
    assert chi_square(counts[:4], expected) < 16.27
    assert chi_square(counts[:4], [p / 0.95 for p in PROBS[:4]]) > 16.27  # not the raw p


def test_tokens_of_zero_probability_are_never_drawn():
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, 0.0, -math.inf]]).repeat(5000, 1)
    tokens = sample_categorical(logits, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 3}


def test_draw_inverts_the_cdf_one_uniform_per_row():
    """u = 0.55 of the (unnormalised) weights [2, 1, 1] falls in the second bucket
    (cdf / total = 0.5, 0.75, 1); a [V] row gives a 0-d index; sample_categorical is
    draw over softmax(logits), consuming the generator the same way."""
    u = float(torch.rand(1, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    expected = 0 if u < 0.5 else 1 if u < 0.75 else 2
    token = draw(torch.tensor([2.0, 1.0, 1.0]), torch.Generator().manual_seed(7))
    assert token.shape == () and int(token) == expected
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    seeded = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(sample_categorical(logits, seeded[0]), draw(logits.double().softmax(-1), seeded[1]))


def run_request(params, steps, rows=1):
    state = SamplerState(params, [1], rows, 5)
    chain = build_chain(params)
    for _ in range(steps):
        processed = chain(LOGITS.repeat(rows, 1), state)
        state.accept(select_tokens(processed, state), processed)
    return state.generated


def test_same_seed_gives_same_draws_and_another_seed_differs():
    params = SamplingParams(seed=7, xtc_probability=0.5, xtc_threshold=0.12)
    first = run_request(params, 30)
    assert run_request(params, 30) == first
    assert run_request(params.replace(seed=8), 30) != first


def test_a_requests_draws_do_not_depend_on_other_requests():
    a = SamplingParams(seed=5)
    alone = run_request(a, 20)
    # interleave request a with a request b of other rows, seed and adapters
    b = SamplingParams(seed=6, top_k=3, xtc_probability=1.0)
    states = [SamplerState(a, [1], 1, 5), SamplerState(b, [2, 3], 4, 5)]
    chains = [build_chain(a), build_chain(b)]
    for _ in range(20):
        for state, chain in zip(reversed(states), reversed(chains)):  # b goes first
            processed = chain(LOGITS.repeat(state.num_rows, 1), state)
            state.accept(select_tokens(processed, state), processed)
    assert states[0].generated == alone


def test_unseeded_requests_get_fresh_seeds():
    seeds = {SamplerState(SamplingParams(), [1], 1, 5).seed for _ in range(4)}
    assert len(seeds) == 4


def test_greedy_selection_is_argmax_without_randomness():
    state = SamplerState(SamplingParams(temperature=0.0), [1], 2, 3)
    before = state.generator.get_state()
    tokens = select_tokens(torch.tensor([[0.0, 2.0, 1.0], [5.0, 1.0, 5.0]]), state)
    assert tokens.tolist() == [1, 0]
    assert torch.equal(state.generator.get_state(), before)


def test_logprob_helpers():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    assert logprobs_of(logits, torch.tensor([1, 0])).tolist() == pytest.approx(
        [math.log(0.75), math.log(0.5)]
    )
    top = top_logprobs(LOGITS, 2)
    assert list(top[0]) == [0, 1]
    assert list(top[0].values()) == pytest.approx([math.log(0.4), math.log(0.3)])


def test_scratch_draws_follow_the_distribution_and_equal_the_plain_ones(monkeypatch):
    """Rows of logits drawn in the thread's scratch buffers (select.py `draw_logits_rows`)
    follow softmax(logits): on the hand-computed five-token distribution with the size bound
    at 0, and token for token the plain path's (softmax, then the running sums) for the same
    uniforms at Qwen2.5's vocabulary, where rows take the buffers by size; the chosen tokens'
    logprobs are the whole rows' log-softmax's, bit for bit from the scratch log-softmax, and
    within float32's rounding from the row_logsumexp kernel where it is built."""
    from decodekit import scratch
    from decodekit.sampling import select

    rows = 20_000
    monkeypatch.setattr(scratch, "MIN_BYTES", 0)
    generator = torch.Generator().manual_seed(0)
    tokens = select.draw_logits_rows(LOGITS.repeat(rows, 1), [(generator, rows)])
    assert chi_square(torch.bincount(tokens, minlength=5).tolist(), PROBS) < 18.47  # p = 0.001, 4 dof
    monkeypatch.undo()

    logits = torch.randn(16, 151_936, generator=torch.Generator().manual_seed(1)) * 4  # 9.7 MB
    assert scratch.worth_scratch(logits, torch.float64) and scratch.worth_scratch(logits, torch.float32)
    index = None
    for seed in range(5):
        ours = select.draw_logits_rows(logits, [(torch.Generator().manual_seed(seed), 16)])
        probs = torch.softmax(logits.double(), dim=-1)
        plain = select.draw_rows(probs, [(torch.Generator().manual_seed(seed), 16)])
        assert torch.equal(ours, plain)
        index = ours[:, None]
    whole = torch.log_softmax(logits, dim=-1).gather(-1, index)[:, 0]
    assert torch.equal(select.scratch_log_softmax(logits).gather(-1, index)[:, 0], whole)
    assert torch.allclose(select.chosen_logprobs(logits, index), whole, rtol=0, atol=3e-5)
    monkeypatch.setattr(select, "fused_normaliser", lambda logits: False)
    assert torch.equal(select.chosen_logprobs(logits, index), whole)


def test_the_logsumexp_kernel_matches_float64():
    """decodekit's row_logsumexp (models/csrc/logsumexp.cpp), the normaliser of the chosen
    tokens' raw logprobs at a real vocabulary: within float32's rounding of the exact value
    (float64) on rows of every length past and below a whole vector, with -inf entries, an
    all -inf row and a row whose other entries underflow."""
    from decodekit.models import kernels

    if not kernels.available():
        pytest.skip(f"decodekit's kernels: {kernels.status().reason}")
    op = torch.ops.decodekit.row_logsumexp
    generator = torch.Generator().manual_seed(2)
    for vocab in (1, 5, 16, 17, 2_048, 151_936):
        x = torch.randn(3, vocab, generator=generator) * 4
        x[1, : vocab // 2] = float("-inf")
        want = torch.logsumexp(x.double(), dim=-1)
        assert torch.allclose(op(x).double(), want, rtol=2e-6, atol=2e-6), vocab
    assert op(torch.full((1, 40), float("-inf"))).item() == float("-inf")
    assert op(torch.tensor([[-200.0, 0.0, -300.0]])).item() == 0.0


def test_large_rows_reuse_one_buffer_and_fault_no_pages():
    """The scratch buffers are kept between calls: drawing 16 rows of 151,936 logits again
    touches no new memory (the plain path's [R, V] float64 temporaries were unmapped when freed
    and faulted in again at every call: ~9,500 pages). A buffer made under inference mode is a
    normal tensor: the next call outside it writes into it (it raised)."""
    import resource

    from decodekit.sampling import processors, select
    from decodekit.scratch import scratch

    logits = torch.randn(16, 151_936)
    generator = torch.Generator().manual_seed(0)
    index = torch.zeros(16, 1, dtype=torch.long)
    with torch.inference_mode():  # as an engine step runs
        select.draw_logits_rows(logits, [(generator, 16)])
        select.chosen_logprobs(logits, index)
    buffer = scratch(logits.shape, torch.float64, processors.FLOAT64_ROWS)
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        select.draw_logits_rows(logits, [(generator, 16)])
        select.chosen_logprobs(logits, index)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert scratch(logits.shape, torch.float64, processors.FLOAT64_ROWS).data_ptr() == buffer.data_ptr()
    assert max(faults) < 100, faults
