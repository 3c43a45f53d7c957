"""StaticDecodeLM (models/static.py): the static-shape decode step equals NativeLM's forward,
eagerly and compiled, and everything it does not run falls back to the wrapped model."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_native import FAMILIES, PROMPTS, save_family

import decodekit as dk
from decodekit.models.native import NativeLM
from decodekit.models.static import StaticDecodeLM, StaticKVCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GREEDY = dk.SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama3-rope"])
def native(request, tmp_path_factory) -> NativeLM:
    path = tmp_path_factory.mktemp(f"static-{request.param}")
    save_family(request.param, path)
    return NativeLM.from_pretrained(path)


def step_by_step(model, prompt: list[int], steps: int) -> torch.Tensor:
    """Logits [steps + 1, V]: the prompt's last position, then each greedy token's."""
    cache = model.new_cache(1)
    logits = [model.forward(torch.tensor([prompt]), cache)[0, -1]]
    for _ in range(steps):
        logits.append(model.forward(logits[-1].argmax().view(1, 1), cache)[0, -1])
    return torch.stack(logits)


def test_the_eager_static_step_equals_the_native_forward(native):
    """Biases (qwen2), per-head q/k norms (qwen3), llama3 RoPE: the same maths, step by step."""
    static = StaticDecodeLM(native, capacity=48, compile=False)
    for prompt in PROMPTS:
        expected = step_by_step(native, prompt, 20)
        got = step_by_step(static, prompt, 20)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert static.steps == 20 * len(PROMPTS)  # every one-token step took the static path
    tokens = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(static.hidden_states(tokens), native.hidden_states(tokens))


def test_the_compiled_step_gives_generates_greedy_tokens(tiny_lm):
    static = StaticDecodeLM(tiny_lm)
    prompt = tiny_lm.encode("ROMEO: But soft")
    expected = dk.generate(tiny_lm, [prompt], GREEDY)[0][0]
    got = dk.generate(static, [prompt], GREEDY)[0][0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert static.steps == len(expected.token_ids) - 1
    assert static._step is not static._eager  # it compiled (no fallback warning path taken)


def test_embedded_model_greedy_tokens_equal_generate():
    model = dk.load_model("shakespeare")
    static = StaticDecodeLM(model, capacity=256, compile=False)
    params = dk.SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    expected = dk.generate(model, "ROMEO:", params)[0].token_ids
    assert dk.generate(static, "ROMEO:", params)[0].token_ids == expected


def test_several_rows_and_samples_fall_back_to_the_wrapped_model(native):
    """n > 1 forks the one-row static cache into an ordinary one; several prompts never use it.
    Seeded samples equal the wrapped model's, which draws them on the engine."""
    static = StaticDecodeLM(native, capacity=48, compile=False)
    params = dk.SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, n=3, ignore_eos=True)
    for prompts in ([PROMPTS[0]], PROMPTS):
        got = dk.generate(static, prompts, params)
        expected = dk.generate(native, prompts, params)
        assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in expected]
    assert static.steps == 0


def test_generation_stops_at_the_capacity(native):
    static = StaticDecodeLM(native, capacity=16, compile=False)
    [[completion]] = dk.generate(static, [PROMPTS[0]], dk.SamplingParams(temperature=0, max_new_tokens=40))
    assert len(PROMPTS[0]) + len(completion.token_ids) == 16 and completion.finish_reason == "length"
    cache = static.new_cache(1)
    assert isinstance(cache, StaticKVCache)
    with pytest.raises(ValueError, match="17 positions do not fit the static decode capacity of 16"):
        static.forward(torch.zeros((1, 17), dtype=torch.long), cache)


def test_fork_and_select_of_the_static_cache(native):
    static = StaticDecodeLM(native, capacity=32, compile=False)
    cache = static.new_cache(1)
    static.forward(torch.tensor([PROMPTS[1]]), cache)
    one, three = cache.fork([0]), cache.fork([0, 0, 0])
    assert isinstance(one, StaticKVCache) and not isinstance(three, StaticKVCache)
    token = torch.tensor([[4]])
    first = static.forward(token, one)[0, -1]
    assert static.steps == 1
    rows = static.forward(token.expand(3, 1), three)[:, -1]
    torch.testing.assert_close(rows, first.expand(3, -1), atol=2e-5, rtol=1e-5)
    cache.select([0])
    with pytest.raises(ValueError, match="rows must be a non-empty list of ints in"):
        cache.select([1])


def test_refusals_name_the_value(native, tiny_lm, tmp_path):
    with pytest.raises(TypeError, match="StaticDecodeLM wraps a NativeLM, got str"):
        StaticDecodeLM("shakespeare")
    with pytest.raises(ValueError, match=r"capacity must be in \[1, 64\] \(the context\), got 65"):
        StaticDecodeLM(native, capacity=65)
    config = transformers.MistralConfig(**{**FAMILIES["mistral"]().to_dict(), "sliding_window": 8})
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding-window"):
        StaticDecodeLM(NativeLM.from_pretrained(tmp_path))


def test_cli_static_decode_prints_generates_text_and_refuses_the_rest(capsys, tiny_llama_dir, tiny_lm):
    from decodekit.cli import main

    code = main(["generate", "ROMEO:", "--model", str(tiny_llama_dir), "--static-decode", "--strategy",
                 "greedy", "--max-new-tokens", "12", "--threads", "1"])  # fmt: skip
    expected = dk.generate(tiny_lm, "ROMEO:", dk.SamplingParams(temperature=0, max_new_tokens=12))[0].text
    assert code == 0 and capsys.readouterr().out == "ROMEO:" + expected + "\n"
    for args, message in ((["--strategy", "beam"], "--static-decode works with --strategy greedy or sample"),
                          (["--model", "shakespeare-5gram"], "'shakespeare-5gram' loads as NGramLM")):
        assert main(["generate", "ROMEO:", "--static-decode", *args]) != 0
        assert message in capsys.readouterr().err
