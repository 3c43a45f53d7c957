"""The per-row gate of speculative decoding (decode/speculation_gate.py): when a row probes,
switches off, stays on, and comes back, on step costs given by hand; and on the engine, a
row whose drafts are never accepted stops verifying them."""

from __future__ import annotations

import pytest

import decodekit as dk
from decodekit.decode.drafters import Draft
from decodekit.decode.speculation_gate import SpeculationGate, StepCosts, expected_tokens, speedup
from decodekit.decode.speculative import SpeculativeConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def costs(plain: float, block: float, gamma: int = 4) -> StepCosts:
    """Step costs with a plain step and a step drafting `gamma` tokens measured."""
    out = StepCosts()
    out.record(plain, 0)
    out.record(block, gamma)
    return out


def run(gate: SpeculationGate, costs: StepCosts, steps: range, accepts, gamma: int = 4) -> list[int]:
    """Drive the gate over `steps`; accepts(step, drafted) -> accepted. The steps that drafted."""
    drafted_at = []
    for step in steps:
        drafted = gate.draft_tokens(gamma, costs, step)
        if drafted:
            drafted_at.append(step)
        gate.settle(drafted, accepts(step, drafted) if drafted else 0, gamma, costs, step)
    return drafted_at


def test_speedup_is_leviathans_formula():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert speedup(0.8, 4, 1.4) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))  # c = 0.1
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    assert speedup(0.0, 1, 1.0) == 1.0  # nothing accepted, free drafts: no gain


def test_a_row_that_never_accepts_probes_on_a_growing_interval():
    gate = SpeculationGate()
    drafted_at = run(gate, costs(1.0, 3.0), range(1, 1001), lambda step, drafted: 0)
    assert drafted_at == [1, 16, 64, 256, 512, 768]  # the interval: 16, 64, then 256 at most
    assert not gate.speculating and gate.alpha == 0.0


def test_a_row_that_accepts_well_keeps_speculating():
    # a block of 4 costs 3 plain steps (c = 0.5) and emits 5 tokens when all are accepted
    gate = SpeculationGate()
    drafted_at = run(gate, costs(1.0, 3.0), range(1, 201), lambda step, drafted: drafted)
    # the first probe, all 4 accepted against the prior's rejection: α = 4 / 4.5, 4.0 tokens
    # for 3 steps: on for good
    assert drafted_at == list(range(1, 201))
    assert gate.speculating and gate.alpha > 0.95


def test_the_same_acceptance_does_not_pay_on_dearer_drafts():
    # two of every four draft tokens accepted: α -> 2/3, 2.6 tokens a block (2.2 after the
    # first probe, α = 2 / 3.5); that pays where a block costs 1.4 plain steps, not 3, where
    # the row probes on the growing interval
    def two(step, drafted):
        return min(drafted, 2)

    cheap, dear = SpeculationGate(), SpeculationGate()
    assert run(cheap, costs(1.0, 1.4), range(1, 301), two) == list(range(1, 301))
    assert run(dear, costs(1.0, 3.0), range(1, 301), two) == [1, 16, 64, 256]


def test_a_row_whose_acceptance_rises_goes_back_to_speculating():
    gate = SpeculationGate()
    drafted_at = run(gate, costs(1.0, 1.8), range(1, 801), lambda step, drafted: 0 if step < 300 else drafted)
    assert drafted_at[:4] == [1, 16, 64, 256]
    assert drafted_at[4:] == list(range(512, 801))  # the first probe after the rise: on for good


def test_plain_steps_come_first_and_the_least_recent_one_prices_a_step():
    gate, costs = SpeculationGate(), StepCosts()
    assert gate.draft_tokens(4, costs, 1) == 0  # no plain step measured yet
    for seconds in (3.0, 1.0, 2.0):  # a dear step after a probe does not make drafts look cheap
        costs.record(seconds, 0)
    assert costs.step_cost(4) is None  # no drafting step measured yet
    costs.record(1.5, 1)
    costs.record(9.0, 4)
    costs.record(8.0, 4)  # the least of the recent ones, as for plain steps
    assert costs.step_cost(1) == pytest.approx(1.5) and costs.step_cost(4) == pytest.approx(8.0)
    # a length not measured: the nearest one's extra seconds, scaled
    assert costs.step_cost(2) == pytest.approx(1 + 0.5 * 2)  # from 1
    assert costs.step_cost(3) == pytest.approx(1 + 7.0 * 3 / 4)  # from 4
    assert gate.draft_tokens(4, costs, 1) == 4  # a probe is a whole block


class NeverAccepted:
    """Proposes a token the target's greedy output never contains: every draft is rejected."""

    def __init__(self, token: int, vocab_size: int):
        self.token, self.vocab_size = token, vocab_size

    def propose(self, context, num_tokens, sampler) -> Draft:
        import torch

        probs = torch.zeros((num_tokens, self.vocab_size), dtype=torch.float64, device="cpu")
        probs[:, self.token] = 1.0
        return Draft([self.token] * num_tokens, probs)


def test_on_the_engine_a_row_that_never_accepts_stops_verifying(tiny_lm):
    target = tiny_lm  # a NativeLM: speculative requests run on its engine
    assert target.supports_paged_kv
    params = dk.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    [plain] = dk.generate(target, "ROMEO: But soft", params)
    token = next(t for t in range(target.vocab_size) if t not in plain.token_ids)
    drafter = NeverAccepted(token, target.vocab_size)
    always = speculative_generate(target, drafter, "ROMEO: But soft", params, 4, fallback=False)
    gated = speculative_generate(target, drafter, "ROMEO: But soft", params, 4)
    for result in (always, gated):
        assert result.completions[0].token_ids == plain.token_ids
        assert result.stats.accepted_tokens == 0
    assert always.stats.target_calls == 40 and always.stats.drafted_tokens > 100
    # the gate's blocks: a probe of 4 tokens at its first step with a plain step measured,
    # and one at step 16; the interval is then 64, past the 40 tokens
    assert gated.stats.drafted_tokens == 8
    assert gated.stats.plain_steps == 38 and gated.stats.target_calls == 40


def test_by_default_a_seeded_request_that_samples_speculates_at_every_step(tiny_lm):
    # its draws must repeat, and the gate's switches follow the clock
    config = SpeculativeConfig()
    assert config.falls_back(dk.SamplingParams(temperature=0, seed=3))
    assert config.falls_back(dk.SamplingParams(temperature=1.0))  # unseeded
    assert not config.falls_back(dk.SamplingParams(temperature=1.0, seed=3))
    assert SpeculativeConfig(fallback=True).falls_back(dk.SamplingParams(temperature=1.0, seed=3))
    drafter = NeverAccepted(0, tiny_lm.vocab_size)
    seeded = dk.SamplingParams(temperature=1.0, seed=3, max_new_tokens=20, ignore_eos=True)
    runs = [speculative_generate(tiny_lm, drafter, "ROMEO:", seeded, 4) for _ in range(2)]
    assert runs[0].stats.plain_steps == 0 and runs[0].stats.drafted_tokens > 20
    assert runs[0].completions[0].token_ids == runs[1].completions[0].token_ids
    with pytest.raises(TypeError, match="fallback must be True, False or None"):
        SpeculativeConfig(fallback="yes")
