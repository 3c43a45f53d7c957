"""models/tokenizer.py: the shipped models' tokenizers without transformers, equal to
transformers' AutoTokenizer on the same directory; which directories fall back to it."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from decodekit.models.checkpoint import load_tokenizer
from decodekit.models.registry import ASSETS
from decodekit.models.tokenizer import FastTokenizer, plain_tokenizer_config

SHIPPED = ["shakespeare", "shakespeare-draft", "arith", "arith-small", "arith-large"]
TEXTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "",
    " ",
    "  leading and trailing  ",
    "line one\nline two\n\n\ttabbed\r\n",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> <|endoftext|>",
    "<unk> and <|endoftext",
    "12+34=46 3*(4-5)/6",
    "naïve café, Straße, Ωμέγα, 日本語, emoji 🤖👍🏽, combining é",
    "zero\u200bwidth and \u00a0no-break",
    "a" * 300,
]


@pytest.fixture(scope="module", params=SHIPPED)
def pair(request):
    path = ASSETS / request.param
    return FastTokenizer.from_directory(path), AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_shipped_models_load_without_transformers():
    for name in SHIPPED:
        assert isinstance(load_tokenizer(ASSETS / name), FastTokenizer), name


@pytest.mark.parametrize("special", [True, False])
def test_encode_equals_transformers(pair, special):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=special) == \
            theirs.encode(text, add_special_tokens=special), text  # fmt: skip


@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers(pair, skip):
    ours, theirs = pair
    sequences = [theirs.encode(text) for text in TEXTS]
    sequences += [list(range(len(theirs))), [0, 0, 5, 0], [len(theirs) - 1]]  # every id; specials
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.batch_decode(sequences, skip_special_tokens=skip) == \
        theirs.batch_decode(sequences, skip_special_tokens=skip)  # fmt: skip
    assert ours.decode(3) == theirs.decode(3)


def test_vocabulary_and_special_tokens_equal_transformers(pair):
    ours, theirs = pair
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    for name in ("eos_token", "bos_token", "unk_token", "eos_token_id", "bos_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    every = list(range(len(theirs)))
    tokens = theirs.convert_ids_to_tokens(every)
    assert ours.convert_ids_to_tokens(every) == tokens
    assert ours.convert_ids_to_tokens(7) == theirs.convert_ids_to_tokens(7)
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("no such token") == theirs.convert_tokens_to_ids("no such token")


def test_tiny_checkpoint_equals_transformers(tiny_llama_dir):
    """The test checkpoint (saved by transformers' save_pretrained: an '<eos>' special token)."""
    ours, theirs = load_tokenizer(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert isinstance(ours, FastTokenizer)
    for text in [*TEXTS, "JULIET:<eos> O Romeo<eos>"]:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id is theirs.bos_token_id is None


def copy_tokenizer(tmp_path, name="shakespeare", **config):
    """The shipped tokenizer in tmp_path, with `config` merged into tokenizer_config.json."""
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSETS / name / file, tmp_path / file)
    merged = {**json.loads((tmp_path / "tokenizer_config.json").read_text()), **config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(merged))
    return tmp_path


@pytest.mark.parametrize("config", [
    {"tokenizer_class": "LlamaTokenizerFast"},  # a model-specific class may rebuild the pipeline
    {"add_bos_token": True},  # rewrites the post-processor
    {"add_prefix_space": True},
    {"clean_up_tokenization_spaces": True},
    {"eos_token": "</s>"},  # not among tokenizer.json's added tokens: transformers would add it
    {"extra_special_tokens": {"image_token": "<image>"}},  # the same, named in a dict
    {"additional_special_tokens": ["<image>"]},
    {"added_tokens_decoder": {"0": {"content": "<|endoftext|>", "special": False}}},
])  # fmt: skip
def test_what_transformers_would_change_falls_back_to_it(tmp_path, config):
    path = copy_tokenizer(tmp_path, **config)
    assert plain_tokenizer_config(path) is None
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, PreTrainedTokenizerBase)


def test_fallback_computes_what_the_fast_path_cannot(tmp_path):
    """Why the fallback matters: transformers adds a special token that tokenizer.json lacks,
    so text containing it splits differently from tokenizer.json alone."""
    path = copy_tokenizer(tmp_path, eos_token="</s>")
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("ROMEO</s>")[-1] == tokenizer.eos_token_id == 2048
    plain = FastTokenizer(Tokenizer.from_file(str(path / "tokenizer.json")))
    assert plain.encode("ROMEO</s>") != tokenizer.encode("ROMEO</s>")


def test_no_tokenizer_json_falls_back(tmp_path):
    path = copy_tokenizer(tmp_path)
    (path / "tokenizer.json").unlink()
    assert plain_tokenizer_config(path) is None


def test_chat_template_renders_through_transformers(tmp_path):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    path = copy_tokenizer(tmp_path, chat_template=template)
    ours = load_tokenizer(path)
    assert isinstance(ours, FastTokenizer) and ours.chat_template == template
    turns = [{"role": "user", "content": "Hi"}]
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(turns, tokenize=False)
    assert ours.apply_chat_template(turns, tokenize=False) == expected == "<user>Hi<assistant>"


def test_save_pretrained_round_trips(tmp_path):
    ours = load_tokenizer(ASSETS / "shakespeare")
    ours.save_pretrained(tmp_path / "copy")
    again = load_tokenizer(tmp_path / "copy")
    assert isinstance(again, FastTokenizer) and again.get_vocab() == ours.get_vocab()
    assert again.encode(TEXTS[0]) == ours.encode(TEXTS[0])
