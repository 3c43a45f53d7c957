"""Temperature and truncation adapters on hand-computed 4-6 token distributions."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.sampling import processors as P

INF = math.inf
# A five-token distribution whose probabilities are round numbers.
PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def logits_of(probs):
    return torch.tensor([[math.log(p) if p > 0 else -INF for p in probs]])  # [1, V]


def kept(probs, keep):
    """Hand reference: zero the tokens not in `keep`, renormalise."""
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


def dist(logits):
    return torch.softmax(logits.double(), dim=-1)[0].tolist()


def assert_dist(logits, expected):
    assert dist(logits) == pytest.approx(expected, abs=1e-6)
    removed = torch.isneginf(logits[0]).tolist()
    assert removed == [e == 0.0 for e in expected]


def test_temperature_divides_logits():
    out = P.temperature(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), 2.0)
    assert out[0].tolist() == [0.5, 1.0, 1.5, 2.0]
    z = sum(math.exp(x / 2) for x in (1, 2, 3, 4))
    assert dist(out) == pytest.approx([math.exp(x / 2) / z for x in (1, 2, 3, 4)])


def test_temperature_zero_is_one_hot_at_first_maximum():
    out = P.temperature(torch.tensor([[3.0, 1.0, 3.0, 2.0]]), 0.0)
    assert dist(out) == [1.0, 0.0, 0.0, 0.0]
    assert out[0, 0].item() == 3.0  # the kept logit is unchanged


def test_small_temperature_approaches_one_hot():
    logits = torch.tensor([[1.0, 2.0, 3.0, 2.5]])
    top = [dist(P.temperature(logits, t))[2] for t in (1.0, 0.3, 0.1, 0.01)]
    assert top == sorted(top)  # the argmax gains mass as T falls
    # T = 0.1: p(argmax) = 1 / (1 + e^-5 + e^-10 + e^-20)
    assert top[2] == pytest.approx(1 / (1 + math.exp(-5) + math.exp(-10) + math.exp(-20)))
    assert top[3] > 1 - 1e-15


def test_top_k_keeps_k_most_likely():
    assert_dist(P.top_k(logits_of(PROBS), 2), kept(PROBS, {0, 1}))
    assert_dist(P.top_k(logits_of(PROBS), 1), [1, 0, 0, 0, 0])


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    z = math.exp(2) + 2 * math.e
    assert_dist(P.top_k(logits, 2), [math.exp(2) / z, math.e / z, math.e / z, 0.0])


@pytest.mark.parametrize("k", [5, 6, 1000])
def test_top_k_at_or_beyond_vocabulary_keeps_all(k):
    assert_dist(P.top_k(logits_of(PROBS), k), PROBS)


def test_top_k_honours_min_tokens_to_keep():
    assert_dist(P.top_k(logits_of(PROBS), 1, min_keep=3), kept(PROBS, {0, 1, 2}))


def test_top_p_keeps_smallest_set_with_mass_at_least_p():
    assert_dist(P.top_p(logits_of(PROBS), 0.6), kept(PROBS, {0, 1}))  # 0.4 < 0.6 <= 0.7
    assert_dist(P.top_p(logits_of(PROBS), 0.75), kept(PROBS, {0, 1, 2}))  # 0.7 < 0.75
    assert_dist(P.top_p(logits_of(PROBS), 0.1), [1, 0, 0, 0, 0])


def test_top_p_one_keeps_all():
    assert_dist(P.top_p(logits_of(PROBS), 1.0), PROBS)


def test_top_p_keeps_ties_of_the_last_kept_token():
    probs = [0.3, 0.3, 0.2, 0.2]
    # mass 0.6 < 0.7, so one 0.2 is needed; its twin is kept too
    assert_dist(P.top_p(logits_of(probs), 0.7), probs)


def test_top_p_honours_min_tokens_to_keep():
    assert_dist(P.top_p(logits_of(PROBS), 0.1, min_keep=3), kept(PROBS, {0, 1, 2}))


def test_min_p_scales_with_the_top_probability():
    assert_dist(P.min_p(logits_of(PROBS), 0.3), kept(PROBS, {0, 1, 2}))  # p >= 0.12
    assert_dist(P.min_p(logits_of(PROBS), 0.5), kept(PROBS, {0, 1}))  # p >= 0.2
    assert_dist(P.min_p(logits_of(PROBS), 0.5, min_keep=4), kept(PROBS, {0, 1, 2, 3}))


def test_epsilon_drops_tokens_below_epsilon_and_never_all():
    assert_dist(P.epsilon(logits_of(PROBS), 0.12), kept(PROBS, {0, 1, 2}))
    assert_dist(P.epsilon(logits_of(PROBS), 0.5), [1, 0, 0, 0, 0])  # all below: keep the top
    assert_dist(P.epsilon(logits_of(PROBS), 0.5, min_keep=2), kept(PROBS, {0, 1}))


def test_eta_threshold_is_min_of_eta_and_entropy_term():
    entropy = -sum(p * math.log(p) for p in PROBS)  # 1.392 nats
    threshold = min(0.2, math.sqrt(0.2) * math.exp(-entropy))  # 0.111: the entropy term
    assert 0.1 < threshold < 0.15
    assert_dist(P.eta(logits_of(PROBS), 0.2), kept(PROBS, {0, 1, 2}))
    # eta = 0.045: sqrt(0.045) e^-H = 0.0527 > 0.045, so the threshold is eta itself and
    # the 0.05 token (which the entropy term alone would drop) stays
    assert 0.045 < 0.05 < math.sqrt(0.045) * math.exp(-entropy)
    assert_dist(P.eta(logits_of(PROBS), 0.045), PROBS)
    assert_dist(P.eta(logits_of(PROBS), 0.06), kept(PROBS, {0, 1, 2, 3}))


def test_typical_keeps_tokens_closest_to_the_entropy():
    # |-log p - H| = [0.476, 0.188, 0.505, 0.910, 1.603]: order 1, 0, 2, 3, 4
    entropy = -sum(p * math.log(p) for p in PROBS)
    distance = [abs(-math.log(p) - entropy) for p in PROBS]
    assert sorted(range(5), key=distance.__getitem__) == [1, 0, 2, 3, 4]
    assert_dist(P.typical(logits_of(PROBS), 0.2), [0, 1, 0, 0, 0])  # drops the argmax
    assert_dist(P.typical(logits_of(PROBS), 0.5), kept(PROBS, {0, 1}))  # 0.3 < 0.5 <= 0.7
    assert_dist(P.typical(logits_of(PROBS), 0.8), kept(PROBS, {0, 1, 2}))  # 0.7 < 0.8
    assert_dist(P.typical(logits_of(PROBS), 1.0), PROBS)
    assert_dist(P.typical(logits_of(PROBS), 0.2, min_keep=2), kept(PROBS, {0, 1}))


def test_top_n_sigma_uses_std_of_finite_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -INF]])
    std = math.sqrt((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 4)  # 1.118, the -inf excluded
    z2, z3 = math.exp(3) + math.exp(2), math.exp(3) + math.exp(2) + math.e
    assert 3 - 1 * std > 1  # n = 1 keeps 3 and 2
    assert_dist(P.top_n_sigma(logits, 1.0), [math.exp(3) / z2, math.exp(2) / z2, 0, 0, 0])
    assert 0 < 3 - 2 * std < 1  # n = 2 keeps 3, 2 and 1
    assert_dist(
        P.top_n_sigma(logits, 2.0), [math.exp(3) / z3, math.exp(2) / z3, math.e / z3, 0, 0]
    )
    # n = 1.7: 3 - 1.7 * 1.118 = 1.099 > 1 drops the 1 (a sample std, 1.291, would keep it)
    assert_dist(P.top_n_sigma(logits, 1.7), [math.exp(3) / z2, math.exp(2) / z2, 0, 0, 0])
    assert_dist(P.top_n_sigma(logits, 0.0), [1, 0, 0, 0, 0])
    assert torch.equal(P.top_n_sigma(logits, INF), logits)


def test_xtc_with_probability_one_removes_top_choices_but_the_least_of_them():
    generator = torch.Generator().manual_seed(0)
    # p >= 0.12: tokens 0, 1, 2; the least likely of them (token 2) stays
    out = P.xtc(logits_of(PROBS), 0.12, 1.0, generator)
    assert_dist(out, kept(PROBS, {2, 3, 4}))
    assert dist(out)[2] == pytest.approx(0.15 / 0.3)


def test_xtc_needs_two_tokens_above_threshold_and_a_draw():
    generator = torch.Generator().manual_seed(0)
    assert_dist(P.xtc(logits_of(PROBS), 0.35, 1.0, generator), PROBS)  # only 0.4 >= 0.35
    assert_dist(P.xtc(logits_of(PROBS), 0.12, 0.0, generator), PROBS)  # probability 0
    assert_dist(P.xtc(logits_of(PROBS), 0.12, 1.0, generator, min_keep=4), PROBS)  # 3 left < 4


def test_xtc_applies_to_each_row_with_its_probability():
    generator = torch.Generator().manual_seed(0)
    out = P.xtc(logits_of(PROBS).repeat(4000, 1), 0.12, 0.25, generator)
    applied = torch.isneginf(out[:, 0])
    assert torch.isneginf(out[applied, 1]).all() and not torch.isinf(out[~applied]).any()
    # 4000 Bernoulli(0.25) rows: mean 1000, sd 27; +-5 sd
    assert 865 < applied.sum().item() < 1135


def test_mirostat_drops_tokens_more_surprising_than_mu():
    # surprise -log2 p = [1.32, 1.74, 2.74, 3.32, 4.32]
    assert_dist(P.mirostat(logits_of(PROBS), torch.tensor([3.0])), kept(PROBS, {0, 1, 2}))
    assert_dist(P.mirostat(logits_of(PROBS), torch.tensor([0.5])), [1, 0, 0, 0, 0])
    assert_dist(P.mirostat(logits_of(PROBS), torch.tensor([5.0])), PROBS)


TRUNCATIONS = {
    "top_k": lambda x: P.top_k(x, 2),
    "top_p": lambda x: P.top_p(x, 0.5),
    "min_p": lambda x: P.min_p(x, 0.5),
    "typical": lambda x: P.typical(x, 0.5),
    "epsilon": lambda x: P.epsilon(x, 0.3),
    "eta": lambda x: P.eta(x, 0.5),
    "top_n_sigma": lambda x: P.top_n_sigma(x, 1.0),
    "xtc": lambda x: P.xtc(x, 0.1, 1.0, torch.Generator().manual_seed(0)),
    "mirostat": lambda x: P.mirostat(x, torch.tensor([0.1])),
    "temperature": lambda x: P.temperature(x, 0.5),
}


@pytest.mark.parametrize("name", sorted(TRUNCATIONS))
def test_all_but_one_token_removed_stays_one_hot(name):
    logits = torch.tensor([[-INF, 1.0, -INF, -INF]])
    out = TRUNCATIONS[name](logits)
    assert dist(out) == [0.0, 1.0, 0.0, 0.0]
    assert torch.isfinite(out[0, 1])


@pytest.mark.parametrize("name", sorted(TRUNCATIONS))
def test_adapters_return_a_new_tensor_and_leave_the_input(name):
    logits = logits_of(PROBS)
    before = logits.clone()
    out = TRUNCATIONS[name](logits)
    assert torch.equal(logits, before)
    assert out.data_ptr() != logits.data_ptr() and out.dtype == torch.float32


def test_rows_are_truncated_independently():
    logits = torch.cat([logits_of(PROBS), logits_of([0.05, 0.1, 0.15, 0.3, 0.4])])
    out = P.top_p(logits, 0.6)
    assert torch.isfinite(out).tolist() == [
        [True, True, False, False, False],
        [False, False, False, True, True],
    ]


def _full_sort_cutoffs(logits, p):
    """top-p's and typical's cuts by sorting the whole vocabulary (the rule, written out)."""
    probs = torch.softmax(logits.double(), dim=-1)
    nucleus = probs.sort(dim=-1, descending=True).values
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    entropy = -torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    ordered, order = distance.sort(dim=-1)
    typical = P._prefix_cutoff(ordered, probs.gather(-1, order), p)
    return P._prefix_cutoff(nucleus, nucleus, p), typical, distance


@pytest.mark.parametrize("vocab", [20_000, 151_936])
def test_a_large_vocabulary_sorts_its_first_tokens_and_cuts_where_a_full_sort_does(vocab, monkeypatch):
    """On the CPU, top-p and typical sort only their first tokens (top-p 256, then 1,024;
    typical 1,024) when those hold the mass (module docstring): the cut equals the full
    sort's, bit for bit, for peaked rows, ties at the cut, and every 5th of the first 300
    running sums as the mass, beside a flat row (decided by its bins). Nothing is sorted
    whole: peaked rows sort nothing, the flat row one bin."""
    generator = torch.Generator().manual_seed(0)
    peaked = torch.randn(2, vocab, generator=generator) * 4
    peaked[1, :40] = 9.0  # 40 tied logits at the top
    flat = torch.randn(1, vocab, generator=generator) * 0.1  # its first 1,024 hold 1-6 % of the mass
    probs = torch.softmax(peaked[:1].double(), dim=-1).sort(dim=-1, descending=True).values
    exact = float(torch.cumsum(probs, dim=-1)[0, 5])  # a mass equal to a prefix's running sum
    for logits in (peaked, torch.cat([peaked, flat])):
        for p in (0.5, 0.9, exact, 0.999):
            nucleus, typical, distance = _full_sort_cutoffs(logits, p)
            probs = torch.softmax(logits.double(), dim=-1)
            assert torch.equal(P._sorted_cutoff(probs, probs, p, descending=True), nucleus)
            assert torch.equal(P.top_p(logits, p), P._remove(logits, probs < nucleus, 1))
            assert torch.equal(P._sorted_cutoff(distance, probs, p, descending=False), typical)
            assert torch.equal(P.typical(logits, p), P._remove(logits, distance > typical, 1, rank=-distance))

    # every prefix's running sum as the mass: sums taken in another order (the bins') would
    # miss most of these cuts by an ulp (439 of the first 600 did when the bins decided peaked rows)
    probs = torch.softmax(peaked.double(), dim=-1)
    ordered = probs.sort(dim=-1, descending=True).values
    running = torch.cumsum(ordered, dim=-1)[:, :4096]  # every cut below lies in these
    masses = running[:, :300:5].flatten()
    assert bool((masses.max() <= running[:, -1]).all())
    for mass in masses.tolist():
        want = P._running_cutoff(ordered[:, :4096], running, mass)
        assert torch.equal(P._sorted_cutoff(probs, probs, mass, True), want)

    sorted_sizes = []
    sort = torch.Tensor.sort

    def recorded(self, *args, **kwargs):
        sorted_sizes.append(self.shape[-1])
        return sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", recorded)
    P.top_p(peaked, 0.9)  # the candidates hold 0.9 of every row
    P.typical(peaked, 0.9)
    assert sorted_sizes == []
    P.top_p(torch.cat([peaked, flat]), 0.9)
    P.typical(torch.cat([peaked, flat]), 0.9)
    assert len(sorted_sizes) == 2 and max(sorted_sizes) < vocab // 20  # the flat row's boundary bin


def _zipf_rows(rows, vocab, exponent, generator):
    """Logits of rows ranking the vocabulary at random, rank r at -s log r plus noise."""
    ranks = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]) + 1
    return -exponent * ranks.double().log().float() + 0.5 * torch.randn(rows, vocab, generator=generator)


def test_binned_cutoffs_are_the_full_sorts():
    """The binned cut (flat rows of a large vocabulary) equals the full sort's for top-p's and
    typical's keys: Zipf rows from flat to peaked, masses up to 1 - 1e-5, ties at the cut,
    keys spanning more than the bins' 64 octaves (the rest share the last bin), and a mass
    the bins never reach (the row sorted whole). Fails when a bin's running sums do not start
    from the mass before it, or when the bins do not follow the key's order."""
    generator = torch.Generator().manual_seed(1)
    rows = [_zipf_rows(2, 151_936, exponent, generator) for exponent in (0.8, 1.1, 1.5)]
    tied = _zipf_rows(1, 151_936, 0.9, generator)
    tied[0, 5_000:25_000] = tied[0, 5_000]  # 20,000 tied logits
    tied_probs = torch.softmax(tied.double(), dim=-1)[0]
    above = float(tied_probs[tied_probs > tied_probs[5_000]].sum())
    straddle = above + 10_000 * float(tied_probs[5_000])  # a cut halfway through the tied block
    wide = torch.randn(1, 151_936, generator=generator)
    wide[0, ::2] -= 200.0  # half the keys ~2**-288 of the others': beyond the 64 octaves
    logits = torch.cat([*rows, tied, wide])
    probs = torch.softmax(logits.double(), dim=-1)
    _, _, distance = _full_sort_cutoffs(logits, 0.5)
    nucleus_sorted = probs.sort(dim=-1, descending=True).values  # the full sorts, once
    typical_sorted, order = distance.sort(dim=-1)
    typical_probs = probs.gather(-1, order)
    for p in (0.3, straddle, 0.9, 0.95, 0.99999, float(nucleus_sorted[-1].sum()) + 1e-9):
        nucleus = P._prefix_cutoff(nucleus_sorted, nucleus_sorted, p)
        assert torch.equal(P._binned_cutoff(probs, probs, p, descending=True), nucleus), p
        typical = P._prefix_cutoff(typical_sorted, typical_probs, p)
        assert torch.equal(P._binned_cutoff(distance, probs, p, descending=False), typical), p
    # the cut falls inside the tied block: all 20,000 are kept, and nothing below them
    kept = torch.isfinite(P.top_p(tied, straddle))[0]
    assert bool(kept[5_000:25_000].all())
    assert int(kept.sum()) == int((tied_probs >= tied_probs[5_000]).sum())


def test_adapters_with_probabilities_in_scratch_buffers_equal_the_plain_ops(monkeypatch):
    """probs64 (the truncation adapters' float64 softmax) in the thread's scratch slot equals
    softmax(logits.double()) bit for bit, and so does every adapter that reads it, alone and
    chained (each one's probabilities overwrite the last one's slot), with the size bound at 0
    and at infinity."""
    from decodekit import scratch

    logits = _zipf_rows(3, 5_000, 1.2, torch.Generator().manual_seed(2))

    def chain(x):
        return P.epsilon(P.min_p(P.top_p(x, 0.8), 0.01), 1e-5)

    adapters = {"top_p": lambda x: P.top_p(x, 0.9), "min_p": lambda x: P.min_p(x, 0.05),
                "epsilon": lambda x: P.epsilon(x, 1e-4), "eta": lambda x: P.eta(x, 1e-3),
                "xtc": lambda x: P.xtc(x, 0.01, 1.0, torch.Generator().manual_seed(0)),
                "chain": chain}  # fmt: skip
    outputs = {}
    for bound in (0, 1 << 62):
        monkeypatch.setattr(scratch, "MIN_BYTES", bound)
        assert torch.equal(P.probs64(logits), torch.softmax(logits.double(), dim=-1))
        outputs[bound] = {name: adapter(logits) for name, adapter in adapters.items()}
    for name in adapters:
        assert torch.equal(outputs[0][name], outputs[1 << 62][name]), name
        assert torch.isinf(outputs[0][name]).any(), name  # each one truncated something


def test_adapters_that_keep_their_first_token_skip_the_min_keep_test_with_the_same_result():
    """top-k, top-p, min-p and typical never remove the first token of their order, so with
    min_keep 1 they skip `_remove`'s test (keeps_first): the outputs equal the guarded
    `_remove`'s on rows with ties at the top, one finite logit, all logits equal, and noise."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 300, generator=generator) * 3
    rows[1, :5] = rows[1].max() + 1  # five tied at the top
    rows[2, 1:] = P.NEG_INF  # one finite logit
    rows[3] = 0.7  # all equal
    rows[4, ::2] = P.NEG_INF
    probs = torch.softmax(rows.double(), dim=-1)
    log_probs = torch.log_softmax(rows.double(), dim=-1)
    entropy = -torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    for p in (0.05, 0.5, 0.95):
        nucleus = P._sorted_cutoff(probs, probs, p, descending=True)
        assert torch.equal(P.top_p(rows, p), P._remove(rows, probs < nucleus, 1))
        typical = P._sorted_cutoff(distance, probs, p, descending=False)
        assert torch.equal(P.typical(rows, p), P._remove(rows, distance > typical, 1, rank=-distance))
        threshold = rows.amax(dim=-1, keepdim=True) + math.log(p)  # p_i >= p max p, as logits
        assert torch.equal(P.min_p(rows, p), P._remove(rows, rows < threshold, 1))
    for k in (1, 3, 50):
        assert torch.equal(P.top_k(rows, k), P._remove(rows, rows < P._kth_largest(rows, k), 1))


@pytest.mark.parametrize("vocab", [151_936, 32_064, 50_257, 2_048])
def test_argmax_rows_is_torchs_argmax(vocab):
    """argmax_rows (chunks of 128, 64 or 32 on long CPU rows; torch's argmax otherwise: 50,257
    has no such divisor, 2,048 is short) returns torch's index: the first of tied maxima, also
    when they lie in different chunks, at a chunk's edges, at either end of the row, a row of
    one finite logit, a NaN (torch counts it the largest), [V] and [R, 1, V] shapes."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(9, vocab, generator=generator)
    x[1, [5, 1000, vocab - 1]] = 50.0  # ties in three chunks: the first one wins
    x[2, [127, 128]] = 50.0  # across a chunk edge
    x[3, 0], x[4, vocab - 1] = 50.0, 50.0
    x[5] = P.NEG_INF
    x[5, vocab // 2 + 1] = -3.0
    x[6] = 1.0  # all tied: index 0
    x[7, [40, 1900]] = math.nan
    x[8, [200, 300]] = 7.0
    x[8, 260] = math.nan  # a NaN between two tied maxima
    assert torch.equal(P.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(P.argmax_rows(x[1]), x[1].argmax(dim=-1))
    assert torch.equal(P.argmax_rows(x[:, None]), x[:, None].argmax(dim=-1))
    assert torch.equal(P.argmax_rows(x[:0]), x[:0].argmax(dim=-1))


@pytest.mark.parametrize("vocab", [151_936, 50_257])
def test_topk_rows_finds_torchs_top_values(vocab):
    """topk_rows (the k chunks with the largest maxima, then a topk over them; torch's topk
    where the 50,257 tokens have no chunk size, or k > 256) returns torch's values, sorted,
    and k different ids holding them: for k of 1-256 and 300, a row whose top values crowd
    into one chunk, every chunk's maximum tied (and the top values past them in one chunk),
    a row mostly -inf, and a non-contiguous input. Fails when fewer chunks are searched."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(6, vocab, generator=generator)
    x[1, 1000:1100] += 20.0  # the top 100 in one or two chunks
    x[2, ::128] = 9.0  # every chunk's maximum tied ...
    x[2, 129:160] = torch.linspace(9.5, 9.1, 31)  # ... but one chunk's 31 above them
    x[3] = P.NEG_INF
    x[3, :300] = torch.randn(300, generator=generator)
    x[4, 7::500] = 5.0 + torch.arange(len(range(7, vocab, 500)), dtype=torch.float32) / 1000
    for k in (1, 5, 40, 56, 256, 300):
        for rows in (x, x[:, None, :].expand(6, 2, vocab)[:, 1]):
            values, ids = P.topk_rows(rows, k)
            assert torch.equal(values, rows.topk(k, dim=-1).values), k
            assert torch.equal(rows.gather(-1, ids), values), k
            assert all(len(set(row)) == k for row in ids.tolist())  # k different tokens
