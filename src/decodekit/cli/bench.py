"""`decodekit bench WHICH`: the benchmarks of decodekit/bench/, printed as JSON (or a table)."""

from __future__ import annotations

import json

from decodekit.cli.common import UsageError, add_dtype, add_threads, check_plot, set_threads, show_progress

BENCHES = ("decode", "constrained", "contrastive", "compress", "speculative", "server", "engine", "beam",
           "latency", "presets", "dtype", "packed", "kv", "soak")
SHAPED = ("decode", "engine", "dtype")  # the benchmarks that take --shape, --dtype and --device
SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-0.5b-16l", "llama-3.2-1b")  # models/shapes.py


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    p.add_argument("which", choices=BENCHES)
    p.add_argument("--model", default="shakespeare",
                   help="a model name or directory; bench packed also takes qwen2.5-0.5b-16l (random)")
    p.add_argument("--shape", choices=SHAPES, default=None,
                   help="bench decode/engine/dtype: a random-weight model with these layer shapes "
                   "(vocabulary cut to the embedded tokenizer's 2,048) instead of --model")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="bench dtype: the dtypes compared, and compressed copies of the float32 model "
                        "(int8-rtn, int8-gptq, int4-gptq)")
    p.add_argument("--batches", default="16,64", help="bench dtype: engine batch sizes")
    p.add_argument("--amateur", default="shakespeare-draft", help="bench contrastive: the amateur")
    p.add_argument("--draft", default="shakespeare-draft",
                   help="bench speculative: the draft model; bench presets: the second scorer")
    p.add_argument("--peer", choices=("llamacpp",), default=None,
                   help="bench packed: also time llama.cpp's f32/f16/q8_0/q4_0 GGUFs of the same model in "
                   "the same rounds and with the same --threads (built by scripts/peers.sh into .peers/ or "
                   "$DECODEKIT_PEERS; reported absent without it)")
    p.add_argument("--gguf", action="append", default=None, metavar="FILE",
                   help="bench packed: time these GGUF files (repeatable) as decodekit loads them instead of "
                   "--model's rows; with --peer llamacpp, llama.cpp on the same files (bench/gguf_files.py)")
    p.add_argument("--quick", action="store_true", help="bench speculative: a short run")
    p.add_argument("--concurrent", type=int, default=None, metavar="N",
                   help="bench speculative: N concurrent requests on the engine against N plain ones")
    p.add_argument("--concurrency", default="1,8,32,64",
                   help="bench server: client counts; bench beam: one count (default 16)")
    p.add_argument("--hardening", action="store_true", help="bench server: /health under a huge prompt "
                   "and 64 streams, a 100 MB body's 413, best-of-16 on a pool of two servers "
                   "(bench/hardening.py)")
    p.add_argument("--new-tokens", type=int, default=256)
    soak = p.add_argument_group("bench soak (the engine under random faults: bench/soak.py)")
    soak.add_argument("--requests", type=int, default=500, help="requests run in all")
    soak.add_argument("--clients", type=int, default=64, help="requests in flight at once")
    soak.add_argument("--fail-p", type=float, default=0.05, help="probability that a step's forward fails")
    soak.add_argument("--seed", type=int, default=0, help="the request mix's and the faults' seed")
    p.add_argument("--repeats", type=int, default=3)
    latency = p.add_argument_group("bench latency (seed 000's latency table)")
    latency.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    latency.add_argument("--tokens", default="1,2,4,8,16", help="comma-separated new tokens per row")
    latency.add_argument("--context", type=int, default=256, help="positions in the KV cache")
    latency.add_argument("--plot", default=None, metavar="FILE", help="a heat map (needs matplotlib)")
    add_dtype(p)
    add_threads(p)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(run=run_bench)


def run_bench(args) -> None:
    for flag, value in (("--peer", args.peer), ("--gguf", args.gguf)):
        if value is not None and args.which != "packed":
            raise UsageError(f"{flag} applies to bench packed, not bench {args.which}")
    if args.which in ("latency", "presets", "kv"):
        run_seed_bench(args)
        return
    for flag, value, default in (("--dtype", args.dtype, "auto"), ("--device", args.device, "cpu"),
                                 ("--shape", args.shape, None)):  # fmt: skip
        if value != default and args.which not in SHAPED:
            raise UsageError(f"{flag} applies to bench decode, engine and dtype, not bench {args.which}")
    if args.shape is not None and args.model != "shakespeare":
        raise UsageError("give --model or --shape, not both")
    if args.concurrent is not None and args.which != "speculative":
        raise UsageError(f"--concurrent applies to bench speculative, not bench {args.which}")
    if args.which in SHAPED:
        from decodekit.bench.decode import model_or_shape

        with model_or_shape(args.model, args.shape) as model:
            result = _run_shaped(args, model)
        if args.shape is not None:
            result["model"] = f"random {args.shape}"
        print(json.dumps(result, indent=None if args.json else 2))
        return
    threads = set_threads(args)  # the models load inside the benchmarks; None picks for a small model
    progress = show_progress(args)
    if args.which == "constrained":
        from decodekit.bench.constrained import bench_constrained

        result = bench_constrained(args.model, args.repeats, progress=progress)
    elif args.which == "contrastive":
        from decodekit.bench.contrastive import bench_contrastive

        result = bench_contrastive(args.model, args.amateur, progress=progress)
    elif args.which == "compress":
        from decodekit.bench.compress import bench_compress, table

        result = bench_compress(args.model, args.new_tokens, args.repeats, progress=progress, threads=threads)
        if not args.json:
            print(table(result))
            return
    elif args.which == "speculative" and args.concurrent is not None:
        from decodekit.bench.speculative import bench_concurrent

        if args.concurrent < 1:
            raise UsageError(f"--concurrent must be >= 1, got {args.concurrent}")
        result = bench_concurrent(args.model, args.draft, args.concurrent, args.new_tokens,
                                  repeats=args.repeats, threads=threads)
    elif args.which == "speculative":
        from decodekit.bench.speculative import bench_speculative, markdown_table

        result = bench_speculative(args.model, args.draft, new_tokens=args.new_tokens, quick=args.quick,
                                   threads=threads, progress=progress)
        if not args.json:
            print(markdown_table(result))
            return
    elif args.which == "server" and args.hardening:
        from decodekit.bench.hardening import bench_hardening

        result = bench_hardening(args.model, min(args.new_tokens, 64))
    elif args.which == "server":
        from decodekit.bench.server import bench_server, table
        from decodekit.optional import require

        for module in ("fastapi", "uvicorn", "httpx"):
            require(module, "server", "bench server")

        levels = [int(c) for c in args.concurrency.split(",")]
        result = bench_server(args.model, args.new_tokens, levels, args.repeats, progress=progress)
        if not args.json:
            print(table(result))
            return
    elif args.which == "beam":
        from decodekit.bench.beam import bench_beam
        from decodekit.optional import require

        for module in ("fastapi", "uvicorn", "httpx"):
            require(module, "server", "bench beam")
        clients = 16 if args.concurrency == "1,8,32,64" else int(args.concurrency)
        new_tokens = 32 if args.new_tokens == 256 else args.new_tokens
        result = bench_beam(args.model, clients, new_tokens=new_tokens, repeats=args.repeats,
                            progress=progress)
    elif args.which == "soak":
        from decodekit.bench.soak import bench_soak

        if args.requests < 1 or args.clients < 1 or not 0 <= args.fail_p < 1:
            raise UsageError(f"bench soak needs --requests >= 1, --clients >= 1 and --fail-p in [0, 1), got "
                             f"{args.requests}, {args.clients} and {args.fail_p}")
        result = bench_soak(args.model, args.draft, args.requests, args.clients, args.fail_p, args.seed,
                            args.new_tokens, progress=progress)
    elif args.which == "packed" and args.gguf:
        from decodekit.bench.gguf_files import bench_gguf

        result = bench_gguf(args.gguf, args.new_tokens, args.repeats, threads=threads or 1, peer=args.peer)
    elif args.which == "packed":
        from decodekit.bench.packed import bench_packed

        result = bench_packed(args.model, args.new_tokens, args.repeats, threads=threads or 1,
                              progress=progress, peer=args.peer)
    print(json.dumps(result, indent=None if args.json else 2))


def _run_shaped(args, model: str) -> dict:
    """bench decode, engine or dtype of `model` (a name or a checkpoint directory)."""
    threads = set_threads(args)
    progress = show_progress(args)
    if args.which == "engine":
        from decodekit.bench.engine import bench_engine

        return bench_engine(model, args.new_tokens, args.repeats, threads, progress=progress,
                            dtype=args.dtype, device=args.device)  # fmt: skip
    if args.which == "dtype":
        from decodekit.bench.dtype import bench_dtype

        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        batches = tuple(int_list("--batches", args.batches))
        return bench_dtype(model, dtypes, args.new_tokens, batches=batches, repeats=args.repeats,
                           device=args.device, progress=progress)  # fmt: skip
    from decodekit.bench.decode import bench_decode

    return bench_decode(model, args.new_tokens, args.repeats, progress=progress, dtype=args.dtype,
                        device=args.device)  # fmt: skip


def run_seed_bench(args) -> None:
    """bench latency, presets and kv (issue 17): a table, or JSON with --json."""
    if args.shape is not None or args.device != "cpu":
        raise UsageError(f"--shape and --device apply to bench decode, engine and dtype, "
                         f"not bench {args.which}")
    if args.which == "presets":
        if args.dtype != "auto" or args.plot:
            raise UsageError("bench presets takes no --dtype or --plot")
        from decodekit.bench.presets import bench_presets, table

        set_threads(args)
        result = bench_presets(args.model, args.draft, progress=show_progress(args))
    elif args.which == "kv":
        if args.dtype != "auto" or args.plot:
            raise UsageError("bench kv takes no --dtype or --plot")
        from decodekit.bench.kv import bench_kv, table

        set_threads(args)
        result = bench_kv(args.model, repeats=args.repeats, progress=show_progress(args))
    else:
        check_plot(args.plot)
        from decodekit.bench.latency import bench_latency, plot, table

        set_threads(args)
        result = bench_latency(args.model, int_list("--batch-sizes", args.batch_sizes),
                               int_list("--tokens", args.tokens), args.context, args.repeats, args.dtype,
                               progress=show_progress(args))
        if args.plot:
            plot(result, args.plot)
    print(json.dumps(result) if args.json else table(result))


def int_list(flag: str, text: str) -> list[int]:
    """A comma-separated list of positive integers, or a UsageError naming the flag."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag} must be comma-separated positive integers, got {text!r}")
    return values
