"""The per-row gate of speculative decoding (decode/speculation_gate.py): when a row probes,
switches off, stays on, and comes back, on step costs given by hand; its share of a batch's
step (a row that pays alone but not beside 15 plain rows); and on the engine, a row whose
drafts are never accepted stops verifying them, and the step's rows the gates see."""

from __future__ import annotations

import pytest

import decodekit as dk
from decodekit.decode.drafters import Draft
from decodekit.decode.speculation_gate import SpeculationGate, StepBatch, StepCosts, expected_tokens, pays
from decodekit.decode.speculative import SpeculativeConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def costs(plain: float, block: float, gamma: int = 4, drafting: int = 1) -> StepCosts:
    """Step costs with a plain step and a step in which `drafting` rows draft `gamma` tokens."""
    out = StepCosts()
    out.record(plain, 0)
    out.record(block, gamma, drafting)
    return out


def run(gate: SpeculationGate, costs: StepCosts, steps: range, accepts, gamma: int = 4,
        rows: int = 1) -> list[int]:  # fmt: skip
    """Drive the gate over `steps`, as the one drafting row of `rows`; accepts(step, drafted)
    -> accepted. The steps that drafted."""
    drafted_at = []
    for step in steps:
        drafted = gate.draft_tokens(gamma, costs, step)
        if drafted:
            drafted_at.append(step)
        gate.settle(drafted, accepts(step, drafted) if drafted else 0, gamma, costs, step, rows, 1)
    return drafted_at


def test_alone_a_row_pays_by_leviathans_speedup():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    # R = S = 1: E - 1 > c - 1, that is (1 - α^(γ+1)) / ((1 - α) c) > 1, the rule of one request
    for alpha in (0.0, 0.3, 0.6, 0.8, 0.95):
        for cost in (1.0, 1.4, 2.0, 3.0, 4.5):
            speedup = (1 - alpha**5) / ((1 - alpha) * cost)
            assert pays(alpha, 4, cost) == (speedup > 1), (alpha, cost)
    assert not pays(0.0, 1, 1.0)  # nothing accepted, free drafts: no gain


def test_a_row_that_pays_alone_does_not_beside_fifteen_plain_rows():
    # α = 0.75, γ = 4: E = (1 - 0.75^5) / 0.25 = 3.0508 tokens a block.
    e = (1 - 0.75**5) / 0.25
    assert expected_tokens(0.75, 4) == pytest.approx(e)
    # Alone, a block costs 2.4 plain steps: 3.05 tokens for 2.4 steps pays.
    assert pays(0.75, 4, 2.4, rows=1, drafting=1)
    # In a batch of 16 where it alone drafts, the step costs 1.3 plain steps. The row gains
    # 3.05 tokens for 1.3 (its own speedup 2.35x, what the per-row rule read), but the batch
    # makes 15 + 3.05 = 18.05 tokens for 1.3 steps = 13.9 a step, against 16 plain:
    # E - 1 = 2.05 < R (c - 1) / S = 16 * 0.3 = 4.8.
    assert e / 1.3 > 1 and (15 + e) / 1.3 < 16
    assert not pays(0.75, 4, 1.3, rows=16, drafting=1)
    # Every row drafting, the step costs 3.15 (16 rows' drafts and 80 verified positions):
    # 16 * 3.05 / 3.15 = 15.5 tokens a step < 16, and each row's 2.05 < its share 2.15.
    assert not pays(0.75, 4, 3.15, rows=16, drafting=16)
    # At 2.9 plain steps it pays: 16 * 3.05 / 2.9 = 16.8 > 16; 2.05 > 1.9.
    assert pays(0.75, 4, 2.9, rows=16, drafting=16)
    # Half the batch drafting at 2.0: 8 * 2.05 = 16.4 > 16 * 1.0, each row 2.05 > 2.
    assert pays(0.75, 4, 2.0, rows=16, drafting=8) and not pays(0.75, 4, 2.1, rows=16, drafting=8)


def test_a_gate_that_keeps_speculating_alone_stays_plain_in_a_batch():
    # Every draft accepted (α -> 1, 5 tokens a block); a block costs the step 1.8 plain steps.
    # Alone it speculates from its first probe on; beside 15 plain rows its share of the step,
    # 16 * 0.8 = 12.8 plain steps, exceeds the 4 extra tokens of any block: probes only.
    alone, batched = SpeculationGate(), SpeculationGate()
    every = range(1, 301)
    assert run(alone, costs(1.0, 1.8), every, lambda step, drafted: drafted) == list(every)
    assert run(batched, costs(1.0, 1.8), every, lambda step, drafted: drafted, rows=16) == [1, 16, 64, 256]
    assert batched.alpha > 0.9 and not batched.speculating


def test_a_row_that_never_accepts_probes_on_a_growing_interval():
    gate = SpeculationGate()
    drafted_at = run(gate, costs(1.0, 3.0), range(1, 1001), lambda step, drafted: 0)
    assert drafted_at == [1, 16, 64, 256, 512, 768]  # the interval: 16, 64, then 256 at most
    # What is left of the prior (2 of 3) after six rejected probes: 2 x 0.9^6 accepted of
    # 3 x 0.9^6 + (1 - 0.9^6) / 0.1 examined.
    left = 0.9**6
    assert not gate.speculating and gate.alpha == pytest.approx(2 * left / (3 * left + (1 - left) / 0.1))


def test_a_row_that_accepts_well_keeps_speculating():
    # a block of 4 costs 3 plain steps (c = 0.5) and emits 5 tokens when all are accepted
    gate = SpeculationGate()
    drafted_at = run(gate, costs(1.0, 3.0), range(1, 201), lambda step, drafted: drafted)
    # the first probe, all 4 accepted beside the prior's 2 of 3: α = 5.8 / 6.7, 4.2 tokens a
    # block for 3 steps: on for good
    assert drafted_at == list(range(1, 201))
    assert gate.speculating and gate.alpha > 0.95


def test_an_unlucky_start_does_not_switch_a_row_off():
    # A continuation's first tokens agree least with a draft (BENCHMARKS.md: 0.47 against 0.73
    # for `shakespeare-large` and its distilled draft). Two blocks of 4 rejected, then 3 of
    # every 4 accepted, a block costing 1.6 plain steps: the row speculates throughout. (With
    # a decay of 0.5, a prior of one rejected position and no margin, the first block set α to
    # 0 and the row off until a probe at step 16.)
    gate = SpeculationGate()
    drafted_at = run(gate, costs(1.0, 1.6), range(1, 201),
                     lambda step, drafted: 0 if step <= 2 else min(drafted, 3))  # fmt: skip
    assert drafted_at == list(range(1, 201)) and gate.speculating


def test_the_same_acceptance_does_not_pay_on_dearer_drafts():
    # two of every four draft tokens accepted: 3 tokens a block, α -> 2/3. That pays where a
    # block costs 1.4 plain steps, not where it costs 4, where the row probes on the growing
    # interval: after the first probe α = 3.8 / 5.7 (the prior's 2 of 3 decayed, and 2 of 3),
    # judged at α + sqrt(α (1 - α) / (4 + 3 positions examined)) = 0.85: E = 3.67 < 4.
    def two(step, drafted):
        return min(drafted, 2)

    cheap, dear = SpeculationGate(), SpeculationGate()
    assert run(cheap, costs(1.0, 1.4), range(1, 301), two) == list(range(1, 301))
    assert run(dear, costs(1.0, 4.0), range(1, 301), two) == [1, 16, 64, 256]
    alpha = 3.8 / 5.7
    assert expected_tokens(alpha + (alpha * (1 - alpha) / 7) ** 0.5, 4) == pytest.approx(3.671, abs=1e-3)


def test_a_row_whose_acceptance_rises_goes_back_to_speculating():
    gate = SpeculationGate()
    drafted_at = run(gate, costs(1.0, 1.8), range(1, 801), lambda step, drafted: 0 if step < 300 else drafted)
    # Nothing accepted from the start: the prior (2 of 3) and the margin keep the row on for
    # three blocks (judged at 0.71, 0.57, 0.47: E = 2.83, 2.19, 1.85 > 1.8), off at the
    # fourth (0.39: E = 1.64), then probes on the growing interval.
    assert drafted_at[:7] == [1, 2, 3, 4, 16, 64, 256]
    assert drafted_at[7:] == list(range(512, 801))  # the first probe after the rise: on for good


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


def test_a_step_is_priced_from_steps_with_as_many_rows_drafting():
    costs = StepCosts()
    costs.record(1.0, 0)
    costs.record(1.5, 4, 1)  # one row of the batch drafting 4 tokens: +0.5 plain steps
    costs.record(3.0, 4, 16)  # sixteen: +2.0
    assert costs.step_cost(4, 16) == pytest.approx(3.0) and costs.step_cost(4, 1) == pytest.approx(1.5)
    assert costs.step_cost(2, 16) == pytest.approx(1 + 2.0 * 2 / 4)  # the same rows, the length scaled
    # rows not measured: the nearest count's extra seconds, scaled by the rows
    assert costs.step_cost(4, 12) == pytest.approx(1 + 2.0 * 12 / 16)
    assert costs.step_cost(4, 2) == pytest.approx(1 + 0.5 * 2)
    costs.record(2.0, 8, 2)  # as many rows drafting comes before the nearer length
    assert costs.step_cost(4, 2) == pytest.approx(1 + 1.0 * 4 / 8)


def test_a_step_batch_counts_lanes_and_the_programs_rows():
    batch, a, b = StepBatch(), object(), object()
    batch.join(a, [4, 0], 1, lanes=5)  # 5 rows on lanes (one of them a's plain row), a's drafting row
    batch.join(b, [4], 1, lanes=4)  # later joins do not read the lanes again
    assert (batch.rows, batch.drafting, batch.longest) == (7, 2, 4)
    batch.settled = True  # the programs ended the step: the next join starts the next one
    batch.join(b, [0], 0, lanes=3)
    assert (batch.rows, batch.drafting, batch.longest) == (3, 0, 0)
    batch.join(a, [2], 1, lanes=3)
    batch.join(a, [3], 1, lanes=2)  # a program's second join is a new step, settled or not
    assert (batch.rows, batch.drafting, batch.longest) == (3, 1, 3)


class NeverAccepted:
    """Proposes a token the target's greedy output never contains: every draft is rejected."""

    def __init__(self, token: int, vocab_size: int):
        self.token, self.vocab_size = token, vocab_size

    def propose(self, context, num_tokens, sampler) -> Draft:
        import torch

        probs = torch.zeros((num_tokens, self.vocab_size), dtype=torch.float64, device="cpu")
        probs[:, self.token] = 1.0
        return Draft([self.token] * num_tokens, probs)


@pytest.fixture
def dear_blocks(monkeypatch):
    """A block of drafts priced at 3 plain steps once a plain and a drafting step are measured:
    on the tiny model a free drafter's block costs about a plain step, where any acceptance the
    gate's margin allows pays, and how many blocks that takes would follow the clock."""
    priced = StepCosts.step_cost

    def step_cost(self, gamma, drafting=1):
        return None if priced(self, gamma, drafting) is None else 3.0

    monkeypatch.setattr(StepCosts, "step_cost", step_cost)


def test_on_the_engine_a_row_that_never_accepts_stops_verifying(tiny_lm, dear_blocks):
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


def test_on_the_engine_the_gates_see_the_steps_rows(tiny_lm, monkeypatch, dear_blocks):
    # Two speculative requests and one sampling request on one engine: at every step each
    # gate sees R = every decoding row (the sampling row on its lane too) and S = the rows
    # of both programs that drafted.
    from decodekit.decode.speculative import speculative_programs
    from decodekit.engine.engine import Engine

    seen = []  # per settle: (program step, drafted, rows, drafting)

    def settle(self, drafted, accepted, gamma, costs, step, rows=1, drafting=1):
        seen.append((step, drafted, rows, drafting))
        original(self, drafted, accepted, gamma, costs, step, rows, drafting)

    original = SpeculationGate.settle
    monkeypatch.setattr(SpeculationGate, "settle", settle)
    params = dk.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    [plain] = dk.generate(tiny_lm, "ROMEO: But soft", params)
    drafter = NeverAccepted(next(t for t in range(tiny_lm.vocab_size) if t not in plain.token_ids),
                            tiny_lm.vocab_size)  # fmt: skip
    engine = Engine(tiny_lm)
    programs = speculative_programs(tiny_lm, drafter, ["ROMEO: But soft", "JULIET: O"], params, 4)
    handles = [engine.add(p) for p in programs] + [engine.submit("ROMEO: But soft", params)]
    while not all(h.done for h in handles):
        engine.step()
    assert [c.token_ids for c in handles[0].result()] == [plain.token_ids]  # exact
    by_step: dict[int, list] = {}
    for step, drafted, rows, drafting in seen:
        by_step.setdefault(step, []).append((drafted, rows, drafting))
    # both programs started in one step, so their steps are counted alike
    assert len(by_step) == 24 and all(len(settles) == 2 for settles in by_step.values())
    probes = [step for step, settles in by_step.items() if any(d for d, _, _ in settles)]
    assert probes == [2, 16]  # after a plain step measured; rows that started together probe together
    for step, settles in by_step.items():
        drafting = sum(d > 0 for d, _, _ in settles)
        assert all(s == drafting for _, _, s in settles), (step, settles)
        # the sampling row took its first token from its prefill: it is done a step earlier
        assert all(r == (3 if step < 24 else 2) for _, r, _ in settles), (step, settles)
