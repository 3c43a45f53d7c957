"""`decodekit bench kv`: KV-cache compression against the full-precision cache (issue 17,
item 4; seed 001: token dropping, a quantised cache and the memory formula).

- Perplexity on the held-out text (`text_perplexity`, its windows of the model's context,
  stride half of it) with the cache stored in float32, bfloat16 and int8 (one float32 scale
  per layer, head and position), every position kept; and with StreamingLLM's token dropping
  (4 attention sinks + the most recent positions, and recent positions only) and H2O's
  heavy hitters (half the budget, the other half recent) at 1/16, 25 %, 50 % and 100 % of the
  window kept. Both through `CompressedKVCache` (models/contiguous_kv.py), which stores
  the values exactly as the engine's block pool does.
- Memory: KV bytes per token from seed 001's formula (`kv_cache_bytes`) and as the engine's
  pool measures one block (`stats()["block_bytes"]`, int8's scales included); in the engine
  run, the pool's peak bytes in use and the dense running rows it keeps in the model's dtype
  beside the pool (rows.py).
- Decode speed: the engine's concurrent scenario (`requests` prompts of 16-128 tokens,
  `new_tokens` each) with each `EngineConfig(kv_dtype=...)`, CPU time of this process,
  median of `repeats` after a warm-up, the dtypes alternating.
"""

from __future__ import annotations

import torch

from decodekit.bench.decode import machine
from decodekit.bench.engine import CONCURRENT, prompts_from_text, run_engine, timed_once
from decodekit.runtime import progress as progress_bar

KV_DTYPES = ("float32", "bfloat16", "int8")
FRACTIONS = (0.0625, 0.25, 0.5, 1.0)  # 1/16: where dropping starts to bite on a small model
SINKS = 4  # StreamingLLM's default number of attention sinks


class CompressedCacheLM:
    """`model` scoring through fresh `CompressedKVCache`s: what `text_perplexity` needs of it."""

    def __init__(self, model, kv_dtype: torch.dtype | None = None, budget: int | None = None,
                 sinks: int = SINKS, policy: str = "streaming"):
        self.model, self.kv_dtype = model, kv_dtype
        self.budget, self.sinks, self.policy = budget, sinks, policy
        self.max_context = model.max_context

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def new_cache(self, batch_size: int):
        from decodekit.models.contiguous_kv import CompressedKVCache

        c = self.model.config
        return CompressedKVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, self.model.dtype,
                                 self.model.device, self.kv_dtype, self.budget, self.sinks, self.policy)

    def forward(self, tokens, cache, mask=None):
        return self.model.forward(tokens, cache, mask)


def bench_kv(model_name: str, requests: int = 32, new_tokens: int = 64, repeats: int = 3,
             progress: bool = False) -> dict:
    """The figures of the module docstring."""
    import decodekit as dk
    from decodekit.compress.evaluate import MAX_DEFAULT_WINDOW, text_perplexity
    from decodekit.engine import EngineConfig
    from decodekit.models.footprint import KV_BYTES, kv_cache_bytes

    model = dk.load_model(model_name)
    c = model.config
    window = min(model.max_context, MAX_DEFAULT_WINDOW)
    steps = len(KV_DTYPES) + 3 * len(FRACTIONS) + repeats + 1
    bar = progress_bar(total=steps, desc="bench kv", enabled=progress)

    def perplexity(**policy) -> float:
        result = text_perplexity(CompressedCacheLM(model, **policy))
        bar.update(1)
        return round(result.perplexity, 4)

    quantised = {name: perplexity(kv_dtype=getattr(torch, name)) for name in KV_DTYPES}
    dropping = []
    for fraction in FRACTIONS:
        budget = round(fraction * window)
        dropping.append({
            "kept": fraction, "budget": budget,
            "sinks_recent": perplexity(budget=budget, sinks=SINKS),
            "recent_only": perplexity(budget=budget, sinks=0),
            "h2o": perplexity(budget=budget, policy="h2o"),
            "kv_bytes_per_sequence": kv_cache_bytes(1, budget, c.num_layers, c.num_kv_heads, c.head_dim,
                                                    KV_BYTES[str(model.dtype).removeprefix("torch.")]),
        })

    spec = {**CONCURRENT, "requests": requests, "new_tokens": new_tokens}
    prompts = prompts_from_text(model, requests, spec["prompt_lengths"])
    params = dk.SamplingParams(max_new_tokens=new_tokens, seed=0, ignore_eos=True)
    configs = {name: EngineConfig(max_running=requests, max_kv_bytes=2**30, kv_dtype=name, compile=False)
               for name in KV_DTYPES}  # fmt: skip
    stats = {name: run_engine(model, prompts, params, config) for name, config in configs.items()}  # warm-up
    bar.update(1)
    times: dict[str, list[float]] = {name: [] for name in KV_DTYPES}
    for _ in range(repeats):
        for name, config in configs.items():
            seconds = timed_once(lambda config=config: run_engine(model, prompts, params, config))
            times[name].append(seconds["cpu_s"])
        bar.update(1)
    bar.close()
    generated = requests * new_tokens
    base = sorted(times["float32"])[repeats // 2]
    per_dtype = {}
    for name in KV_DTYPES:
        cpu = sorted(times[name])[repeats // 2]
        block = stats[name]["block_bytes"]
        per_dtype[name] = {
            "perplexity": quantised[name],
            "formula_bytes_per_token": kv_cache_bytes(1, 1, c.num_layers, c.num_kv_heads, c.head_dim,
                                                      KV_BYTES[name]),
            "pool_bytes_per_token": block / configs[name].block_size,
            "pool_ratio_to_float32": round(stats["float32"]["block_bytes"] / block, 2),
            "pool_peak_bytes": stats[name]["peak_used_blocks"] * block,  # the blocks the run used
            "running_rows_bytes": stats[name]["running_rows_bytes"],
            "cpu_tok_s": round(generated / cpu, 1),
            "speed_vs_float32": round(base / cpu, 3),
        }
    return {
        "model": model_name, "machine": machine(), "window": window, "stride": window // 2,
        "engine": {"requests": requests, "new_tokens": new_tokens, "prompt_lengths": spec["prompt_lengths"],
                   "repeats": repeats},
        "kv_dtypes": per_dtype, "dropping": dropping, "sinks": SINKS,
    }


def table(result: dict) -> str:
    lines = [f"KV-cache compression, {result['model']} "
             f"(window {result['window']}, stride {result['stride']})",
             "kv dtype   perplexity  formula B/token  pool B/token  x smaller  engine tok/s (CPU)  vs f32"]
    for name, row in result["kv_dtypes"].items():
        lines.append(f"{name:<10} {row['perplexity']:>10.3f}  {row['formula_bytes_per_token']:>15}  "
                     f"{row['pool_bytes_per_token']:>12.0f}  {row['pool_ratio_to_float32']:>9.2f}  "
                     f"{row['cpu_tok_s']:>18.1f}  {row['speed_vs_float32']:>6.3f}")
    lines.append("kept   budget  sinks+recent  recent only      h2o  KV bytes/sequence  "
                 f"(sinks = {result['sinks']})")
    for row in result["dropping"]:
        lines.append(f"{row['kept']:>5.1%}  {row['budget']:>7}  {row['sinks_recent']:>12.3f}  "
                     f"{row['recent_only']:>11.3f}  {row['h2o']:>7.3f}  {row['kv_bytes_per_sequence']:>17}")
    return "\n".join(lines)
