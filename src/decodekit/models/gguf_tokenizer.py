"""The tokenizer a GGUF file describes, as a Hugging Face fast tokenizer (issue 27).

GGUF keeps the vocabulary in its metadata (llama.cpp's gguf-py `Keys.Tokenizer`):
`tokenizer.ggml.model` (the algorithm), `.pre` (the pre-tokeniser's name), `.tokens`,
`.token_type`, `.merges`, the BOS/EOS/EOT/padding ids, `.add_bos_token` / `.add_eos_token`,
and `tokenizer.chat_template`. This module reads the byte-level BPE kind, "gpt2", which
GPT-2, Llama 3, Qwen2/2.5/3 and decodekit's own models use: a BPE over GPT-2's byte-to-unicode
alphabet with the file's merges, after a split by the regular expression the pre-tokeniser's
name stands for (`PRE_TOKENIZERS`: the patterns of llama.cpp's llama-vocab.cpp and of these
models' tokenizer.json). SentencePiece files ("llama": Llama 1/2, Mistral v0.1) and other
kinds raise ValueError naming the kind.

Token types (gguf-py `TokenType`): CONTROL (3) tokens are special (never split, skipped when
decoding with skip_special_tokens), USER_DEFINED (4) ones are added tokens matched before the
BPE, as llama.cpp's tokenizer does.
"""

from __future__ import annotations

from typing import Any

CONTROL, USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> (split regex, or None for GPT-2's own ByteLevel split; NFC normaliser;
# BPE ignore_merges: a word that is itself a token is not merged, as Llama 3's tokenizer.json).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    "gpt-2": (None, False, False),
    "default": (None, False, False),
    "llama-bpe": (_LLAMA3, False, True),
    "llama3": (_LLAMA3, False, True),
    "qwen2": (_QWEN2, True, False),
}


def build_tokenizer(meta: dict[str, Any], where: str) -> Any:
    """A `PreTrainedTokenizerFast` from a GGUF file's metadata (key -> value); `where` names
    the file in errors."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{where}: tokenizer.ggml.model must be 'gpt2' (byte-level BPE), got {kind!r}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{where}: tokenizer.ggml.pre must be one of {sorted(PRE_TOKENIZERS)}, got {pre!r}")
    pattern, nfc, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=ignore_merges))  # fmt: skip
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    if pattern is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])  # fmt: skip
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])  # fmt: skip
    _post_processor(tokenizer, meta, tokens)

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=token("bos"), eos_token=token("eos"),
        unk_token=token("unknown"), pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _post_processor(tokenizer: Any, meta: dict[str, Any], tokens: list[str]) -> None:
    """BOS / EOS added around every encoded text where the file says so (`add_bos_token`,
    `add_eos_token`; llama.cpp adds BOS when the key is absent only for SentencePiece)."""
    from tokenizers import processors

    special = []
    single = "$A:0"
    for key, before in (("bos", True), ("eos", False)):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if meta.get(f"tokenizer.ggml.add_{key}_token") and index is not None:
            name = tokens[int(index)]
            special.append((name, int(index)))
            single = f"{name}:0 {single}" if before else f"{single} {name}:0"
    if special:
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)


def eos_token_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """The ids that end a generation: EOS, then EOT and EOM where the file names them."""
    found: list[int] = []
    for key in ("eos", "eot", "eom"):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is not None and int(index) not in found:
            found.append(int(index))
    return tuple(found)
