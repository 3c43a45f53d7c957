"""Each adapter declares its properties (sampling/adapters.py), and the declarations are true:
an adapter whose output changes when only the history changes says it reads the history
(speculative decoding is exact only then), and a row-wise one ignores everything but the
logits and its fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decodekit.params import DEFAULT_ORDER, DESCRIPTIONS, RANGES, SamplingParams
from decodekit.sampling import SamplerState
from decodekit.sampling.adapters import ADAPTERS, Adapter
from decodekit.sampling.chain import ROWWISE, build_chain

V = 8
LOGITS = torch.linspace(2.0, -1.5, V).repeat(2, 1)  # [2, V]: two rows
PROMPT = (1, 2, 3)
# Two states: A has generated nothing, B this history after the prompt: its last token 2 came
# before 3 in the prompt (an n-gram and a DRY repeat), the bad word 3 -> 5 fires after A's
# prompt but not after B's 2, and B's 4 tokens satisfy min_new_tokens=2.
HISTORY = (4, 3, 6, 2)
# Each adapter at a value where it acts.
ON = {
    "logit_bias": {"logit_bias": {5: 1.0}},
    "allowed_tokens": {"allowed_token_ids": (0, 2, 4)},
    "bad_words": {"bad_words": ((3, 5),)},
    "min_tokens": {"min_new_tokens": 2},
    "no_repeat_ngram": {"no_repeat_ngram_size": 2},
    "repetition_penalty": {"repetition_penalty": 1.5},
    "frequency_presence": {"frequency_penalty": 0.5, "presence_penalty": 0.25},
    "dry": {"dry_multiplier": 1.0, "dry_allowed_length": 1},
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 3},
    "top_p": {"top_p": 0.6},
    "min_p": {"min_p": 0.2},
    "typical": {"typical_p": 0.5},
    "epsilon": {"epsilon": 0.05},
    "eta": {"eta": 0.05},
    "top_n_sigma": {"top_n_sigma": 0.5},
    "xtc": {"xtc_probability": 1.0, "xtc_threshold": 0.05},
    "mirostat": {"mirostat_tau": 2.0, "mirostat_eta": 1.0},
}


def state(params: SamplingParams, history=(), seed=0) -> SamplerState:
    """A state of two rows that accepted `history` (mirostat's mu moves with it)."""
    state = SamplerState(params.replace(seed=seed), PROMPT, 2, V, eos_token_ids=(0,))
    for token in history:
        state.accept([token, token], LOGITS)
    return state


def check_declaration(adapter: type[Adapter], on: dict) -> None:
    """An adapter's declared properties against its behaviour at the values `on`."""
    params = SamplingParams(**on)
    assert adapter.active(params) and not adapter.active(SamplingParams()), adapter.name
    run = adapter(params)
    fresh, later = run(LOGITS, state(params)), run(LOGITS, state(params, HISTORY))
    acts = not (torch.equal(fresh, LOGITS) and torch.equal(later, LOGITS))
    assert acts, f"{adapter.name} does nothing at {on}"
    history_matters = not torch.equal(fresh, later)
    assert adapter.reads_history == history_matters, (
        f"{adapter.name}: reads_history={adapter.reads_history}, but the history "
        f"{'changes' if history_matters else 'does not change'} its output")
    # index-free: tokens at -inf between the others leave the others' output be (with and
    # without the history, whose token ids a history reader acts on)
    padded = torch.full((2, 2 * V + 1), float("-inf"))
    padded[:, 1::2] = LOGITS  # [-inf, l0, -inf, l1, ..., -inf]
    blind = True
    for history, plain in (((), fresh), (HISTORY, later)):
        spread = run(padded, state(params, history))
        blind &= torch.equal(spread[:, 1::2], plain) and bool(torch.isneginf(spread[:, ::2]).all())
    assert adapter.index_free == blind, (
        f"{adapter.name}: index_free={adapter.index_free}, but tokens at -inf between the others "
        f"{'leave its output be' if blind else 'change its output'}")
    if adapter.rowwise:
        reseeded = run(LOGITS, state(params, HISTORY, seed=1))
        assert torch.equal(fresh, reseeded), f"{adapter.name} is declared row-wise but reads its state"
        # the row-wise key compares its `fields` only: every other field must leave it be
        others = {k: v for values in ON.values() for k, v in values.items() if k not in adapter.fields}
        changed = adapter(SamplingParams(**{**others, **on}))(LOGITS, state(params))
        assert torch.equal(fresh, changed), f"{adapter.name} reads a field it does not declare"


def test_every_adapter_in_the_default_order_declares_all_its_properties():
    assert tuple(ADAPTERS) == DEFAULT_ORDER
    assert set(ON) == set(DEFAULT_ORDER)  # a new adapter gets its values here, and is checked
    names = set(SamplingParams.field_names())
    for name, adapter in ADAPTERS.items():
        assert adapter.name == name and issubclass(adapter, Adapter)
        assert isinstance(adapter.reads_history, bool) and isinstance(adapter.rowwise, bool), name
        assert isinstance(adapter.index_free, bool), name
        assert not (adapter.reads_history and adapter.rowwise), name
        assert adapter.fields and set(adapter.fields) <= names, (name, adapter.fields)
        for field in adapter.fields:
            assert DESCRIPTIONS[field], field  # the server's and the docs' line
        assert set(ON[name]) & set(adapter.fields), f"ON[{name!r}] sets none of its fields"
    kinds = ("int", "float", "float | None")
    numeric = {f.name for f in dataclasses.fields(SamplingParams) if f.type in kinds}
    declared = {f for adapter in ADAPTERS.values() for f in adapter.fields}
    assert numeric & declared <= set(RANGES)  # every numeric adapter field has a range


@pytest.mark.parametrize("name", DEFAULT_ORDER)
def test_declared_properties_match_behaviour(name):
    check_declaration(ADAPTERS[name], ON[name])


def test_a_history_reading_adapter_marked_history_free_is_caught(monkeypatch):
    # What the check exists for: penalties declared history-free would let speculative
    # decoding process a block's positions at once, each blind to the drafts before it.
    monkeypatch.setattr(ADAPTERS["repetition_penalty"], "reads_history", False)
    with pytest.raises(AssertionError, match="reads_history=False, but the history changes"):
        check_declaration(ADAPTERS["repetition_penalty"], ON["repetition_penalty"])
    monkeypatch.setattr(ADAPTERS["top_k"], "reads_history", True)
    with pytest.raises(AssertionError, match="does not change"):
        check_declaration(ADAPTERS["top_k"], ON["top_k"])


def test_the_lists_of_adapters_are_derived_from_the_declarations():
    from decodekit.decode.speculative import history_free
    from decodekit.server.lab import ADAPTER_FIELDS

    assert {name for name, adapter in ADAPTERS.items() if adapter.rowwise} == ROWWISE
    assert {name: adapter.fields for name, adapter in ADAPTERS.items()} == ADAPTER_FIELDS
    for name, on in ON.items():
        assert history_free(SamplingParams(**on)) == (not ADAPTERS[name].reads_history), name
    # an adapter left out of the order reads nothing, whatever its values
    order = tuple(n for n in DEFAULT_ORDER if n != "repetition_penalty")
    assert history_free(SamplingParams(repetition_penalty=1.5, order=order))


def test_rowwise_chains_of_equal_settings_share_a_key():
    one = SamplingParams(top_k=3, logit_bias={5: 1.0, 2: 0.5})
    other = SamplingParams(top_k=3, logit_bias={2: 0.5, 5: 1.0})
    assert build_chain(one).rowwise_key == build_chain(other).rowwise_key is not None
    assert build_chain(one).rowwise_key != build_chain(one.replace(top_k=4)).rowwise_key
    assert build_chain(one).rowwise_key != build_chain(one.replace(min_tokens_to_keep=2)).rowwise_key
    assert build_chain(one.replace(repetition_penalty=1.2)).rowwise_key is None  # reads the history
