"""The arith models' tokenizer (issue 38): byte-level spelled, so that llguidance reads it
(constrained decoding), and still one token per character: the ids and text of the arith
data are those of the character-level tokenizer with a Fuse decoder it replaced."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from decodekit.meta.tasks.arith import format_prompt, format_solution, generate_problems
from decodekit.models.registry import ASSETS

ARITH = ["arith", "arith-small", "arith-large", "arith-hf-orm", "arith-hf-prm"]


def character_level(shipped: dict) -> Tokenizer:
    """The tokenizer as it was: the same ids, each token its character, a Fuse decoder."""
    byte_level = Tokenizer.from_str(json.dumps(shipped))
    old = json.loads(json.dumps(shipped))
    old["model"]["vocab"] = {byte_level.decode([i]) if not token.startswith("<") else token: i
                             for token, i in shipped["model"]["vocab"].items()}
    old["pre_tokenizer"] = shipped["pre_tokenizer"]["pretokenizers"][0]
    old["decoder"] = {"type": "Fuse"}
    return Tokenizer.from_str(json.dumps(old))


@pytest.mark.parametrize("name", ARITH)
def test_ids_and_text_equal_the_character_level_tokenizer(name):
    shipped = json.loads((ASSETS / name / "tokenizer.json").read_text())
    new, old = Tokenizer.from_str(json.dumps(shipped)), character_level(shipped)
    assert shipped["decoder"]["type"] == "ByteLevel" and old.get_vocab_size() == new.get_vocab_size() == 37
    texts = [format_prompt(p) + format_solution(p) for p in generate_problems(500, seed=0)]
    texts += ["", " \n\n  ", "Compute: 1+2=\n<|endoftext|>", "USER: héllo\tZ 日本 🤖<unk>"]
    for text in texts:
        ids = new.encode(text).ids
        assert ids == old.encode(text).ids, text
        assert new.decode(ids) == old.decode(ids) and new.decode(ids, skip_special_tokens=False) == \
            old.decode(ids, skip_special_tokens=False)
    assert new.decode(new.encode(texts[0]).ids) == texts[0]


def test_llguidance_reads_it_and_the_old_one_it_did_not():
    llguidance = pytest.importorskip("llguidance")
    shipped = json.loads((ASSETS / "arith" / "tokenizer.json").read_text())
    tokenizer = llguidance.LLTokenizer(json.dumps(shipped), n_vocab=37, eos_token=[0])
    assert [tokenizer.decode_bytes([i]) for i in (2, 17, 18, 19)] == [b"0", b" ", b"\n", b"A"]
    with pytest.raises(ValueError, match="can't determine decoder type"):
        llguidance.LLTokenizer(character_level(shipped).to_str(), n_vocab=37, eos_token=[0])
