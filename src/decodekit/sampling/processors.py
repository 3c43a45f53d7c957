"""Token-level sampling adapters: pure functions from logits [R, V] to new logits [R, V].

R is the number of rows of one request (n samples, or beams) and V the vocabulary.
Every adapter returns a new tensor (the input is never modified) and never samples;
a removed token gets -inf. The rules follow REFERENCES.md ("Token-level sampling
adapters"); p = softmax(logits), H = -sum p log p (nats).

Conventions shared by the truncation adapters (top_k ... mirostat):
- Ties are kept: a token whose value equals the value at the cut is never removed
  (top-k keeps every token tied with the k-th largest logit, as HF and vLLM do; top-p
  and typical keep every token tied with the last one of the kept prefix; XTC keeps
  every token tied with the least likely token above the threshold). The kept set is
  therefore a function of the distribution alone, never of how a sort breaks ties.
- `min_keep` (SamplingParams.min_tokens_to_keep, >= 1): the `min_keep` first tokens
  (with ties) of the adapter's order always survive, so no truncation removes every
  token: the most likely ones, or for typical the most typical ones (as HF does).
- Only top-p and typical sort the vocabulary (typical by its own key); every other
  truncation is a threshold test or a partial `topk`, so a step sorts the vocabulary
  by probability at most once however many truncations the chain holds. On the CPU they
  first sort only the `SORTED_CANDIDATES` first tokens of their order (a partial `topk`;
  top-p its first `FIRST_CANDIDATES` before them, by `topk_rows`' chunks): in a row where
  those hold the mass asked for, the kept prefix lies among them and the cut is the one a
  full sort gives, bit for bit (the prefix's running sums are the same sequential sums).
  A flatter row is not sorted whole: its tokens are binned by their key's
  leading bits (`_binned_cutoff`: 32 bins an octave), the bins' masses summed, and only the
  bin where the running mass reaches the mass asked for is sorted. Its cut is the full
  sort's unless a running sum lies within float64 rounding of that mass (the sums are taken
  in another order). A full sort of a 151,936-token vocabulary took 12-15 ms of one core, the
  partial one 0.7-0.9 ms (of 256 tokens by chunks 0.1-0.2), the binned one 0.6-1.0 ms (AMD
  EPYC Zen 4, no AMX, 2026-11-29).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from decodekit.scratch import scratch, worth_scratch

NEG_INF = float("-inf")
_LOG_FLOAT_MAX = 88.7228391  # log(float32 max): caps DRY's exponent, as llama.cpp does


# -- helpers -------------------------------------------------------------------------------


def _kth_largest(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row, [R, 1] (k is clipped to V). The largest (every
    truncation's min_keep of 1) by `amax`, a vectorised pass: `topk` of one took 20x its time
    over a 151,936-token vocabulary (Zen 4)."""
    k = min(k, logits.shape[-1])
    if k == 1:
        return logits.amax(dim=-1, keepdim=True)
    return topk_rows(logits, k)[0][..., -1:]


def _remove(
    logits: torch.Tensor,
    remove: torch.Tensor,
    min_keep: int,
    rank: torch.Tensor | None = None,
    keeps_first: bool = False,
) -> torch.Tensor:
    """-inf where `remove` [R, V] is true, except for the `min_keep` tokens (and ties) that
    rank highest: by logit, or by `rank` [R, V] for adapters with their own order.
    keeps_first: the adapter's rule never removes the first token of its order (its cut is
    that token's value or below it), so a min_keep of 1 needs no test: three passes over
    [R, V] fewer (~0.1 ms a row at a 151,936-token vocabulary)."""
    if keeps_first and min_keep <= 1:
        return logits.masked_fill(remove, NEG_INF)
    rank = logits if rank is None else rank
    remove = remove & (rank < _kth_largest(rank, min_keep))
    return logits.masked_fill(remove, NEG_INF)


# The float64 slots of `probs64`: its copy of the logits and their softmax.
FLOAT64_ROWS, FLOAT64_PROBS = "float64 rows", "float64 probabilities"


def probs64(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits.double(), -1) of logits [R, V]: thresholds and cumulative sums in
    float64, so a hand-computed boundary is not decided by float32 rounding. For large rows
    on the CPU a view of the thread's FLOAT64_PROBS scratch slot (decodekit/scratch.py: the
    same numbers, without [R, V] temporaries faulted in at every step), valid until the
    slot's next use in this thread (the next adapter's or the draw's, select.py): read it
    before, copy what is kept."""
    if not worth_scratch(logits, torch.float64):
        return torch.softmax(logits, dim=-1, dtype=torch.float64)
    wide = scratch(logits.shape, torch.float64, FLOAT64_ROWS).copy_(logits)  # [R, V]
    probs = scratch(logits.shape, torch.float64, FLOAT64_PROBS)
    return torch.ops.aten._softmax.out(wide, -1, False, out=probs)


def _prefix_cutoff(sorted_key: torch.Tensor, sorted_probs: torch.Tensor, mass: float):
    """Key value of the last element of the shortest sorted prefix whose mass >= `mass`."""
    return _running_cutoff(sorted_key, torch.cumsum(sorted_probs, dim=-1), mass)


def _running_cutoff(sorted_key: torch.Tensor, running: torch.Tensor, mass: float):
    """`_prefix_cutoff` from the sorted probabilities' running sums: the mass strictly before
    each position (monotone, unlike cumsum(x) - x) is the previous running sum."""
    exclusive = torch.nn.functional.pad(running[..., :-1], (1, 0))
    num_kept = (exclusive < mass).sum(dim=-1, keepdim=True)  # >= 1
    return sorted_key.gather(-1, num_kept - 1)  # [R, 1]


# Tokens top-p and typical sort first on the CPU (module docstring); vocabularies up to four
# times this are sorted whole. Top-p tries its first FIRST_CANDIDATES before.
SORTED_CANDIDATES = 1024
FIRST_CANDIDATES = 256
# `_binned_cutoff`'s bins: a float32 key's exponent and its first BIN_BITS mantissa bits,
# so 2**BIN_BITS bins an octave; BINS of them from the row's first key (64 octaves), the
# rest in the last bin.
BIN_BITS = 5
BINS = 2048


def _sorted_cutoff(key: torch.Tensor, probs: torch.Tensor, mass: float, descending: bool):
    """`_prefix_cutoff` of probs [R, V] sorted by `key` [R, V] (descending or ascending):
    from a partial sort of the first SORTED_CANDIDATES tokens in the rows where they hold
    `mass` (the same cut as the full sort's), from their bins in the others
    (`_binned_cutoff`). Both run on the CPU only: they read the rows' sums, which on a GPU
    would wait for the device, and a GPU sorts the vocabulary fast."""
    if not (key.is_cpu and key.shape[-1] > 4 * SORTED_CANDIDATES):
        return _full_sort_cutoff(key, probs, mass, descending)
    cutoff, short, _ = _candidate_cutoff(key, probs, mass, descending)
    return _cut_short_rows(key, probs, mass, descending, cutoff, short)


def _candidate_cutoff(key: torch.Tensor, probs: torch.Tensor, mass: float, descending: bool) -> tuple:
    """`_sorted_cutoff`'s partial sort: (cutoff [R, 1], short [R]: the rows whose first tokens
    do not hold `mass`, their cutoffs left for `_cut_short_rows`, and the first tokens'
    (sorted keys, ids) [R, n] when every row was held by the same first n, else None). A
    descending key (top-p's) tries its first FIRST_CANDIDATES tokens before
    SORTED_CANDIDATES: a peaked row's mass lies in those, found by `topk_rows`' chunks."""
    rows = key.shape[0]
    cutoff = key.new_empty(rows, 1)
    short = torch.ones(rows, dtype=torch.bool, device=key.device)
    # The most the first `count` tokens of a row can hold: `count` times its largest
    # probability; once its first `seen` are summed (a key that is the probability itself),
    # their mass plus the rest at the last one's probability.
    held, below, seen = probs.new_zeros(rows), probs.amax(dim=-1), torch.zeros_like(probs[:, 0])
    first = None
    for count in (FIRST_CANDIDATES, SORTED_CANDIDATES) if descending else (SORTED_CANDIDATES,):
        # rows that cannot reach `mass` are not tried (at the last count: they go to their bins)
        tried = (short & (held + (count - seen) * below >= mass)).nonzero()[:, 0]
        if not len(tried):
            continue
        keys = _rows(key, tried)
        weights = keys if probs is key else _rows(probs, tried)
        sorted_key, ids, running = _first_tokens(keys, weights, descending, count)
        cutoff[tried] = _running_cutoff(sorted_key, running, mass)
        # the last running sum is the candidates' whole mass: every later token's exclusive
        # sum is at least it, so where it reaches `mass` no later token is kept
        now_held = running[..., -1] >= mass
        short[tried] = ~now_held
        if probs is key:
            held[tried], below[tried], seen[tried] = running[..., -1], sorted_key[..., -1], count
        if first is None and len(tried) == rows and bool(now_held.all()):
            first = (sorted_key, ids)
    return cutoff, short, first


def _cut_short_rows(key, probs, mass: float, descending: bool, cutoff: torch.Tensor, short: torch.Tensor):
    """`cutoff` [R, 1] with the `short` rows' cuts from their bins (`_binned_cutoff`)."""
    rows = short.nonzero()[:, 0]
    if len(rows):
        keys = _rows(key, rows)
        cutoff[rows] = _binned_cutoff(keys, keys if probs is key else _rows(probs, rows), mass, descending)
    return cutoff


def _first_tokens(key: torch.Tensor, probs: torch.Tensor, descending: bool, count: int) -> tuple:
    """The first `count` tokens of each row in `key`'s order: their keys (sorted), ids and the
    running sums of their probs [R, count] (a partial sort)."""
    if descending:
        sorted_key, order = topk_rows(key, count)
    else:
        sorted_key, order = key.topk(count, dim=-1, largest=False)  # sorted
    sorted_probs = sorted_key if probs is key else probs.gather(-1, order)
    return sorted_key, order, torch.cumsum(sorted_probs, dim=-1)


def _rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor[rows], without the copy when `rows` are all of them (in order)."""
    return tensor if len(rows) == tensor.shape[0] else tensor[rows]


def _full_sort_cutoff(key: torch.Tensor, probs: torch.Tensor, mass: float, descending: bool):
    sorted_key, order = key.sort(dim=-1, descending=descending)
    return _prefix_cutoff(sorted_key, sorted_key if probs is key else probs.gather(-1, order), mass)


def _binned_cutoff(key: torch.Tensor, probs: torch.Tensor, mass: float, descending: bool):
    """`_prefix_cutoff` of probs [R, V] sorted by `key` [R, V] (>= 0, float64) without sorting
    the row: each token goes to a bin by its key's leading bits (the float32 key's bits
    shifted, which orders the bins as the keys and puts tied keys together), the bins'
    masses are summed in the key's order, and only the bin where the running mass reaches
    `mass` is sorted, its running sums continuing the bins' before it. A row whose bins never
    reach `mass` (float64 rounding of a mass of ~1) is sorted whole."""
    rows = key.shape[0]
    bins = key.float().view(torch.int32)  # in place from here: [R, V] temporaries are costly
    bins >>= 23 - BIN_BITS  # monotone for keys >= 0
    if descending:
        torch.sub(bins.amax(dim=-1, keepdim=True), bins, out=bins)
    else:
        bins -= bins.amin(dim=-1, keepdim=True)
    bins.clamp_(max=BINS - 1)
    offsets = torch.arange(0, rows * BINS, BINS, dtype=torch.int32, device=key.device)[:, None]
    bins += offsets  # each row's bins apart, counted in one call
    masses = torch.bincount(bins.view(-1), weights=probs.reshape(-1), minlength=rows * BINS)
    running = masses.view(rows, BINS).cumsum(-1)
    boundary = (running < mass).sum(dim=-1, keepdim=True)  # [R, 1]: the first bin reaching `mass`
    before = torch.nn.functional.pad(running, (1, 0)).gather(-1, boundary.clamp(max=BINS - 1))
    members = bins == boundary + offsets
    columns = members.nonzero()[:, 1].split(members.sum(dim=-1).tolist())
    cutoff = key.new_empty(key.shape[0], 1)
    for row, (columns_r, bin_r) in enumerate(zip(columns, boundary[:, 0].tolist())):
        if bin_r == BINS:
            cutoff[row] = _full_sort_cutoff(key[row : row + 1], probs[row : row + 1], mass, descending)
            continue
        sorted_key, order = key[row, columns_r].sort(descending=descending)
        running_r = before[row] + torch.cumsum(probs[row, columns_r[order]], dim=-1)
        exclusive = torch.cat([before[row], running_r[:-1]])
        cutoff[row] = sorted_key[int((exclusive < mass).sum()) - 1]
    return cutoff


def _token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """How often each token occurs in each row's history: [R, V] float32."""
    counts = torch.zeros(len(histories), vocab_size, device=device)
    # every row's (row, token) pairs in one copy to the device, not one per row
    pairs = [(row, token) for row, history in enumerate(histories) for token in history]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=device).T  # [2, N]
        counts.index_put_((index[0], index[1]), counts.new_ones(index.shape[1]), accumulate=True)
    return counts


def _ban(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """-inf at banned[row] for each row."""
    out = logits.clone()
    pairs = [(row, token) for row, ids in enumerate(banned) for token in ids]  # one copy for all rows
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=out.device).T  # [2, N]
        out[index[0], index[1]] = NEG_INF
    return out


# Rows at least this long, on the CPU, take `argmax_rows`' and `topk_rows`' chunked searches.
CHUNKED_MIN_VOCAB = 16384


def _chunk(x: torch.Tensor, sizes: tuple[int, ...] = (128, 64, 32)) -> int | None:
    """The chunk the chunked searches cut x [..., V] into: the first of `sizes` dividing a long
    CPU row; None where torch's own op runs (a GPU, a short row, no such divisor)."""
    vocab = x.shape[-1]
    if not (x.is_cpu and vocab >= CHUNKED_MIN_VOCAB):
        return None
    return next((c for c in sizes if vocab % c == 0), None)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of x [..., V] (the first of tied maxima; a NaN counts as the largest,
    as there), long [...]. On the CPU torch's argmax does not vectorise: 130-260 us a row of
    151,936 logits where `amax` takes 8 (AMD EPYC Zen 4, no AMX, 2026-11-29). Long rows there
    are cut into chunks of 128 (64, 32: a power of two dividing V); the first chunk holding
    the row's maximum (argmax over the chunks' `amax`) holds its first maximum, found by
    argmax within that chunk: 20-50 us a row, the same index."""
    chunk = _chunk(x)
    if chunk is None:
        return x.argmax(dim=-1)
    rows = x.reshape(-1, x.shape[-1] // chunk, chunk)  # [R, V / c, c]
    first = rows.amax(dim=-1).argmax(dim=-1)  # [R]: the first chunk holding the maximum
    within = rows[torch.arange(rows.shape[0], device=x.device), first].argmax(dim=-1)
    return (first * chunk + within).view(x.shape[:-1])


# `topk_rows` takes its chunked search up to this k (past it torch's partial sort wins).
TOPK_CHUNKED_MAX = 256


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=-1) of x [R, V], sorted: (values, ids) [R, k]; the same values, and ids
    of tokens holding them (where tokens tie at the k-th value, which of them is torch's
    choice or this one's). torch's CPU topk reads every logit at ~1.2 ns (175-250 us a row of
    151,936 for k of 5-56, Zen 4). Long CPU rows are cut into chunks as in `argmax_rows`, and
    the k chunks with the largest maxima hold the top k values: a value above the k-th
    largest maximum t lies in a chunk whose maximum is above t, all of which are among those
    k, and each of them whose maximum is t holds a t. A topk over those chunks finds them:
    23-87 us a row for k up to 56 (chunks of 128), 105-190 for 256 (of 32; torch 290-306)."""
    chunk = _chunk(x, (128, 64, 32) if k <= 64 else (32, 64, 128))  # larger k: smaller chunks pay
    if chunk is None or x.dim() != 2 or k > TOPK_CHUNKED_MAX:
        return x.topk(k, dim=-1)
    rows, blocks = x.shape[0], x.reshape(x.shape[0], x.shape[-1] // chunk, chunk)
    wanted = min(k, blocks.shape[1])
    chosen = blocks.amax(dim=-1).topk(wanted, dim=-1).indices  # [R, wanted]
    cells = blocks.gather(1, chosen[:, :, None].expand(rows, wanted, chunk)).view(rows, -1)
    values, at = cells.topk(k, dim=-1)
    return values, chosen.gather(1, at // chunk) * chunk + at % chunk


# -- temperature and truncation --------------------------------------------------------------


def temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    """l / t. t == 0 is greedy: only the argmax (first of tied maxima) stays, a one-hot p."""
    if t == 0:
        top = argmax_rows(logits)[..., None]
        return torch.full_like(logits, NEG_INF).scatter_(-1, top, logits.gather(-1, top))
    return logits / t


def top_k(logits: torch.Tensor, k: int, min_keep: int = 1) -> torch.Tensor:
    """Keep the k largest logits and every token tied with the k-th; k >= V keeps all."""
    if k >= logits.shape[-1]:
        return logits.clone()
    return _remove(logits, logits < _kth_largest(logits, k), min_keep, keeps_first=True)


# `top_k_kept` looks this many places past the k-th for tokens tied with it.
TIES_LOOKED_AT = 16


def top_k_kept(
    logits: torch.Tensor, k: int, min_keep: int = 1
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """The tokens `top_k` keeps in each row of logits [R, V], as (logits [R, K], token ids
    [R, K]) in the vocabulary's order, -inf where a row keeps fewer than K: scattered into a
    row of -inf (`expand_kept`) they are `top_k`'s output, value for value. One `topk` of
    k + TIES_LOOKED_AT and a few ops on those, not the masks over the vocabulary. Where ties
    with the k-th reach TIES_LOOKED_AT places past it, or a row has fewer finite logits than
    it keeps: `top_k`'s output itself."""
    keep = max(k, min_keep)  # min_keep's largest tokens (and ties) survive any truncation
    if keep + TIES_LOOKED_AT >= logits.shape[-1]:
        return top_k(logits, k, min_keep)
    values, ids = topk_rows(logits, keep + TIES_LOOKED_AT)  # sorted, descending
    kth = values[:, keep - 1 : keep]  # [R, 1]
    if not bool((values[:, -1:] < kth).all()):  # ties may go on past the window (or -inf)
        return top_k(logits, k, min_keep)
    return _in_vocabulary_order(values.masked_fill(values < kth, NEG_INF), ids)


def top_p_kept(
    logits: torch.Tensor, p: float, min_keep: int = 1
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """The tokens `top_p` keeps, as `top_k_kept` gives top-k's, from the partial sort of the
    first FIRST_CANDIDATES or SORTED_CANDIDATES tokens (`_sorted_cutoff`): where in every row
    the same first tokens hold the mass (peaked rows) and no token past them ties with the
    cut, on the CPU, at min_keep 1.
    Elsewhere `top_p`'s output, from the same probabilities."""
    if p >= 1.0 or min_keep > 1 or not (logits.is_cpu and logits.shape[-1] > 4 * SORTED_CANDIDATES):
        return top_p(logits, p, min_keep)
    probs = probs64(logits)
    cutoff, short, first = _candidate_cutoff(probs, probs, p, descending=True)
    if first is not None and not bool(short.any()):
        sorted_probs, ids = first
        if bool((sorted_probs[:, -1:] < cutoff).all()):  # no tie with the cut past them
            kept = logits.gather(-1, ids).masked_fill(sorted_probs < cutoff, NEG_INF)
            return _in_vocabulary_order(kept, ids)
    cutoff = _cut_short_rows(probs, probs, p, True, cutoff, short)
    return _remove(logits, probs < cutoff, min_keep, keeps_first=True)


def _in_vocabulary_order(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [R, K] reordered by id: the whole row's order, which the draw's running
    sums and a first-of-ties argmax follow."""
    ids, order = ids.sort(dim=-1)
    return values.gather(-1, order), ids


def expand_kept(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A row of -inf like logits [R, V] with `values` [R, K] at `ids` [R, K] (`top_k_kept`)."""
    return torch.full_like(logits, NEG_INF).scatter_(-1, ids, values)


def top_p(logits: torch.Tensor, p: float, min_keep: int = 1) -> torch.Tensor:
    """Nucleus: the smallest set of most probable tokens with mass >= p (plus ties)."""
    if p >= 1.0:
        return logits.clone()
    probs = probs64(logits)
    cutoff = _sorted_cutoff(probs, probs, p, descending=True)
    return _remove(logits, probs < cutoff, min_keep, keeps_first=True)


def min_p(logits: torch.Tensor, p_base: float, min_keep: int = 1) -> torch.Tensor:
    """Keep p_i >= p_base * max p: the logits at least the largest + log p_base (p_i / max p
    is exp(l_i - max l)), as llama.cpp compares them, with no softmax over the vocabulary."""
    return _remove(logits, logits < _min_p_threshold(logits, p_base), min_keep, keeps_first=True)


def _min_p_threshold(logits: torch.Tensor, p_base: float) -> torch.Tensor:
    """[R, 1]: each row's largest logit + log p_base (min_p <= 1)."""
    return logits.amax(dim=-1, keepdim=True) + math.log(p_base)


def min_p_kept(
    logits: torch.Tensor, p_base: float, min_keep: int = 1
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """The tokens `min_p` keeps, as `top_k_kept` gives top-k's: a row's kept tokens are its
    largest logits, as many as pass the threshold, so the `topk_rows` of the most any row keeps
    holds them all. Where that is more than TOPK_CHUNKED_MAX (a flat row), off the CPU, or
    at min_keep > 1: `min_p`'s output."""
    if min_keep > 1 or not logits.is_cpu:
        return min_p(logits, p_base, min_keep)
    threshold = _min_p_threshold(logits, p_base)  # [R, 1]
    passing = logits >= threshold
    most = int(passing.sum(dim=-1).amax())
    if most > TOPK_CHUNKED_MAX or most >= logits.shape[-1]:
        return logits.masked_fill(~passing, NEG_INF)
    values, ids = topk_rows(logits, most)
    return _in_vocabulary_order(values.masked_fill(values < threshold, NEG_INF), ids)


def typical(logits: torch.Tensor, mass: float, min_keep: int = 1) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022, HF's rule).

    Sort tokens by |-log p_i - H| ascending and keep the shortest prefix with mass >= `mass`.
    """
    if mass >= 1.0:
        return logits.clone()
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    probs = log_probs.exp()
    entropy = -torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()  # inf for removed tokens
    cutoff = _sorted_cutoff(distance, probs, mass, descending=False)
    return _remove(logits, distance > cutoff, min_keep, rank=-distance, keeps_first=True)


def epsilon(logits: torch.Tensor, eps: float, min_keep: int = 1) -> torch.Tensor:
    """Epsilon sampling (Hewitt et al. 2022): drop p_i < eps."""
    return _remove(logits, probs64(logits) < eps, min_keep)


def eta(logits: torch.Tensor, eta_value: float, min_keep: int = 1) -> torch.Tensor:
    """Eta sampling (Hewitt et al. 2022): drop p_i < min(eta, sqrt(eta) * exp(-H))."""
    probs = probs64(logits)
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1, keepdim=True)
    threshold = torch.clamp(math.sqrt(eta_value) * torch.exp(-entropy), max=eta_value)
    return _remove(logits, probs < threshold, min_keep)


def top_n_sigma(logits: torch.Tensor, n: float, min_keep: int = 1) -> torch.Tensor:
    """Keep l_i >= max l - n * std(l), std the population deviation over finite logits."""
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    values = torch.where(finite, logits.double(), 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    var = (torch.where(finite, values - mean, 0.0) ** 2).sum(dim=-1, keepdim=True) / count
    spread = n * var.sqrt() if math.isfinite(n) else torch.full_like(var, math.inf)
    threshold = logits.double().amax(dim=-1, keepdim=True) - spread
    return _remove(logits, logits.double() < threshold, min_keep)


def xtc(
    logits: torch.Tensor,
    threshold: float,
    probability: float,
    generator: torch.Generator,
    min_keep: int = 1,
) -> torch.Tensor:
    """Exclude top choices (llama.cpp's XTC).

    With probability `probability` (one uniform per row from the request's generator),
    remove every token with p >= threshold except the least likely of them (and its
    ties); only when at least two tokens reach the threshold and `min_keep` remain.
    """
    if probability <= 0:
        return logits.clone()
    draw = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64, device="cpu")
    applies = (draw < probability).to(logits.device)[:, None]  # [R, 1]
    probs = probs64(logits)
    above = probs >= threshold
    least = torch.where(above, probs, math.inf).amin(dim=-1, keepdim=True)
    remove = above & (probs > least)
    remaining = (probs > 0).sum(-1, keepdim=True) - remove.sum(-1, keepdim=True)
    ok = applies & (above.sum(-1, keepdim=True) >= 2) & (remaining >= min_keep)
    return logits.masked_fill(remove & ok, NEG_INF)


def mirostat(logits: torch.Tensor, mu: torch.Tensor, min_keep: int = 1) -> torch.Tensor:
    """Mirostat v2 truncation: drop tokens whose surprise -log2 p exceeds mu [R].

    The update of mu from the chosen token lives in `SamplerState.accept`.
    """
    surprise = -torch.log_softmax(logits.double(), dim=-1) / math.log(2)
    return _remove(logits, surprise > mu.to(logits.device, torch.float64)[:, None], min_keep)


# -- penalties and masks ---------------------------------------------------------------------


def logit_bias(logits: torch.Tensor, bias: Mapping[int, float]) -> torch.Tensor:
    """Add bias[token] to that token's logit in every row (OpenAI/vLLM logit_bias)."""
    out = logits.clone()
    if bias:
        ids = torch.as_tensor(list(bias), dtype=torch.long, device=out.device)
        values = torch.as_tensor(list(bias.values()), dtype=out.dtype, device=out.device)
        out[:, ids] += values
    return out


def allowed_tokens(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """-inf everywhere except `token_ids` (vLLM's allowed_token_ids)."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[torch.as_tensor(list(token_ids), dtype=torch.long, device=logits.device)] = True
    return logits.masked_fill(~keep, NEG_INF)


def min_tokens(
    logits: torch.Tensor,
    num_generated: Sequence[int],
    min_new_tokens: int,
    stop_token_ids: Sequence[int],
) -> torch.Tensor:
    """-inf at the stop tokens (EOS, stop_token_ids) of rows that generated < min_new_tokens."""
    stops = list(stop_token_ids)
    banned = [stops if count < min_new_tokens else [] for count in num_generated]
    return _ban(logits, banned)


def bad_words(
    logits: torch.Tensor, contexts: Sequence[Sequence[int]], sequences: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Ban the last token of every bad sequence whose other tokens end the context."""
    banned = []
    for context in contexts:
        row = []
        for seq in sequences:
            prefix = list(seq[:-1])
            if not prefix or list(context[len(context) - len(prefix) :]) == prefix:
                row.append(seq[-1])
        banned.append(row)
    return _ban(logits, banned)


def no_repeat_ngram(
    logits: torch.Tensor, contexts: Sequence[Sequence[int]], n: int
) -> torch.Tensor:
    """N-gram blocking (seed 004, HF): ban tokens that would complete an n-gram already
    present in the context (prompt + generated)."""
    banned = []
    for context in contexts:
        if len(context) < n:
            banned.append([])
            continue
        # the history is host data: matched on the host, only the bans reach the device
        windows = torch.as_tensor(list(context), dtype=torch.long, device="cpu").unfold(0, n, 1)  # [W, n]
        prefix = torch.as_tensor(list(context[len(context) - n + 1 :]), dtype=torch.long, device="cpu")
        match = (windows[:, : n - 1] == prefix).all(dim=-1)
        banned.append(windows[match, n - 1].tolist())
    return _ban(logits, banned)


def repetition_penalty(
    logits: torch.Tensor, contexts: Sequence[Sequence[int]], penalty: float
) -> torch.Tensor:
    """CTRL/HF repetition penalty over seen tokens (prompt + generated): l > 0 -> l / r,
    l <= 0 -> l * r."""
    seen = _token_counts(contexts, logits.shape[-1], logits.device) > 0
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def frequency_presence(
    logits: torch.Tensor, generated: Sequence[Sequence[int]], frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI/vLLM penalties over generated tokens: l -= count * f + [count > 0] * p."""
    counts = _token_counts(generated, logits.shape[-1], logits.device)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def dry_match_lengths(context: Sequence[int], limit: int) -> torch.Tensor:
    """For each position j < N - 1: the length of the longest suffix of context[: j + 1]
    that is also a suffix of the whole context, capped at `limit` (0 when none): [N - 1]."""
    tokens = torch.as_tensor(list(context), dtype=torch.long, device="cpu")  # host history
    last = len(tokens) - 1
    lengths = torch.zeros(max(last, 0), dtype=torch.long, device="cpu")
    if last < 1 or limit < 1:
        return lengths
    alive = torch.nonzero(tokens[:last] == tokens[last]).flatten()  # matches of length >= 1
    length = 0
    while len(alive) and length < limit:
        length += 1
        lengths[alive] = length
        alive = alive[alive >= length]  # can a match ending at j grow by one more token?
        alive = alive[tokens[alive - length] == tokens[last - length]]
    return lengths


@dataclass(frozen=True)
class DryBreakers:
    """DRY sequence breakers, matched on the text of the context (llama.cpp's DRY, from
    koboldcpp PR 982): a breaker counts wherever its characters appear, inside a token
    (" ROMEO:" holds ":") or across tokens (" ROM" + "EO:" holds "ROMEO:"), whatever the
    tokenisation. `token_texts[i]` is the text of token i; `tokens` are the tokens whose
    own text contains a breaker (llama.cpp's single-token breakers), never penalised."""

    strings: tuple[str, ...] = ()
    token_texts: tuple[str, ...] = ()
    tokens: frozenset[int] = frozenset()

    @classmethod
    def from_texts(cls, strings: Sequence[str], token_texts: Sequence[str]) -> DryBreakers:
        strings = tuple(dict.fromkeys(s for s in strings if s))
        tokens = frozenset(i for i, text in enumerate(token_texts) if any(s in text for s in strings))
        return cls(strings, tuple(token_texts), tokens)


def dry(
    logits: torch.Tensor,
    contexts: Sequence[Sequence[int]],
    multiplier: float,
    base: float,
    allowed_length: int,
    breakers: DryBreakers = DryBreakers(),
) -> torch.Tensor:
    """DRY, "don't repeat yourself" (llama.cpp's rule).

    A token that would extend a repeat of length L >= allowed_length (the longest suffix
    of the context that also occurs earlier, followed there by this token) loses
    multiplier * base ** (L - allowed_length). A repeat never reaches back to a token that
    holds (part of) the last sequence breaker in the context's text, and a token whose
    own text contains a breaker is never penalised itself.
    """
    max_exponent = int(_LOG_FLOAT_MAX / math.log(base)) if base > 1.000001 else 0
    out = logits.clone()
    for row, context in enumerate(contexts):
        limit = _dry_repeat_limit(context, breakers)
        if len(context) <= allowed_length or limit < allowed_length:
            continue
        longest: dict[int, int] = {}  # next token -> longest repeat it would extend
        lengths = dry_match_lengths(context, limit)
        for j in torch.nonzero(lengths >= allowed_length).flatten().tolist():
            token, length = context[j + 1], int(lengths[j])
            longest[token] = max(length, longest.get(token, 0))
        for token, length in longest.items():
            if token in breakers.tokens:
                continue
            exponent = length - allowed_length
            if max_exponent > 0:
                exponent = min(exponent, max_exponent)
            out[row, token] -= multiplier * base**exponent
    return out


def _dry_repeat_limit(context: Sequence[int], breakers: DryBreakers) -> int:
    """Tokens after the last one that holds the end of a breaker in the context's text (the
    whole context when none). The text is searched in windows growing back from the end;
    the last breaker found is final once it ends `longest` or more characters into the
    window, since a breaker that starts before the window ends sooner than that."""
    if not breakers.strings:
        return len(context)
    longest = max(map(len, breakers.strings))
    vocab = breakers.token_texts
    size = 16
    while True:
        start = max(len(context) - size, 0)
        texts = [vocab[t] if t < len(vocab) else "" for t in context[start:]]
        text = "".join(texts)
        ends = [at + len(s) for s in breakers.strings if (at := text.rfind(s)) >= 0]
        if ends and (max(ends) >= longest or start == 0):
            # the token holding character max(ends) - 1
            token = bisect.bisect_left(list(itertools.accumulate(map(len, texts))), max(ends))
            return len(texts) - 1 - token
        if start == 0:
            return len(context)
        size *= 4
