"""Every path on a CUDA device (issue 15, item 1): generate, the engine, speculative decoding,
bfloat16 and compressed models, each against the same run on the CPU. Marked `cuda`; they
skip on a machine without a GPU (`pytest -m cuda` selects them)."""

from __future__ import annotations

import pytest
import torch

import decodekit as dk
from decodekit.models.base import prefill

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]  # fmt: skip

GREEDY = dk.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
IDS = [0, 5, 17, 300, 1200, 42, 9]


@pytest.fixture(scope="module")
def pair():
    return dk.load_model("shakespeare"), dk.load_model("shakespeare", device="cuda")


def test_weights_cache_and_logits_live_on_the_device(pair):
    cpu, gpu = pair
    assert {p.device.type for p in gpu.net.parameters()} == {"cuda"}
    assert gpu.new_cache(1).keys.device.type == "cuda"
    logits = prefill(gpu, [IDS])[0]
    assert logits.device.type == "cuda" and logits.dtype == torch.float32
    torch.testing.assert_close(logits.cpu(), prefill(cpu, [IDS])[0], rtol=1e-3, atol=1e-3)


def test_generate_greedy_gives_the_cpus_tokens(pair):
    cpu, gpu = pair
    [a], [b] = dk.generate(cpu, ["ROMEO:"], GREEDY), dk.generate(gpu, ["ROMEO:"], GREEDY)
    assert a[0].token_ids == b[0].token_ids


def test_the_engine_batches_seeded_samples_on_the_device(pair):
    _, gpu = pair
    params = dk.SamplingParams(max_new_tokens=16, n=3, seed=7, ignore_eos=True, top_p=0.9,
                               repetition_penalty=1.1, logprobs=2)  # fmt: skip
    first = dk.generate(gpu, ["ROMEO:", "JULIET: O Romeo"], params)
    again = dk.generate(gpu, ["ROMEO:", "JULIET: O Romeo"], params)
    assert [[c.token_ids for c in group] for group in first] == [[c.token_ids for c in g] for g in again]
    assert all(len(c.token_ids) == 16 and len(c.top_logprobs) == 16 for group in first for c in group)


def test_speculative_decoding_on_the_device_matches_greedy(pair):
    cpu, gpu = pair
    draft = dk.load_model("shakespeare-draft", device="cuda")
    result = dk.speculative_generate(gpu, draft, "ROMEO:", GREEDY)
    [expected] = dk.generate(cpu, "ROMEO:", GREEDY)
    assert result.completions[0].token_ids == expected.token_ids


def test_bfloat16_on_the_device():
    model = dk.load_model("shakespeare", dtype="bfloat16", device="cuda")
    [completion] = dk.generate(model, "ROMEO:", GREEDY)
    assert len(completion.token_ids) == 24
    assert prefill(model, [IDS])[0].dtype == torch.float32


def test_a_compressed_model_on_the_device(tmp_path):
    from decodekit.compress import CompressConfig, compress_to_dir

    compress_to_dir("shakespeare", CompressConfig("rtn", bits=8), tmp_path / "int8")
    cpu = dk.load_model(tmp_path / "int8")
    gpu = dk.load_model(tmp_path / "int8", device="cuda")
    torch.testing.assert_close(prefill(gpu, [IDS])[0].cpu(), prefill(cpu, [IDS])[0], rtol=1e-3, atol=1e-3)
    [completion] = dk.generate(gpu, "ROMEO:", GREEDY)
    assert len(completion.token_ids) == 24
