"""models/attention.py: decode attention's two formulations (eager kernels, written out for
tracing) equal a softmax computed by hand over [prefix, row, new key], with masks, grouped
query heads and shared prefixes, and torch.compile traces it; T new queries a row (the
compiled verification step's) attend causally among their new keys as `prefill_attention`
under a mask does; one query per row of `prefill_attention` is `decode_attention`'s."""

from __future__ import annotations

import pytest
import torch

from decodekit.models.attention import (
    LSE_KERNEL,
    SharedKV,
    attend_alone,
    decode_attention,
    prefill_attention,
)

B, H, H_KV, D, S, P = 3, 4, 2, 8, 7, 5


def tensors(seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, D, generator=generator)  # one new query a row
    keys, values = torch.randn(2, B, H_KV, S, D, generator=generator)
    new = tuple(torch.randn(2, B, 1, H_KV, D, generator=generator))
    prefix_keys, prefix_values = torch.randn(2, 1, H_KV, P, D, generator=generator)
    stored = torch.tensor([7, 3, 1])  # positions each row holds
    visible = (torch.arange(S)[None, :] < stored[:, None])[:, None, None]  # [B, 1, 1, S]
    return q, keys, values, visible, new, prefix_keys, prefix_values


def by_hand(q, keys, values, visible, new=None, prefix=None, sees=None) -> torch.Tensor:
    """Each row and query head alone, float64: softmax over the keys it sees, then the values.
    [B, 1, H, D]."""
    out = torch.empty(B, 1, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // (H // H_KV)
            k, v = keys[b, kv][visible[b, 0, 0]], values[b, kv][visible[b, 0, 0]]
            if prefix is not None:
                seen = sees[b, 0, 0] if sees is not None else torch.ones(P, dtype=torch.bool)
                k, v = torch.cat([prefix[0][0, kv][seen], k]), torch.cat([prefix[1][0, kv][seen], v])
            if new is not None:
                k, v = torch.cat([k, new[0][b, :, kv]]), torch.cat([v, new[1][b, :, kv]])
            weights = (k.double() @ q[b, 0, h].double() / D**0.5).softmax(0)
            out[b, 0, h] = weights @ v.double()
    return out.float()


@pytest.mark.parametrize("written_out", [False, True])
def test_decode_attention_over_rows_and_new_keys_equals_the_softmax_by_hand(written_out):
    q, keys, values, visible, new, *_ = tensors(0)
    for row_new in (None, new):
        got = decode_attention(q, keys, values, visible, new=row_new, written_out=written_out)
        torch.testing.assert_close(got, by_hand(q, keys, values, visible, row_new), atol=1e-5, rtol=1e-5)
    additive = torch.zeros(visible.shape).masked_fill(~visible, -torch.inf)  # the eager engine's form
    got = decode_attention(q, keys, values, additive, written_out=written_out)
    torch.testing.assert_close(got, by_hand(q, keys, values, visible), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(LSE_KERNEL is None, reason="this torch build has no CPU flash kernel with LSE")
@pytest.mark.parametrize("written_out", [False, True])
def test_a_shared_prefix_is_merged_as_one_softmax(written_out):
    """Rows that continue a prefix (the eager step names them, `rows`; the compiled step gives
    each row its span, `sees`, which only the written-out form takes) attend over it and
    their own keys as one softmax; the eager form merges the two parts by log-sum-exp."""
    q, keys, values, visible, new, prefix_keys, prefix_values = tensors(1)
    prefix = (prefix_keys, prefix_values)
    rows = SharedKV(prefix_keys, prefix_values, rows=torch.tensor([0, 2]))  # row 1 continues none
    for row_new in (None, new):
        got = decode_attention(q, keys, values, visible, row_new, [rows], written_out=written_out)
        want = by_hand(q, keys, values, visible, row_new, prefix)
        torch.testing.assert_close(got[[0, 2]], want[[0, 2]], atol=1e-5, rtol=1e-5)
        alone = by_hand(q, keys, values, visible, row_new)[1]
        torch.testing.assert_close(got[1], alone, atol=1e-5, rtol=1e-5)
    sees = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)[:, None, None]
    got = decode_attention(q, keys, values, visible, new, [SharedKV(prefix_keys, prefix_values, sees=sees)])
    want = by_hand(q, keys, values, visible, new, prefix, sees)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_compile_traces_the_written_out_form():
    q, keys, values, visible, new, prefix_keys, prefix_values = tensors(2)
    sees = torch.ones(B, 1, 1, P, dtype=torch.bool)

    def step(q, keys, values, visible, new_keys, new_values, prefix_keys, prefix_values, sees):
        prefix = SharedKV(prefix_keys, prefix_values, sees=sees)
        return decode_attention(q, keys, values, visible, (new_keys, new_values), [prefix])

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q, keys, values, visible, *new, prefix_keys, prefix_values, sees)
    want = by_hand(q, keys, values, visible, new, (prefix_keys, prefix_values), sees)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_one_query_per_row_of_prefill_is_decode_and_attend_alone_is_the_unmasked_query():
    q, keys, values, visible, *_ = tensors(3)
    got = prefill_attention(q.transpose(1, 2), keys, values, visible, causal=False).transpose(1, 2)
    assert torch.equal(got, decode_attention(q, keys, values, visible))
    seen = int(visible[1].sum())
    alone = attend_alone(q[1, 0], keys[1, :, :seen], values[1, :, :seen])
    torch.testing.assert_close(alone, by_hand(q, keys, values, visible)[1, 0], atol=1e-5, rtol=1e-5)


def spans(seed: int, batch=2, count=5, heads=8, kv_heads=4, dim=16, width=37, length=6):
    """T = count new queries a row, their new keys, stored keys of which each row sees
    `stored`, and a shared prefix of `length` positions."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, count, heads, dim, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, width, dim, generator=generator) for _ in range(2))
    new = tuple(torch.randn(batch, count, kv_heads, dim, generator=generator) for _ in range(2))
    prefix = tuple(torch.randn(1, kv_heads, length, dim, generator=generator) for _ in range(2))
    stored = [30, 37]
    visible = (torch.arange(width)[None, :] < torch.tensor(stored)[:, None])[:, None, None]  # [B, 1, 1, S]
    return q, keys, values, visible, new, prefix, stored


def span_by_prefill(q, keys, values, new, prefix, stored, sees) -> torch.Tensor:
    """prefill_attention row by row over [the prefix positions it sees, its visible keys, the
    span's keys], the span's under the causal mask: [B, T, H, D]."""
    count = q.shape[1]
    out = []
    for row, length in enumerate(stored):
        seen = sees[row]  # [P] bool
        k = torch.cat([prefix[0][0][:, seen], keys[row, :, :length], new[0][row].transpose(0, 1)], dim=1)
        v = torch.cat([prefix[1][0][:, seen], values[row, :, :length], new[1][row].transpose(0, 1)], dim=1)
        before = int(seen.sum()) + length
        mask = torch.ones(count, before + count, dtype=torch.bool)
        mask[:, before:] = torch.ones(count, count, dtype=torch.bool).tril()
        want = prefill_attention(q[row : row + 1].transpose(1, 2), k[None], v[None], mask[None, None], False)
        out.append(want[0].transpose(0, 1))
    return torch.stack(out)


def test_a_span_attends_over_its_rows_keys_and_causally_over_its_own():
    # T new queries a row (the compiled verification step's) against prefill_attention over the
    # row's visible keys with the span's keys appended, under the causal mask among them
    q, keys, values, visible, new, prefix, stored = spans(3)
    out = decode_attention(q, keys, values, visible, new)  # [B, T, H, D]
    nothing = torch.zeros(len(stored), prefix[0].shape[2], dtype=torch.bool)
    torch.testing.assert_close(out, span_by_prefill(q, keys, values, new, prefix, stored, nothing),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.skipif(LSE_KERNEL is None, reason="this torch build has no CPU flash kernel with LSE")
def test_a_span_over_a_shared_prefix():
    """T > 1 takes shared prefixes as T = 1 does: by `sees` (the compiled step's form) with new
    keys; by `rows` without new keys also in the eager kernels' form (merged by log-sum-exp)."""
    q, keys, values, visible, new, prefix, stored = spans(4)
    sees = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # [B, P]
    out = decode_attention(q, keys, values, visible, new, [SharedKV(*prefix, sees=sees[:, None, None])])
    want = span_by_prefill(q, keys, values, new, prefix, stored, sees)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    continuing = SharedKV(*prefix, rows=torch.tensor([1]))  # row 0 continues none
    eager = decode_attention(q, keys, values, visible, None, [continuing], written_out=False)
    written = decode_attention(q, keys, values, visible, None, [continuing], written_out=True)
    torch.testing.assert_close(eager, written, rtol=1e-5, atol=1e-5)
    # each query of a row sees the same keys: the span's query t is a one-query step's
    one = decode_attention(q[:, 2:3], keys, values, visible, None, [continuing], written_out=False)
    torch.testing.assert_close(eager[:, 2:3], one, rtol=1e-5, atol=1e-5)


def test_a_one_query_step_builds_no_causal_mask():
    # the compiled decode step (T = 1) is the hot path: its written-out graph scores the one
    # new key by a dot product and builds no [G * T, T] mask; a span's does
    q, keys, values, visible, new, *_ = tensors(5)
    span_q, span_keys, span_values, span_visible, span_new, *_ = spans(5)

    def attend(q, keys, values, visible, new_keys, new_values):
        return decode_attention(q, keys, values, visible, (new_keys, new_values), written_out=True)

    def ops(*args) -> set[str]:
        graph = torch.fx.experimental.proxy_tensor.make_fx(attend)(*args).graph
        return {str(node.target) for node in graph.nodes if node.op == "call_function"}

    assert "aten.tril.default" not in ops(q, keys, values, visible, *new)
    assert "aten.tril.default" in ops(span_q, span_keys, span_values, span_visible, *span_new)
