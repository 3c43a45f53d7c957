"""Convert a decodekit checkpoint directory to GGUF with llama.cpp's own converter
(issue 15, item 7): the one conversion that scripts/peers.sh and `bench packed --peer
llamacpp` (bench/llamacpp.py) both run.

    PYTHONPATH=.peers/convert-lib:LLAMA_CPP_DIR python -m decodekit.bench.gguf MODEL_DIR OUT.gguf

LLAMA_CPP_DIR holds convert_hf_to_gguf.py (vendored in the llama-cpp-python sdist);
.peers/convert-lib holds its gguf-py and sentencepiece. The converter recognises a BPE
pre-tokeniser by the hash of its tokens on a fixed text and refuses unknown ones; decodekit's
tokenisers are byte-level BPE with GPT-2's split regex, so an unrecognised hash is registered
as GPT-2's when, and only when, tokenizer.json says exactly that (`gpt2_pre_tokenizer`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def gpt2_pre_tokenizer(tokenizer: dict) -> bool:
    """Whether a tokenizer.json's pre-tokeniser is GPT-2's: ByteLevel with its split regex
    (`use_regex`, true unless given)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True


def convert(model_dir: Path, out: Path, outtype: str = "f32") -> None:
    """Write `model_dir` as GGUF `out`; llama.cpp's converter must be importable."""
    import convert_hf_to_gguf
    from conversion.base import TextModel

    is_gpt2 = gpt2_pre_tokenizer(json.loads((model_dir / "tokenizer.json").read_text()))
    recognise = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            if is_gpt2:
                return "gpt-2"
            raise

    TextModel.get_vocab_base_pre = get_vocab_base_pre  # this process exists to run the converter
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out), "--outtype", outtype]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m decodekit.bench.gguf MODEL_DIR OUT.gguf")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
