"""`decodekit bench WHICH`: the benchmarks of decodekit/bench/, printed as JSON (or a table)."""

from __future__ import annotations

import json

from decodekit.cli.common import UsageError, add_dtype, add_threads, set_threads, show_progress

BENCHES = ("decode", "constrained", "contrastive", "compress", "speculative", "server", "engine", "packed")


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    p.add_argument("which", choices=BENCHES)
    p.add_argument("--model", default="shakespeare",
                   help="a model name or directory; bench packed also takes qwen2.5-0.5b-16l (random)")
    p.add_argument("--amateur", default="shakespeare-draft", help="bench contrastive: the amateur")
    p.add_argument("--draft", default="shakespeare-draft", help="bench speculative: the draft model")
    p.add_argument("--quick", action="store_true", help="bench speculative: a short run")
    p.add_argument("--concurrency", default="1,8,32,64", help="bench server: client counts")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    add_dtype(p)
    add_threads(p)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(run=run_bench)


def run_bench(args) -> None:
    if args.dtype != "auto" and args.which not in ("decode", "engine"):
        raise UsageError(f"--dtype applies to bench decode and bench engine, not bench {args.which}")
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
    elif args.which == "speculative":
        from decodekit.bench.speculative import bench_speculative, markdown_table

        result = bench_speculative(args.model, args.draft, new_tokens=args.new_tokens, quick=args.quick,
                                   threads=threads, progress=progress)
        if not args.json:
            print(markdown_table(result))
            return
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
    elif args.which == "packed":
        from decodekit.bench.packed import bench_packed

        result = bench_packed(args.model, args.new_tokens, args.repeats, threads=threads or 1,
                              progress=progress)
    elif args.which == "engine":
        from decodekit.bench.engine import bench_engine

        result = bench_engine(args.model, args.new_tokens, args.repeats, threads, progress=progress,
                              dtype=args.dtype)
    else:
        from decodekit.bench.decode import bench_decode

        result = bench_decode(args.model, args.new_tokens, args.repeats, progress=progress, dtype=args.dtype)
    print(json.dumps(result, indent=None if args.json else 2))
