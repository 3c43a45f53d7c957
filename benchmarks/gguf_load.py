"""Loading GGUF files (issue 27): resident memory after `load_model(FILE)` against the file's
tensor bytes, load time, and batch-1 greedy decode speed on one thread.

    PYTHONPATH=src python benchmarks/gguf_load.py [--shape qwen2.5-0.5b-16l] [--out FILE.json]
        [--gguf EXTRA.gguf ...]

The random model of `--shape` (models/shapes.py: real layer shapes, the embedded tokenizer's
2,048-token vocabulary) is written as GGUF by compress/gguf.py in f32, f16, q8_0 and q4_0;
`--gguf` adds files made elsewhere (llama.cpp's Q4_K_M of the same weights). Each file loads
in a fresh Python process (`measure`): RSS is read from /proc/self/status after the imports
and a load of a small GGUF (shakespeare's, then dropped: lazy imports, the kernels' library
and OpenMP's pools, ~85 MB once per process, are not the model's) and after the load, so the difference
is what the model holds, against "model_bytes" (its parameters and buffers) and the file's
tensor bytes; "kernel copies" are the int4 layers' repacked operands (models/kernels.py
`pack_int4_blocks`), built at load beside the stored nibbles. A float16 file loads as float32
(dtype "auto" on a CPU), so it holds twice its bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import gc, json, sys, time
import torch
import decodekit as dk
from decodekit.models.registry import load_model
from decodekit.models.gguf_model import read_gguf, release_freed_memory
from decodekit.models.qlinear import QuantizedLinear, kernel_counts
from transformers import PreTrainedTokenizerFast  # imported before the baseline: not the model's

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)
path, warm_up = sys.argv[1], sys.argv[2]
load_model(warm_up)  # lazy imports, the kernels' library, OpenMP: not the model's memory
_, tensors = read_gguf(path)
tensor_bytes = sum(int(t.n_bytes) for t in tensors.values())
del tensors
gc.collect()
release_freed_memory()
baseline = rss()
start = time.perf_counter()
model = load_model(path)
load_s = time.perf_counter() - start
gc.collect()
after = rss()
copies = sum(m.kernel_weight.numel() for m in model.net.modules()
             if isinstance(m, QuantizedLinear) and m.kernel == "int4gemv")
held = sum(t.numel() * t.element_size() for t in [*model.net.parameters(), *model.net.buffers()])
params = dk.SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
prompt = model.encode("ROMEO:")
dk.generate(model, [prompt], dk.SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
times = []
for _ in range(3):
    cpu = time.process_time()
    dk.generate(model, [prompt], params)
    times.append(time.process_time() - cpu)
print(json.dumps({"file": path, "tensor_bytes": tensor_bytes, "rss_delta": after - baseline,
                  "model_bytes": held,
                  "kernel_copies": copies, "load_s": round(load_s, 2), "dtype": str(model.dtype),
                  "kernels": kernel_counts(model.net),
                  "decode_tok_s_1thread_cpu": round(32 / sorted(times)[1], 1)}))
"""


def measure(path: Path, warm_up: Path) -> dict:
    command = [sys.executable, "-c", CHILD, str(path), str(warm_up)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["rss_over_tensor_bytes"] = round(row["rss_delta"] / row["tensor_bytes"], 3)
    with_copies = row["tensor_bytes"] + row["kernel_copies"]
    row["rss_over_tensor_and_copies"] = round(row["rss_delta"] / with_copies, 3)
    row["rss_over_model_bytes"] = round(row["rss_delta"] / row["model_bytes"], 3)
    return row


def main() -> None:
    from decodekit.compress.gguf import write_gguf
    from decodekit.models.registry import ASSETS
    from decodekit.models.shapes import save_random_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b-16l")
    parser.add_argument("--types", default="f32,f16,q8_0,q4_0")
    parser.add_argument("--gguf", action="append", default=[])
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="decodekit-gguf-load-") as folder:
        warm_up = write_gguf(ASSETS / "shakespeare", Path(folder) / "warm-up.gguf")
        model_dir = save_random_checkpoint(args.shape, Path(folder) / "model")
        for tensor_type in [t for t in args.types.split(",") if t]:
            path = write_gguf(model_dir, Path(folder) / f"{args.shape}-{tensor_type}.gguf", tensor_type)
            rows.append({"type": tensor_type, **measure(path, warm_up)})
            path.unlink()
            print(json.dumps(rows[-1]), flush=True)
        for extra in args.gguf:
            rows.append({"type": Path(extra).stem, **measure(Path(extra), warm_up)})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
