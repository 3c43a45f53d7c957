"""k-gram language models on Shakespeare: held-out perplexity and Shannon-style samples (seed 000).

    python scripts/ngram_report.py [--data data/shakespeare] [--level char|token] [--max-order 5]
    python scripts/ngram_report.py --save src/decodekit/models/assets/shakespeare-5gram

Trains `NGramLM` on the training plays for k = 1..max_order with add-constant (Laplace,
c = --constant) and interpolated Kneser-Ney smoothing, prints perplexity on the validation
plays (per character, or per BPE token with --level token; every document's closing EOS is
predicted too), then samples as in Shannon (1948) section 3: zero-order (equiprobable
symbols), first-order (symbol frequencies), second-order (digrams), ... up to the k-gram.
`--save DIR` also writes the Kneser-Ney model of order --save-order (the embedded
`shakespeare-5gram`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from decodekit.models.ngram import EOS_SYMBOL, SMOOTHINGS, NGramConfig, NGramLM
from decodekit.params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SHANNON = ["zero-order (uniform)", "first-order (unigram)", "second-order (bigram)",
           "third-order (trigram)"]


def read_documents(path: Path) -> list[str]:
    """The EOS-separated documents (plays) of a split file."""
    docs = [d.strip("\n") for d in path.read_text(encoding="utf-8").split(EOS_SYMBOL)]
    return [d for d in docs if d]


def encode_corpus(train: list[str], val: list[str], level: str, tokenizer=None):
    """Token-id documents of both splits and the keyword arguments of NGramLM.fit."""
    if level == "token":
        def enc(docs):
            return [tokenizer.encode(d, add_special_tokens=False) for d in docs]

        return enc(train), enc(val), {"vocab_size": len(tokenizer), "level": "token",
                                      "eos_id": tokenizer.eos_token_id, "tokenizer": tokenizer}
    # a closed character vocabulary: every character of either split, then EOS
    symbols = sorted(set("".join(train)) | set("".join(val))) + [EOS_SYMBOL]
    index = {s: i for i, s in enumerate(symbols)}

    def enc(docs):
        return [[index[c] for c in d] for d in docs]

    return enc(train), enc(val), {"vocab_size": len(symbols), "level": "char",
                                  "eos_id": len(symbols) - 1, "symbols": symbols}


def perplexity_table(train_ids, val_ids, model_kwargs, max_order: int, constant: float):
    """One row per (smoothing, k): validation perplexity, distinct k-grams, seconds to train."""
    rows = []
    for smoothing in SMOOTHINGS:
        for k in range(1, max_order + 1):
            start = time.perf_counter()
            model = NGramLM.fit(train_ids, NGramConfig(k, smoothing, constant), **model_kwargs)
            seconds = time.perf_counter() - start
            rows.append({"smoothing": smoothing, "k": k, "perplexity": model.perplexity(val_ids),
                         "kgrams": len(model.kgram_keys), "train_seconds": seconds})
    return rows


def shannon_samples(train_ids, model_kwargs, max_order: int, length: int, seed: int):
    """(order, text) for orders 0..max_order: Kneser-Ney k-gram samples from a document start."""
    from decodekit.decode.sample import generate

    samples = []
    for k in range(max_order + 1):
        model = NGramLM.fit(train_ids, NGramConfig(k, "kneser-ney"), **model_kwargs)
        params = SamplingParams(max_new_tokens=length, seed=seed, ignore_eos=True)
        [[completion]] = generate(model, [[model.eos_id]], params)  # EOS = start of a document
        samples.append((k, completion.text))
    return samples


def markdown(rows, samples, level: str) -> str:
    unit = "character" if level == "char" else "BPE token"
    ks = sorted({r["k"] for r in rows})
    lines = [f"Validation perplexity per {unit}:", "",
             "| smoothing | " + " | ".join(f"k = {k}" for k in ks) + " |",
             "|---|" + "---:|" * len(ks)]
    for smoothing in SMOOTHINGS:
        cells = [f"{r['perplexity']:.2f}" for r in rows if r["smoothing"] == smoothing]
        lines.append(f"| {smoothing} | " + " | ".join(cells) + " |")
    counts = [f"{r['kgrams']:,}" for r in rows if r["smoothing"] == SMOOTHINGS[0]]
    lines += ["| distinct k-grams | " + " | ".join(counts) + " |", ""]
    lines += [f"Samples ({unit} level, Kneser-Ney, from the start of a play):", ""]
    for k, text in samples:
        label = SHANNON[k] if k < len(SHANNON) else f"{k}-gram"
        body = text.replace("\n", " / ")
        lines.append(f"- **{label}**: `{body}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(REPO / "data" / "shakespeare"),
                        help="directory with train.txt and val.txt (prepare_corpus.py)")
    parser.add_argument("--level", choices=["char", "token"], default="char")
    parser.add_argument("--tokenizer", default=None, help="BPE directory for --level token "
                        "(default: DATA/tokenizer)")
    parser.add_argument("--max-order", type=int, default=5)
    parser.add_argument("--constant", type=float, default=1.0, help="add-constant c")
    parser.add_argument("--sample-length", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="write the Kneser-Ney model here")
    parser.add_argument("--save-order", type=int, default=5)
    parser.add_argument("--name", default="shakespeare-5gram")
    args = parser.parse_args(argv)
    if args.max_order < 1:
        raise SystemExit(f"--max-order must be >= 1, got {args.max_order}")

    data = Path(args.data)
    train, val = read_documents(data / "train.txt"), read_documents(data / "val.txt")
    tokenizer = None
    if args.level == "token":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or data / "tokenizer")
    train_ids, val_ids, kwargs = encode_corpus(train, val, args.level, tokenizer)
    rows = perplexity_table(train_ids, val_ids, kwargs, args.max_order, args.constant)
    samples = shannon_samples(train_ids, kwargs, args.max_order, args.sample_length, args.seed)
    report = markdown(rows, samples, args.level)
    print(report, flush=True)
    if args.save:
        config = NGramConfig(args.save_order, "kneser-ney")
        model = NGramLM.fit(train_ids, config, name=args.name, **kwargs)
        model.save(args.save)
        print(f"\nsaved {args.name} to {args.save}: validation perplexity "
              f"{model.perplexity(val_ids):.3f}, {len(model.kgram_keys):,} distinct k-grams")
    return report


if __name__ == "__main__":
    main()
