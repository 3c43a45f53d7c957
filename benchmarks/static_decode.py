"""A gpt-fast style static-shape decode step, eager and `torch.compile`d, against `generate`
(issue 15 item 6; BENCHMARKS.md "Real model shapes: dtype, device and speed").

    python benchmarks/static_decode.py [--model shakespeare] [--new-tokens 200] [--repeats 3]
                                       [--freezing]

The step is one token of batch-1 greedy decoding with no data-dependent Python: a KV
buffer of fixed capacity written at the position (`index_copy_`), attention over the whole
buffer under a position mask, RoPE rows picked by `index_select`; NativeLM's own modules
(`model.net`) compute it, so the maths is `models/native.py`'s. It is compiled once
(inductor, CPU C++ kernels; `--freezing` adds inductor's weight freezing and the C++
wrapper) and the compile time is reported apart. Every variant's greedy tokens are checked
against `decodekit.generate`'s. Tokens/s are CPU time of this process, one thread, the
median of `repeats` runs after a warm-up. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import decodekit as dk


def static_step(model, capacity: int):
    """step(token [1, 1], position [1], keys, values) -> logits [1, V] float32; keys/values
    [layers, 1, H_kv, capacity, D] are written in place."""
    net, config = model.net, model.config
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    cos_table, sin_table = model.rope.tables(capacity)
    columns = torch.arange(capacity)

    def step(token, position, keys, values):
        x = net.embed_tokens(token)  # [1, 1, hidden]
        cos = cos_table.index_select(0, position)[None, :, None]  # [1, 1, 1, D]
        sin = sin_table.index_select(0, position)[None, :, None]
        visible = (columns <= position)[None, None, None, :]  # [1, 1, 1, C]
        for layer, block in enumerate(net.layers):
            attention = block.self_attn
            qkv = attention.qkv_proj(block.input_layernorm(x)).view(1, 1, heads + 2 * kv_heads, dim)
            qk = qkv[:, :, : heads + kv_heads]
            qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin  # models/rope.py apply_rope
            q, k = qk.split([heads, kv_heads], dim=2)
            keys[layer].index_copy_(2, position, k.transpose(1, 2))
            values[layer].index_copy_(2, position, qkv[:, :, heads + kv_heads :].transpose(1, 2))
            folded = q.reshape(1, kv_heads, heads // kv_heads, dim)  # models/kv.py attend
            out = F.scaled_dot_product_attention(folded, keys[layer], values[layer], attn_mask=visible)
            x = x + attention.o_proj(out.reshape(1, 1, heads * dim))
            x = x + block.mlp(block.post_attention_layernorm(x))
        return net.lm_head(net.norm(x))[:, -1].float()

    return step


def greedy(step, model, prompt: list[int], new_tokens: int, capacity: int) -> list[int]:
    config = model.config
    shape = (config.num_layers, 1, config.num_kv_heads, capacity, config.head_dim)
    keys, values = torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)
    out: list[int] = []
    with torch.inference_mode():
        for position, token in enumerate(prompt):  # the prompt one token at a time: one shape
            logits = step(torch.tensor([[token]]), torch.tensor([position]), keys, values)
        for position in range(len(prompt), len(prompt) + new_tokens):
            out.append(int(logits.argmax()))
            logits = step(torch.tensor([[out[-1]]]), torch.tensor([position]), keys, values)
    return out


def cpu_tok_s(fn, tokens: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return round(tokens / statistics.median(times), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--freezing", action="store_true", help="inductor freezing + C++ wrapper")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = dk.load_model(args.model)
    prompt, n = model.encode("ROMEO:"), args.new_tokens
    capacity = min(model.max_context, 512)
    params = dk.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    reference = dk.generate(model, "ROMEO:", params)[0].token_ids
    eager = static_step(model, capacity)
    if args.freezing:
        import torch._inductor.config as inductor

        inductor.freezing, inductor.cpp_wrapper = True, True
    start = time.perf_counter()
    compiled = torch.compile(eager, fullgraph=True, dynamic=False)
    greedy(compiled, model, prompt[:1], 1, capacity)  # the one compilation
    compile_s = time.perf_counter() - start
    result = {"model": args.model, "new_tokens": n, "capacity": capacity, "threads": 1,
              "freezing": args.freezing, "compile_wall_s": round(compile_s, 1),
              "torch": torch.__version__}  # fmt: skip
    runs = {"generate": lambda: dk.generate(model, "ROMEO:", params)[0].token_ids,
            "static_eager": lambda: greedy(eager, model, prompt, n, capacity),
            "static_compiled": lambda: greedy(compiled, model, prompt, n, capacity)}  # fmt: skip
    for name, fn in runs.items():
        result[name] = {"same_tokens_as_generate": fn() == reference,
                        "cpu_tok_s": cpu_tok_s(fn, n, args.repeats)}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
