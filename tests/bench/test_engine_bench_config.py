"""`bench engine`'s 64 concurrent requests run together (issue 33): with a KV bound of 64 MiB
the pool of a model with llama-3.2-1b's KV shape (16 layers, 8 key heads of 64) held 31 of the
64 requests at most, 13 a step at the median, so the engine decoded them in 606 steps where
transformers' batch takes 128; its GPU ratio measured that, not the engine."""

from __future__ import annotations

import torch

import decodekit as dk
from decodekit.bench.engine import CONCURRENT, engine_config, prompts_from_text
from decodekit.engine import Engine
from decodekit.models import shapes
from decodekit.models.checkpoint import load_tokenizer
from decodekit.models.native import NativeLM


def kv_probe(shape: str) -> NativeLM:
    """Random weights with `shape`'s KV geometry (layers, key heads, head size) and dtype, at
    tiny widths: the pool's size depends on nothing else."""
    config = shapes.shape_config(shape, "bfloat16")
    kv_heads = config["num_key_value_heads"]
    config.update(hidden_size=64 * kv_heads, intermediate_size=64, num_attention_heads=kv_heads)
    state = shapes.random_state_dict(config, 0)
    tokenizer = load_tokenizer(shapes.TOKENIZER_DIR)
    return NativeLM.from_state_dict(config, state, torch.bfloat16, name="kv-probe", tokenizer=tokenizer,
                                    eos_token_ids=(0,))  # fmt: skip


def test_the_64_concurrent_requests_all_run_at_once():
    model = kv_probe("llama-3.2-1b")
    engine = Engine(model, engine_config(False, model))
    prompts = prompts_from_text(model, CONCURRENT["requests"], CONCURRENT["prompt_lengths"])
    params = dk.SamplingParams(max_new_tokens=CONCURRENT["new_tokens"], seed=0, ignore_eos=True)
    for prompt in prompts:
        engine.submit(prompt, params)
    for _ in range(3):  # the prompts' steps (4,096 prompt tokens a step), then decoding
        engine.step()
    assert len(engine.running_kv) == CONCURRENT["requests"] == 64
    assert not engine.scheduler.waiting
