import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from decodekit.models.base import prefill
from decodekit.models.registry import load_model


@pytest.fixture(scope="module")
def hf_pair(tiny_llama_dir):
    ours = load_model(tiny_llama_dir, backend="hf")
    theirs = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return ours, theirs


def test_logits_identical_to_transformers(hf_pair):
    ours, theirs = hf_pair
    tokens = torch.tensor([ours.encode("ROMEO: But soft, what light")])
    logits = ours.forward(tokens, ours.new_cache(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
    assert torch.equal(logits, expected)


def test_left_padded_batch_matches_rows_alone(hf_pair):
    ours, _ = hf_pair
    prompts = [ours.encode("JULIET: O Romeo"), ours.encode("the sun")]
    last, cache = prefill(ours, prompts)
    step = torch.tensor([[5], [7]])
    nxt = ours.forward(step, cache)[:, -1]
    for row, prompt in enumerate(prompts):
        alone_last, alone_cache = prefill(ours, [prompt])
        alone_next = ours.forward(step[row : row + 1], alone_cache)[:, -1]
        torch.testing.assert_close(last[row], alone_last[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(nxt[row], alone_next[0], atol=1e-5, rtol=1e-5)


def test_cache_fork_select_crop(hf_pair):
    ours, _ = hf_pair
    prompt = ours.encode("ROMEO: But soft")
    _, cache = prefill(ours, [prompt])
    forked = cache.fork([0, 0])
    extra = torch.tensor([[3, 4], [9, 9]])
    out = ours.forward(extra, forked)[:, -1]
    _, fresh = prefill(ours, [prompt + [9, 9]])
    fresh_last = ours.forward(torch.tensor([[1]]), fresh)[:, -1]
    # crop row back, extend differently: equals never-extended.
    forked.crop(len(prompt) + 1)
    forked.select([1])
    cropped = ours.forward(torch.tensor([[9]]), forked)[:, -1]
    _, ref = prefill(ours, [prompt + [9]])
    ref_next = ours.forward(torch.tensor([[9]]), ref)[:, -1]
    torch.testing.assert_close(cropped, ref_next, atol=1e-5, rtol=1e-5)
    assert out.shape == (2, ours.vocab_size)
    assert fresh_last.shape == (1, ours.vocab_size)
    # the original cache is untouched by the fork's growth
    assert cache.length == len(prompt)


def test_missing_path_and_unknown_name():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("./no/such/dir")
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="backend must be"):
        load_model("shakespeare", backend="gpu")


def test_reward_model_names_are_not_language_models():
    with pytest.raises(ValueError, match="'arith-orm' is a reward model"):
        load_model("arith-orm")


def test_forward_uses_transformers_current_cache_argument(hf_pair):
    """transformers 5 renamed forward's `past_key_values` to `cache`; the old name raised a
    FutureWarning on every run of a model on this path (issue 26)."""
    ours, _ = hf_pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        last, cache = prefill(ours, [ours.encode("ROMEO: But soft")])
        ours.forward(torch.tensor([[5]]), cache)
    assert cache.length == len(ours.encode("ROMEO: But soft")) + 1


def test_loading_bars_only_when_asked(tiny_llama_dir, capfd):
    from transformers.utils import logging

    from decodekit.models.hf import HFModelLM

    HFModelLM.from_pretrained(tiny_llama_dir)
    assert "Loading weights" not in capfd.readouterr().err
    HFModelLM.from_pretrained(tiny_llama_dir, progress=True)
    assert "Loading weights" in capfd.readouterr().err
    assert logging.is_progress_bar_enabled()  # transformers' own setting is left as it was
