"""Selectors: turn processed logits into token ids, and logprob helpers.

On the CPU the draws from logits and the chosen tokens' logprobs (`draw_logits_rows`,
`chosen_logprobs`) of large rows write the same kernels' outputs (softmax, running sums,
log-softmax: the same numbers, bit for bit) into scratch buffers kept per thread between calls
(decodekit/scratch.py), instead of [R, V] temporaries made and freed at every decode step:
at a real vocabulary those are large enough (~310 MB at 64 rows of 151,936 tokens) that glibc
unmapped them when freed and every step faulted their pages in again (BENCHMARKS.md, "Page
faults of a decode step"). Small rows (under scratch.MIN_BYTES: the package's 2,048 tokens)
take the plain ops, fewer calls; a GPU's caching allocator keeps its temporaries, so there too.
The draw's float64 softmax is the truncation adapters' (processors.py `probs64`), in the
same slots: an adapter reads its probabilities and drops them before the draw.
"""

from __future__ import annotations

import torch

from decodekit.sampling.chain import SamplerState
from decodekit.sampling.processors import CHUNKED_MIN_VOCAB, FLOAT64_ROWS, argmax_rows, probs64, topk_rows
from decodekit.scratch import scratch, worth_scratch


def select_tokens(processed_logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """Tokens [R] long from processed logits [R, V]: argmax when the request is greedy
    (temperature 0), else one categorical draw per row from the request's generator."""
    if state.params.greedy:
        return argmax_rows(processed_logits)
    return sample_categorical(processed_logits, state.generator)


def sample_categorical(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of softmax(logits) [R, V]: tokens [R] long (see `draw`)."""
    if logits.dim() == 2:
        return draw_logits_rows(logits, [(generator, logits.shape[0])])
    return draw(torch.softmax(logits.double(), dim=-1), generator)


def draw_rows(probs: torch.Tensor, generators: list[tuple[torch.Generator, int]]) -> torch.Tensor:
    """`draw` for the rows of several requests at once, probs [R, V]: each request's
    (generator, rows) in order draws its uniforms as `draw` would, so every row's token is
    the one it gets alone."""
    return _invert(probs, _uniforms(generators))


def draw_logits_rows(logits: torch.Tensor, generators: list[tuple[torch.Generator, int]]) -> torch.Tensor:
    """`draw_rows(softmax(logits.double()), generators)` for logits [R, V], bit for bit; large
    rows on the CPU in the thread's scratch buffers (module docstring). Processed logits that
    a chain made from a truncation's kept tokens (chain.py) carry them (`kept`: their
    logits [R, K] and ids, in the vocabulary's order): the draw is then among those alone,
    the same running sums without the vocabulary's zeros between them (the same token but
    where a sum's last bit decides it)."""
    kept = getattr(logits, "kept", None)
    if kept is not None:
        values, ids = kept
        chosen = draw_rows(torch.softmax(values, dim=-1, dtype=torch.float64), generators)
        return ids.gather(-1, chosen[:, None])[:, 0]
    if not worth_scratch(logits, torch.float64):
        return draw_rows(torch.softmax(logits, dim=-1, dtype=torch.float64), generators)
    u = _uniforms(generators)
    probs = probs64(logits)
    return _search(torch.cumsum(probs, dim=-1, out=scratch(logits.shape, torch.float64, FLOAT64_ROWS)), u)


def chosen_logprobs(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[r, index[r]] of logits [R, V] and index [R, 1]: [R]; large rows on
    the CPU in the thread's scratch buffer (module docstring). Processed logits that carry a
    truncation's kept tokens (`draw_logits_rows`; the chosen tokens among them) take the
    log-softmax of those alone: the -inf of the others adds nothing to it."""
    kept = getattr(logits, "kept", None)
    if kept is not None:
        values, ids = kept
        at = (ids == index).to(torch.uint8).argmax(dim=-1, keepdim=True)  # the token's place among them
        return torch.log_softmax(values, dim=-1).gather(-1, at)[:, 0]
    if fused_normaliser(logits):
        return logits.gather(-1, index)[:, 0] - torch.ops.decodekit.row_logsumexp(logits)
    return scratch_log_softmax(logits).gather(-1, index)[:, 0]


def fused_normaliser(logits: torch.Tensor) -> bool:
    """Whether `chosen_logprobs` takes logits [R, V] minus decodekit's row_logsumexp kernel
    (models/csrc/logsumexp.cpp: the log-softmax's normaliser without writing the row, 50-60 us
    a row of 151,936 where log_softmax takes 86-116; Zen 4, no AMX): float32 rows on the CPU
    from CHUNKED_MIN_VOCAB tokens, where the kernels are built. Elsewhere the log-softmax."""
    if not (logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[-1] >= CHUNKED_MIN_VOCAB):  # fmt: skip
        return False
    from decodekit.models import kernels

    return kernels.available()


def scratch_log_softmax(logits: torch.Tensor, slot: str = "chosen logprobs") -> torch.Tensor:
    """log_softmax(logits, -1) of logits [R, V], bit for bit; for large rows on the CPU a view
    of the thread's scratch buffer `slot` (module docstring), valid until that slot's next use
    in this thread: read it before, copy what is kept."""
    if not worth_scratch(logits, logits.dtype):
        return torch.log_softmax(logits, dim=-1)
    return torch.ops.aten._log_softmax.out(logits, -1, False, out=scratch(logits.shape, logits.dtype, slot))


def _uniforms(generators: list[tuple[torch.Generator, int]]) -> torch.Tensor:
    return torch.cat([torch.rand(n, generator=g, dtype=torch.float64, device="cpu") for g, n in generators])


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of probabilities probs [..., V] (weights need not sum to 1) by
    inverting the CDF at a uniform: long [...] (a 0-d tensor for probs [V]).

    Each row uses exactly one float64 uniform from the (CPU) generator, whatever V and the
    device of `probs`, so a seed gives the same draws on every device (None: torch's global
    generator). An index of zero probability is never drawn: the search returns the first i
    with cdf[i] > u * total.
    """
    u = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.float64, device="cpu")  # [...], [0, 1)
    return _invert(probs, u)


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index i of each row of probs [..., V] with cdf[i] > u * total, u [...]."""
    return _search(torch.cumsum(probs.double(), dim=-1), u)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index i of each row of cdf [..., V] with cdf[i] > u * cdf[-1], u [...]."""
    # to a GPU asynchronously, from pinned memory: no synchronisation of the host
    u = u.pin_memory().to(cdf.device, non_blocking=True) if cdf.is_cuda else u.to(cdf.device)
    target = u[..., None] * cdf[..., -1:]
    tokens = torch.searchsorted(cdf, target, right=True)[..., 0]
    return tokens.clamp(max=cdf.shape[-1] - 1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[r, tokens[r]] for logits [R, V] and tokens [R]: [R] float32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, tokens.to(log_probs.device).long()[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, k: int) -> list[dict[int, float]]:
    """The k most likely tokens of each row of logits [R, V] with their log-probabilities."""
    if k <= 0:
        return [{} for _ in range(logits.shape[0])]
    values, ids = topk_rows(torch.log_softmax(logits.float(), dim=-1), min(k, logits.shape[-1]))
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
