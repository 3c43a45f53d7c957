"""Token-wise controlled decoding with a Q head on the engine (align/qvalue.py `step_values`):
the step's own forward hands each row its final hidden state, so a token costs one forward,
and the tokens equal those of the path that recomputes every prefix (`child_values`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from decodekit.align.controlled import ValueTilt
from decodekit.align.qvalue import HiddenValue, QHead
from decodekit.decode.sample import _steps, generate
from decodekit.models.native import NativeLM
from decodekit.params import SamplingParams
from decodekit.request import make_requests, to_completion

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPT = "ROMEO: But soft"


@pytest.fixture(scope="module")
def model(tiny_llama_dir, tmp_path_factory) -> NativeLM:
    """The tiny random Llama with room for a prompt and 128 new tokens."""
    path = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 256
    (path / "config.json").write_text(json.dumps(config))
    return NativeLM.from_pretrained(path)


@pytest.fixture(scope="module")
def value(model) -> HiddenValue:
    torch.manual_seed(0)
    head = QHead(model.config.hidden_size, model.vocab_size, width=16, memory=4)
    torch.nn.init.normal_(head.out.weight, std=1.0)  # W2 != 0: the tilt matters
    torch.nn.init.normal_(head.read.weight, std=0.5)  # and so does the memory
    return HiddenValue(model, PROMPT, head)


class Recomputing:
    """The value without its states path: ValueTilt recomputes each prefix (`child_values`)."""

    def __init__(self, value: HiddenValue):
        self.child_values = value.child_values


class Counter:
    """Counts the model's forwards (the network's, the engine's included) and hidden-state
    forwards, and the positions they compute."""

    def __init__(self, model: NativeLM, monkeypatch):
        self.forwards = self.positions = 0
        net_forward, hidden_states = model.net.forward, model.hidden_states

        def counted_net(tokens, *args, **kwargs):
            self.forwards += 1
            self.positions += tokens.numel()
            return net_forward(tokens, *args, **kwargs)

        def counted_states(tokens, mask=None):
            self.forwards += 1
            self.positions += tokens.numel()
            return hidden_states(tokens, mask)

        monkeypatch.setattr(model.net, "forward", counted_net)
        monkeypatch.setattr(model, "hidden_states", counted_states)


def outputs(completions) -> list[tuple]:
    return [(c.token_ids, c.finish_reason) for c in completions]


def test_step_values_take_one_forward_per_token(model, value, monkeypatch):
    params = SamplingParams(max_new_tokens=128, temperature=0, ignore_eos=True)
    tilt = ValueTilt(value, 2.0, top_k=8)
    counter = Counter(model, monkeypatch)
    [[stepped]] = generate(model, [PROMPT], params, adapter=tilt)
    assert len(stepped.token_ids) == 128
    per_token = counter.forwards / 128
    assert per_token <= 1.05, per_token
    assert counter.positions < 2 * 128 + len(model.encode(PROMPT))  # no prefix is recomputed
    # The recomputing path: a forward over the whole prefix at every token.
    counter.forwards = counter.positions = 0
    [[recomputed]] = generate(model, [PROMPT], params, adapter=ValueTilt(Recomputing(value), 2.0, top_k=8))
    assert counter.forwards / 128 >= 2 and counter.positions > 128 * 128 / 2
    assert stepped.token_ids == recomputed.token_ids
    [[untilted]] = generate(model, [PROMPT], params)
    assert untilted.token_ids != stepped.token_ids  # the tilt changes the text


PARAMS = [
    SamplingParams(max_new_tokens=128, temperature=0, ignore_eos=True),
    [SamplingParams(max_new_tokens=128, seed=3, n=3, top_p=0.95, ignore_eos=True),
     SamplingParams(max_new_tokens=40, seed=4, n=4, temperature=1.3,
                    stop_token_ids=list(range(1, 300, 25)))],  # rows that end at different steps
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_engine_states_equal_the_recomputing_path(model, value, params):
    """Token for token against the recomputing path, on the engine and on the plain loop;
    a request for another prompt than the value's recomputes on both."""
    prompts = [PROMPT] if isinstance(params, SamplingParams) else [PROMPT, PROMPT]
    tilt, recomputing = ValueTilt(value, 1.5, top_k=16), ValueTilt(Recomputing(value), 1.5, top_k=16)
    stepped = generate(model, prompts, params, adapter=tilt)
    assert [outputs(c) for c in stepped] == [outputs(c) for c in generate(model, prompts, params,
                                                                            adapter=recomputing)]
    requests = make_requests(model, prompts, params, adapter=tilt)
    assert all(r.wants_hidden for r in requests)
    for _ in _steps(model, requests):  # the plain loop hands no states: child_values
        pass
    assert [outputs(c) for c in stepped] == [outputs([to_completion(row) for row in r.rows])
                                             for r in requests]  # fmt: skip
    assert [outputs(c) for c in stepped] != [outputs(c) for c in generate(model, prompts, params)]


def test_another_prompt_recomputes(model, value):
    params = SamplingParams(max_new_tokens=20, seed=1, n=2)
    tilt = ValueTilt(value, 1.5, top_k=16)
    other = "JULIET: O Romeo"
    assert outputs(generate(model, other, params, adapter=tilt)) == outputs(
        generate(model, other, params, adapter=ValueTilt(Recomputing(value), 1.5, top_k=16)))
