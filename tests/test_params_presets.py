"""Use-case presets (params.PRESETS) are seed 003's table, and `SamplingParams.preset` applies them."""

from __future__ import annotations

import pytest

from decodekit.cli import build_parser, main
from decodekit.cli.generate import sampling_params
from decodekit.params import PRESETS, SamplingParams

# Seed 003 (CS 288, "Sequence Modeling: Generation"): the table's first three columns verbatim,
# tab-separated as in the seed (its Description column left out);
# the seed cites it as "ruv, 2023, ChatGPT API recommendations".
SEED_003_TABLE = """\
Use Case\tTemperature\tTop_p
Code Generation\t0.2\t0.1
Creative Writing\t0.7\t0.8
Chatbot Responses\t0.5\t0.5
Code Comment Generation\t0.3\t0.2
Data Analysis Scripting\t0.2\t0.1
Exploratory Code Writing\t0.6\t0.7
"""
# The seed's row -> our preset name.
NAMES = {"Code Generation": "code-generation", "Creative Writing": "creative-writing",
         "Chatbot Responses": "chatbot", "Code Comment Generation": "code-comments",
         "Data Analysis Scripting": "data-analysis", "Exploratory Code Writing": "exploratory-code"}


def seed_rows() -> dict[str, tuple[float, float]]:
    rows = [line.split("\t") for line in SEED_003_TABLE.splitlines()[1:]]
    return {NAMES[use]: (float(t), float(p)) for use, t, p in rows}


def test_presets_are_the_seed_table():
    assert seed_rows() == PRESETS
    for name, (temperature, top_p) in seed_rows().items():
        params = SamplingParams.preset(name)
        assert (params.temperature, params.top_p) == (temperature, top_p)
        assert params.replace(temperature=1.0, top_p=1.0) == SamplingParams()  # nothing else set


def test_overrides_win_and_are_validated():
    params = SamplingParams.preset("creative-writing", temperature=0.9, max_new_tokens=5, seed=1)
    assert (params.temperature, params.top_p, params.max_new_tokens, params.seed) == (0.9, 0.8, 5, 1)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.preset("chatbot", top_p=1.5)


def test_unknown_preset_names_the_allowed_ones():
    with pytest.raises(ValueError, match="preset must be one of code-generation, creative-writing.*"
                                         "got 'poetry'"):
        SamplingParams.preset("poetry")


def test_cli_preset_and_its_errors(capsys):
    args = build_parser().parse_args(["generate", "x", "--preset", "code-comments", "--top-p", "0.9"])
    params = sampling_params(args)
    assert (params.temperature, params.top_p) == (0.3, 0.9)
    assert main(["generate", "x", "--preset", "poetry"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "preset must be one of" in err and "'poetry'" in err
    assert main(["generate", "x", "--preset", "chatbot", "--strategy", "greedy"]) == 2
    assert "takes no --preset" in capsys.readouterr().err
