"""A checkpoint's tokenizer.json through the `tokenizers` library, without transformers.

Importing transformers for `AutoTokenizer` cost about 1.1 s of CPU per start (issue 26: it
pulls `torch.distributed.tensor` and, through `torch.fx`, sympy), more than everything else a
`decodekit generate` does after importing torch. `FastTokenizer` is the part of
transformers' fast tokenizer that decodekit uses (encode, decode, the vocabulary, special
tokens), over the same Rust tokenizer that transformers wraps, so its ids and text are
transformers' (tests/models/test_tokenizer.py compares them on the shipped models).

`load_tokenizer(path)` takes this path only where the directory says nothing that
transformers would act on beyond tokenizer.json (`plain_tokenizer_config`): a generic
tokenizer class, special tokens already among tokenizer.json's added tokens, and no
options that rewrite the pipeline (add_bos_token, add_prefix_space, a model-specific class
that rebuilds the tokenizer, ...). Anything else, and a directory without tokenizer.json,
gets transformers' `AutoTokenizer`, imported then. A chat template is rendered by
transformers too, imported on the first `apply_chat_template`.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Classes whose loading is tokenizer.json as it is; a model-specific class (LlamaTokenizer,
# Qwen2Tokenizer, ...) may rebuild the pipeline from its vocabulary in transformers 5.
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing transformers' encode() or decode() computes
# (model_max_length only warns; padding and truncation are off in a plain encode).
PLAIN_KEYS = frozenset({
    *SPECIAL_KEYS, "backend", "tokenizer_class", "added_tokens_decoder", "model_max_length",
    "model_input_names", "padding_side", "truncation_side", "chat_template", "name_or_path",
    "additional_special_tokens", "extra_special_tokens", "clean_up_tokenization_spaces",
})  # fmt: skip
# Files a tokenizer is saved as (save_pretrained copies those the source has).
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _content(token: Any) -> str | None:
    """A special token's text: tokenizer_config.json writes a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def plain_tokenizer_config(path: Path) -> dict[str, Any] | None:
    """tokenizer_config.json of `path` (an empty dict where it has none) when transformers
    would load the directory as tokenizer.json alone, else None (module docstring)."""
    if not (path / "tokenizer.json").is_file():
        return None
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("clean_up_tokenization_spaces"):
        return None  # transformers' decode would clean up spaces; decodekit never wants that
    if set(config) - PLAIN_KEYS or config.get("tokenizer_class", GENERIC_CLASSES[0]) not in GENERIC_CLASSES:
        return None
    added = {token["content"]: token for token in json.loads((path / "tokenizer.json").read_text())
             .get("added_tokens") or []}  # fmt: skip
    named = [_content(config.get(key)) for key in SPECIAL_KEYS]
    extra = config.get("extra_special_tokens") or []  # a list, or in transformers 5 a dict
    named += [_content(t) for t in config.get("additional_special_tokens") or []]
    named += [_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    if any(name is not None and not added.get(name, {}).get("special") for name in named):
        return None  # transformers would add it as a special token, changing how text splits
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        known = added.get(_content(token))
        if known is None or known["id"] != int(index) or known["special"] != token.get("special", False):
            return None
    return config


class FastTokenizer:
    """transformers' fast-tokenizer surface that decodekit uses, over a `tokenizers.Tokenizer`."""

    def __init__(self, backend, config: dict[str, Any] | None = None, path: Path | None = None):
        backend.no_padding()  # transformers' encode() pads and truncates only when asked
        backend.no_truncation()
        self.backend_tokenizer = backend
        self.path = path
        config = config or {}
        self.special = {key: _content(config.get(key)) for key in SPECIAL_KEYS}
        template = path / "chat_template.jinja" if path is not None else None
        self.chat_template = config.get("chat_template") or (
            template.read_text() if template is not None and template.is_file() else None)  # fmt: skip
        self._transformers = None  # the transformers tokenizer, built for chat templates only
        # A server renders templates in several threads at once, and transformers' lazy
        # imports are not safe to race ("cannot import name 'AutoTokenizer'"): one builds it.
        self._building = threading.Lock()

    @classmethod
    def from_directory(cls, path: Path) -> FastTokenizer | None:
        """The directory's tokenizer, or None where transformers is needed (module docstring)."""
        config = plain_tokenizer_config(path)
        if config is None:
            return None
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), config, path)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"FastTokenizer({str(self.path)!r}, vocab={len(self)})"

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, as transformers calls it: unlike `encode` it releases the GIL, so a
        # server's event loop keeps answering while a huge prompt is tokenised
        # (tests/server/test_guard.py, test_a_huge_prompt_does_not_stall_health).
        [encoding] = self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list:
        rows = [[int(i) for i in ids] for ids in sequences]
        return self.backend_tokenizer.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Ids of tokens; a token not in the vocabulary gives the unknown token's id (None without one)."""
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def _id(self, key: str) -> int | None:
        token = self.special[key]
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token = property(lambda self: self.special["bos_token"])
    eos_token = property(lambda self: self.special["eos_token"])
    unk_token = property(lambda self: self.special["unk_token"])
    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' rendering of the directory's chat template (imports transformers)."""
        if self.path is None:
            raise TypeError("this tokenizer was not loaded from a directory, so it has no chat template")
        with self._building:
            if self._transformers is None:
                from transformers import AutoTokenizer

                self._transformers = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        return self._transformers.apply_chat_template(*args, **kwargs)

    def save_pretrained(self, directory: str | Path) -> None:
        """Copy the tokenizer files it was loaded from into `directory`."""
        if self.path is None:
            raise TypeError("this tokenizer was not loaded from a directory; nothing to save")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, directory / name)
