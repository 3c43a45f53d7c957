"""`decodekit compress MODEL --method ... --out DIR`: quantise or prune, save a loadable directory."""

from __future__ import annotations

import json

from decodekit.cli.common import (
    UsageError,
    add_threads,
    check_out_dir,
    check_out_file,
    read_file,
    set_threads,
    show_progress,
)


def add_compress(sub) -> None:
    p = sub.add_parser("compress", help="quantise or prune a model's Linear layers and save it")
    p.add_argument("model", help="embedded model name or local Llama-family directory")
    p.add_argument("--method", required=True, help="rtn|gptq (quantise) or magnitude|sparsegpt (prune)")
    p.add_argument("--bits", type=int, default=None, help="2..8 (default 8 for rtn, 4 for gptq)")
    p.add_argument("--group", type=int, default=None, help="inputs per scale (default: per channel)")
    p.add_argument("--act-order", action="store_true", help="gptq: columns by decreasing Hessian diag")
    p.add_argument("--activation-bits", type=int, default=None,
                   help="8: also quantise each layer's input per block of 32 to int8 (W8A8/W4A8, "
                        "llama.cpp's q8_0/q4_0 numerics; faster on CPU, costs perplexity: "
                        "docs/compression.md); default: weight-only")  # fmt: skip
    p.add_argument("--head-bits", default="auto", metavar="8|4|none|auto",
                   help="the output head's bits (RTN, one scale per channel), or none (float); default "
                        "auto: 8 for a vocabulary of 32,000 tokens or more, where the head is among a "
                        "small model's largest matrices, else float")  # fmt: skip
    p.add_argument("--sparsity", type=float, default=None, help="fraction pruned, [0, 1) (default 0.5)")
    p.add_argument("--n-m", default=None, help="semi-structured pruning, e.g. 2:4")
    p.add_argument("--calib", type=int, default=None,
                   help="calibration windows (gptq, sparsegpt; default 128)")
    p.add_argument("--calib-len", type=int, default=None, help="tokens per window (default: context)")
    p.add_argument("--calib-file", default=None, help="calibration text (default: Shakespeare val)")
    p.add_argument("--out", required=True,
                   help="output directory (new or empty), or FILE.gguf: a GGUF file (8 or 4 bits in "
                        "groups of 32: q8_0, q4_0) that llama.cpp and `--model FILE.gguf` load")  # fmt: skip
    add_threads(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run_compress)


def run_compress(args) -> None:
    from decodekit.compress.recipe import CompressConfig, compress_to_dir

    calibration = {"calib_windows": args.calib, "calib_length": args.calib_len}
    names = {"8": 8, "4": 4, "none": None, "auto": "auto"}
    head_bits = names.get(str(args.head_bits).lower(), args.head_bits)
    if isinstance(head_bits, str) and head_bits != "auto":
        raise UsageError(f"--head-bits must be 8, 4, none or auto, got {args.head_bits!r}")
    config = CompressConfig(
        args.method, bits=args.bits, group_size=args.group, act_order=args.act_order,
        activation_bits=args.activation_bits, head_bits=head_bits,
        sparsity=args.sparsity, n_m=args.n_m, **{k: v for k, v in calibration.items() if v is not None},
    )
    given = [flag for flag, value in (("--calib", args.calib), ("--calib-len", args.calib_len),
                                      ("--calib-file", args.calib_file)) if value is not None]
    if given and not config.needs_calibration:
        raise UsageError(f"{given[0]} applies to the methods that calibrate (gptq, sparsegpt), "
                         f"not {args.method}")
    gguf = args.out.endswith(".gguf")
    check_out_file(args.out) if gguf else check_out_dir(args.out)  # before minutes of calibration
    if args.calib_file is not None:
        read_file("--calib-file", args.calib_file)  # exists, readable, UTF-8: checked before the model loads
    set_threads(args)  # the model loads inside compress_to_dir; None picks for a small model
    if gguf:
        from decodekit.compress.gguf import compress_to_gguf

        report = compress_to_gguf(args.model, config, args.out, args.calib_file, progress=show_progress(args))
    else:
        report = compress_to_dir(args.model, config, args.out, args.calib_file, progress=show_progress(args))
    if args.json:
        print(json.dumps(report, indent=1))
        return
    mb = 1e6
    print(f"{report['model']} -> {report['out']} ({report['label']}, {report['layers']} layers): "
          f"{report['memory_bytes_before'] / mb:.2f} MB -> {report['memory_bytes_after'] / mb:.2f} MB "
          f"in memory, {report['disk_bytes'] / mb:.2f} MB on disk")
    if report.get("kernels"):
        kernels = ", ".join(f"{count} {name}" for name, count in report["kernels"].items())
        print(f"matmul kernels of the quantised layers: {kernels}")
    head_bits = (report.get("summary") or {}).get("head_bits")
    if head_bits:  # "auto" quantises it only at a real vocabulary: say so
        print(f"output head: int{head_bits}, one scale per channel (--head-bits {args.head_bits}; none keeps "
              "it in float)")
