"""Where more torch threads start to pay for decoding (issue 13 item 9; BENCHMARKS.md "Threads").

    python benchmarks/threads.py [--threads 1,2] [--batch 1,8] [--new-tokens 32]
                                 [--repeats 3] [--sizes 25,100,240] [--no-busy] [--no-embedded]

Times greedy decoding (`decodekit.generate`, EOS ignored) on the embedded `shakespeare`
and `shakespeare-draft` and on randomly initialised Llama configs of about 25M, 100M and
240M parameters built in memory (transformers `LlamaForCausalLM` weights loaded into
`NativeLM`, the same path as `load_model` on a checkpoint directory). Each case runs at
each thread count, interleaved over repeats (median reported), first on the machine as
found ("ambient") and then with one more process spinning on a core ("spinner"), as when a
second job shares a two-core machine. The 1-minute load average before each case, the
process's nice value and the choice `choose_threads` makes at that moment are recorded.
On a shared machine, `nice -n -10 python benchmarks/threads.py` approximates an idle one
(our threads then get ~9x the CPU share of other jobs; the spinner inherits the nice
value, so it still competes as an equal). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import decodekit as dk
from decodekit.models.native import NativeLM
from decodekit.runtime import available_cores, choose_threads

# hidden, layers, intermediate, heads, vocab: about 25M, 100M and 240M parameters (tied embeddings).
RANDOM_CONFIGS = {
    25: (512, 6, 1408, 8, 8192),
    100: (768, 12, 2048, 12, 16384),
    240: (1024, 16, 2816, 16, 32000),
}


def random_llama(size: int) -> NativeLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, intermediate, heads, vocab = RANDOM_CONFIGS[size]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    state = LlamaForCausalLM(config).state_dict()
    return NativeLM.from_state_dict(config.to_dict(), state, name=f"random-{size}M")


def tokens_per_second(model, batch: int, new_tokens: int) -> float:
    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * batch  # token ids: random models have no tokenizer
    start = time.perf_counter()
    dk.generate(model, prompts, params)
    return batch * new_tokens / (time.perf_counter() - start)


def measure(model, threads: list[int], batch: int, new_tokens: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    tokens_per_second(model, batch, 4)  # warm-up: allocator, kernels
    rates: dict[int, list[float]] = {t: [] for t in threads}
    for _ in range(repeats):
        for t in threads:
            torch.set_num_threads(t)
            rates[t].append(tokens_per_second(model, batch, new_tokens))
    return {str(t): round(statistics.median(r), 1) for t, r in rates.items()}


def spinner() -> subprocess.Popen:
    """Another process holding one core, as a second job on the machine would."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="25,100,240", help="random Llama sizes (M parameters)")
    ap.add_argument("--no-busy", action="store_true", help="skip the runs with a core kept busy")
    ap.add_argument("--no-embedded", action="store_true", help="only the random Llama sizes")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    embedded = () if args.no_embedded else ("shakespeare", "shakespeare-draft")
    loaders = {name: lambda name=name: dk.load_model(name) for name in embedded}
    for size in (int(s) for s in args.sizes.split(",") if s):
        loaders[f"random-{size}M"] = lambda size=size: random_llama(size)
    conditions = ["ambient"] if args.no_busy else ["ambient", "spinner"]
    rows = []
    for name, load in loaders.items():
        model = load()
        parameters = model.num_parameters()
        for condition in conditions:
            busy = spinner() if condition == "spinner" else None
            try:
                if busy is not None:
                    time.sleep(1.0)  # let the spinner get scheduled
                for batch in batches:
                    load_before = os.getloadavg()[0]
                    rate = measure(model, threads, batch, args.new_tokens, args.repeats)
                    rows.append({
                        "model": name, "parameters": parameters, "condition": condition, "batch": batch,
                        "loadavg_1m": round(load_before, 2), "tok_s": rate,
                        "chosen_threads": choose_threads(parameters),
                    })
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
        del model
    print(json.dumps({
        "cores": available_cores(), "torch": torch.__version__, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "nice": os.nice(0), "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
