"""What activation quantisation (`activation_bits=8`: W8A8 / W4A8, llama.cpp's q8_0 / q4_0
numerics, models/qlinear.py) costs in perplexity and KL beside the weight-only models it
comes from (issue 23). The GPTQ rows calibrate on the model's own (quantised) activations, so
"int4 GPTQ a8" has codes of its own; "int4 GPTQ, same codes, a8" is the "int4 GPTQ" row's
codes with the activations quantised, which isolates the activations' cost.

For each row, a compressed copy of the float32 model (`quantized_copy`): held-out perplexity
(`text_perplexity`, the BENCHMARKS.md protocol; on the 240M random shape the first `--chars`
characters of the test split in windows of 512 every 384) and the mean KL(float32 ‖ row) over
`--kl-windows` windows of 256 tokens of the validation split. Each is measured twice: on the
layers' own kernels ("auto": the kernels up to 64 rows, a bfloat16 GEMM above, so a
perplexity window runs the bfloat16 prefill path) and on "unpack" (the grid's maths in
float32: x̂ Ŵᵀ for the a8 rows, x Ŵᵀ for the weight-only ones), which isolates what
quantising the activations itself costs.

    python benchmarks/activation_quant.py --model shakespeare
    python benchmarks/activation_quant.py --model qwen2.5-0.5b-16l --chars 8000
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from decodekit.bench.packed import load
from decodekit.compress.evaluate import HELD_OUT, TEST_TEXT, mean_kl, text_perplexity
from decodekit.compress.recipe import CompressConfig, quantized_copy
from decodekit.models.base import logprobs
from decodekit.models.qlinear import QuantizedLinear, set_kernels
from decodekit.models.shapes import SHAPES

ROWS = {
    "int8 RTN": CompressConfig("rtn", bits=8),
    "int8 RTN a8": CompressConfig("rtn", bits=8, activation_bits=8),
    "int8 RTN g32": CompressConfig("rtn", bits=8, group_size=32),
    "int8 RTN g32 a8": CompressConfig("rtn", bits=8, group_size=32, activation_bits=8),
    "int4 GPTQ": CompressConfig("gptq", bits=4),
    "int4 GPTQ a8": CompressConfig("gptq", bits=4, activation_bits=8),
}


def quantise_activations(model) -> None:
    """Turn a weight-only compressed model's layers into activation-quantised ones, in place."""
    for module in model.net.modules():
        if isinstance(module, QuantizedLinear):
            module.spec = replace(module.spec, activation_bits=8)
            module.set_kernel("auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--chars", type=int, default=None, help="test characters (default: all)")
    parser.add_argument("--kl-windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    random = args.model in SHAPES
    base = load(args.model, torch.float32)
    text = TEST_TEXT.read_text()[: args.chars] if args.chars else None
    window = 512 if random else None
    ids = base.encode(HELD_OUT["val"].read_text())[: args.kl_windows * 256]
    kl_tokens = torch.tensor(ids).reshape(args.kl_windows, 256)  # [W, 256]
    calib = {"calib_windows": 8, "calib_length": 256} if random else {}

    def measure(model) -> dict:
        result = text_perplexity(model, text, window=window, stride=window and window * 3 // 4)
        return {"perplexity": round(result.perplexity, 3), "tokens": result.tokens,
                "mean_kl": round(mean_kl(reference, model, kl_tokens), 5)}  # fmt: skip

    with torch.no_grad():
        reference = torch.cat([logprobs(base, rows) for rows in kl_tokens.split(4)])  # [W, T, V]
        report = {"model": args.model, "parameters": base.num_parameters(), "threads": args.threads,
                  "rows": {"float32": measure(base)}}  # fmt: skip
        for name, config in ROWS.items():
            start = time.perf_counter()
            model = quantized_copy(base, replace(config, **calib))
            row = {"compress_s": round(time.perf_counter() - start, 1), "auto": measure(model)}
            set_kernels(model.net, "unpack")
            row["unpack"] = measure(model)
            report["rows"][name] = row
            print(name, row, flush=True)
            if name == "int4 GPTQ":  # its own codes with the activations quantised: no GPTQ noise
                quantise_activations(model)
                row = {"auto": measure(model)}
                set_kernels(model.net, "unpack")
                row["unpack"] = measure(model)
                report["rows"]["int4 GPTQ, same codes, a8"] = row
                print("int4 GPTQ, same codes, a8", row, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
