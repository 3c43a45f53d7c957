"""The tokenizer a GGUF file describes, as a Hugging Face fast tokenizer (issue 27).

GGUF keeps the vocabulary in its metadata (llama.cpp's gguf-py `Keys.Tokenizer`):
`tokenizer.ggml.model` (the algorithm), `.pre` (the pre-tokeniser's name), `.tokens`,
`.token_type`, `.merges`, the BOS/EOS/EOT/padding ids, `.add_bos_token` / `.add_eos_token`,
and `tokenizer.chat_template`. This module reads the byte-level BPE kind, "gpt2", which
GPT-2, Llama 3, Qwen2/2.5/3 and decodekit's own models use: a BPE over GPT-2's byte-to-unicode
alphabet with the file's merges, after a split by the regular expression the pre-tokeniser's
name stands for (`PRE_TOKENIZERS`: the patterns of llama.cpp's llama-vocab.cpp and of these
models' tokenizer.json). The SentencePiece kind, "llama" (Llama 1/2, Mistral 7B v0.1,
TinyLlama), is its BPE over "▁"-marked text (`spm_tokenizer`): the pair whose merged piece has
the highest score merges first (llama.cpp's llm_tokenizer_spm), which a BPE whose merge ranks
follow the merged pieces' scores reproduces; characters outside the vocabulary fall back to
the <0xXX> byte tokens. Other kinds raise ValueError naming the kind.

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
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{where}: tokenizer.ggml.model must be 'gpt2' (byte-level BPE) or 'llama' "
                         f"(SentencePiece), got {kind!r}")  # fmt: skip
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    tokenizer = spm_tokenizer(meta, tokens) if kind == "llama" else bpe_tokenizer(meta, tokens, where)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])  # fmt: skip
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])  # fmt: skip
    _post_processor(tokenizer, meta, tokens, add_bos_default=kind == "llama")

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=token("bos"), eos_token=token("eos"),
        unk_token=token("unknown"), pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False,
    )  # fmt: skip


def spm_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Any:
    """SentencePiece's BPE (module docstring) as a `tokenizers.Tokenizer`: merges ranked by the
    merged piece's score (ties: the lower ids first), byte fallback, text "▁"-marked and, with
    `add_space_prefix` (true unless the file says otherwise), led by one "▁"."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    unk = None if unknown is None else tokens[int(unknown)]
    pairs = [(m[3], m[4]) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True, unk_token=unk))
    steps = [normalizers.Replace(" ", "▁")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tokenizer


def bpe_tokenizer(meta: dict[str, Any], tokens: list[str], where: str) -> Any:
    """The byte-level BPE of a "gpt2" file as a `tokenizers.Tokenizer` (module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{where}: tokenizer.ggml.pre must be one of {sorted(PRE_TOKENIZERS)}, got {pre!r}")
    pattern, nfc, ignore_merges = PRE_TOKENIZERS[pre]
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
    return tokenizer


def _post_processor(tokenizer: Any, meta: dict[str, Any], tokens: list[str], add_bos_default: bool) -> None:
    """BOS / EOS added around every encoded text where the file says so (`add_bos_token`,
    `add_eos_token`; where the key is absent, llama.cpp adds BOS for SentencePiece only)."""
    from tokenizers import processors

    special = []
    single = "$A:0"
    for key, before in (("bos", True), ("eos", False)):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        default = add_bos_default and key == "bos"
        if meta.get(f"tokenizer.ggml.add_{key}_token", default) and index is not None:
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
