"""score_tokens / score_batch (models/base.py): one forward equals scoring token by token."""

import pytest
import torch

from decodekit.models.base import prefill, score_batch, score_tokens


def stepwise(model, ids, start):
    """log p(ids[t] | ids[:t]) by a fresh prefill of each prefix: the definition."""
    logits = [prefill(model, [ids[:t]])[0][0] for t in range(start, len(ids))]  # each [V]
    return [float(torch.log_softmax(x, -1)[token]) for x, token in zip(logits, ids[start:])]


@pytest.mark.parametrize("fixture", ["toy_lm", "tiny_lm"])
def test_score_tokens_matches_stepwise(fixture, request):
    model = request.getfixturevalue(fixture)
    ids = [1, 3, 2, 5, 4, 1]
    got = score_tokens(model, ids, 2)
    assert got.shape == (4,)
    assert got.tolist() == pytest.approx(stepwise(model, ids, 2), abs=1e-4)


def test_score_batch_pads_rows(toy_lm):
    rows, starts = [[1, 3, 2, 5], [4, 1], [2, 2, 3]], [1, 1, 3]
    got = score_batch(toy_lm, rows, starts)
    for scores, row, start in zip(got, rows, starts):
        assert scores.tolist() == pytest.approx(score_tokens(toy_lm, row, start).tolist(), abs=1e-5)
    assert got[2].shape == (0,)


def test_start_must_leave_a_prefix(toy_lm):
    with pytest.raises(ValueError, match="start must be in"):
        score_tokens(toy_lm, [1, 2], 0)
