"""A random-weight Hugging Face checkpoint of a real model's layer shapes, for timing and memory.

Defaults: Qwen2.5-0.5B's layers (hidden 896, intermediate 4864, 14 heads / 2 KV heads of 64,
tied embeddings, q/k/v biases), 16 of its 24 layers and a 2,048-token vocabulary (the shipped
tokenizer's size), so the layers, not the embedding, carry the weights: 240M parameters,
0.96 GB in float32. No tokenizer: benchmarks feed it random token ids.

    python scripts/random_checkpoint.py --out /tmp/qwen2.5-0.5b-16l
    decodekit bench latency --model /tmp/qwen2.5-0.5b-16l --repeats 2
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="new directory for config.json + model.safetensors")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} exists and is not empty")

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=True, torch_dtype="float32")  # fmt: skip
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    count = sum(p.numel() for p in model.parameters())
    print(f"{out}: {count:,} parameters, head_dim {args.hidden // args.heads}")


if __name__ == "__main__":
    main()
