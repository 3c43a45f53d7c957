"""`decodekit bench WHICH`: the benchmarks of decodekit/bench/, printed as JSON (or a table)."""

from __future__ import annotations

import json

from decodekit.cli.common import (
    Renamed,
    UsageError,
    add_dtype,
    add_threads,
    check_plot,
    model_options,
    read_file,
    refuse_others,
    set_threads,
    show_progress,
)

BENCHES = ("decode", "constrained", "contrastive", "compress", "speculative", "server", "engine", "beam",
           "latency", "presets", "dtype", "packed", "kv", "soak", "startup")
SHAPED = ("decode", "engine", "dtype")  # the benchmarks that take --shape
# models/shapes.py
SHAPES = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-0.5b-16l", "llama-3.2-1b", "gemma-3-1b",
          "qwen3-30b-a3b-2l", "llama-3.1-8b-4l")
TIMED = ("constrained", "compress", "speculative", "server", "engine", "beam", "latency", "dtype", "packed",
         "kv", "decode", "startup")  # the benchmarks that take --repeats

# A flag's name -> the benchmarks that take it. Every such flag defaults to None (not given),
# so a benchmark that does not take it refuses it (refuse_others) and one that does gets
# DEFAULTS' value: no flag is compared with its default, none is silently ignored.
TAKES: dict[str, tuple[str, ...]] = {
    "shape": SHAPED,
    "dtype": ("decode", "engine", "latency"),
    "device": ("decode", "engine", "dtype"),
    "dtypes": ("dtype",),
    "batches": ("dtype",),
    "amateur_model": ("contrastive",),
    "draft_model": ("speculative", "soak"),
    "judge_model": ("presets",),
    "peer": ("packed", "server"),
    "peer_url": ("server",),
    "gguf": ("packed",),
    "compile": ("engine", "packed"),
    "eager": ("engine",),
    "quick": ("speculative",),
    "clients": ("speculative", "server", "beam", "soak"),
    "prompt_tokens": ("speculative",),
    "hardening": ("server",),
    "new_tokens": ("decode", "engine", "dtype", "compress", "speculative", "server", "beam", "soak",
                   "packed"),
    "requests": ("soak",),
    "fail_p": ("soak",),
    "seed": ("soak",),
    "repeats": TIMED,
    "batch_sizes": ("latency",),
    "tokens": ("latency",),
    "context": ("latency",),
    "plot": ("latency",),
}
# Values of the flags not given: (flag, benchmark) first ("hardening": bench server --hardening),
# then (flag, None) for all of them; a flag with neither stays None (bench speculative's
# --clients: not given, the sweep runs).
DEFAULTS: dict[tuple[str, str | None], object] = {
    ("model", None): "shakespeare",
    ("dtypes", None): "float32,bfloat16",
    ("batches", None): "16,64",
    ("amateur_model", None): "shakespeare-draft",
    ("judge_model", None): "shakespeare-draft",
    ("clients", "server"): "1,8,32,64",
    ("clients", "beam"): "16",
    ("clients", "soak"): "64",
    ("new_tokens", None): 256,
    ("new_tokens", "beam"): 32,
    ("new_tokens", "hardening"): 64,
    ("requests", None): 500,
    ("fail_p", None): 0.05,
    ("seed", None): 0,
    ("repeats", None): 3,
    ("batch_sizes", None): "1,2,4,8,16,32,64",
    ("tokens", None): "1,2,4,8,16",
    ("context", None): 256,
}


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    p.add_argument("which", choices=BENCHES, help="the benchmark (docs/command-line.md; BENCHMARKS.md)")
    p.add_argument("--model", default=None,
                   help="a model name or directory (default shakespeare); bench packed also takes "
                   "qwen2.5-0.5b-16l (random)")
    p.add_argument("--shape", choices=SHAPES, default=None,
                   help="bench decode/engine/dtype: a random-weight model with these layer shapes "
                   "(vocabulary cut to the embedded tokenizer's 2,048) instead of --model")
    p.add_argument("--dtypes", default=None,
                   help="bench dtype: the dtypes compared, and compressed copies of the float32 model "
                        "(int8-rtn, int8-gptq, int4-gptq; default float32,bfloat16)")
    p.add_argument("--batches", default=None, help="bench dtype: engine batch sizes (default 16,64)")
    p.add_argument("--amateur-model", "--amateur", action=Renamed, default=None, metavar="AMATEUR",
                   help="bench contrastive: the amateur (default shakespeare-draft; --amateur: deprecated)")
    p.add_argument("--draft-model", "--draft", action=Renamed, default=None, metavar="DRAFT",
                   help="bench speculative and soak: the draft model (default the model's embedded "
                   "draft: shakespeare-draft for shakespeare, shakespeare-large-draft for shakespeare-large; "
                   "--draft: deprecated)")
    p.add_argument("--judge-model", default=None, metavar="JUDGE",
                   help="bench presets: the second model that scores the samples (default shakespeare-draft)")
    p.add_argument("--peer", choices=("llamacpp", "vllm"), default=None,
                   help="bench packed (llamacpp): also time llama.cpp's f32/f16/q8_0/q4_0 GGUFs of the same "
                   "model in the same rounds and with the same --threads (built by scripts/peers.sh into "
                   ".peers/ or $DECODEKIT_PEERS; reported absent without it); bench server (vllm): the same "
                   "load on vLLM's server, interleaved (--peer-url, or $DECODEKIT_VLLM's or PATH's `vllm` "
                   "started on the same model and threads; reported absent without one)")
    p.add_argument("--peer-url", default=None, metavar="URL",
                   help="bench server --peer vllm: a running vLLM server to load instead of starting one")
    p.add_argument("--gguf", action="append", default=None, metavar="FILE",
                   help="bench packed: time these GGUF files (repeatable) as decodekit loads them instead of "
                   "--model's rows; with --peer llamacpp, llama.cpp on the same files (bench/gguf_files.py)")
    p.add_argument("--quick", action="store_true", help="bench speculative: a short run")
    p.add_argument("--compile", action="store_true",
                   help="bench engine/packed: decodekit runs the engine's compiled decode step "
                   "(engine/compiled.py), compiled in the warm-up; default the eager step on the CPU, "
                   "and on a GPU the engine's own (decode steps replayed from CUDA graphs), which "
                   "--compile compiles with inductor first")
    p.add_argument("--eager", action="store_true",
                   help="bench engine: the eager decode step on a GPU too (no CUDA graphs)")
    p.add_argument("--clients", "--concurrent", "--concurrency", action=Renamed, default=None,
                   metavar="N[,N...]",
                   help="requests in flight at once: bench server, a comma-separated list of levels "
                   "(default 1,8,32,64); bench beam (default 16) and soak (default 64), one count; "
                   "bench speculative, N concurrent requests batched on the engine against N plain ones "
                   "instead of the sweep over the draft length (--concurrent, --concurrency: deprecated)")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="P",
                   help="bench speculative --clients: prompts of exactly P tokens (windows of the shipped "
                   "validation text; prompt and draft KV cached before the timed runs) instead of short "
                   "held-out speeches and the copy workload (past 512 positions: a RoPE-scaled copy of the "
                   "models, benchmarks/speculative_long_context.py)")
    p.add_argument("--hardening", action="store_true", help="bench server: /health under a huge prompt "
                   "and 64 streams, a 100 MB body's 413, best-of-16 on a pool of two servers "
                   "(bench/hardening.py)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens generated per request, EOS ignored (default 256; bench beam 32, "
                   "bench server --hardening 64)")
    soak = p.add_argument_group("bench soak (the engine under random faults: bench/soak.py)")
    soak.add_argument("--requests", type=int, default=None, help="requests run in all (default 500)")
    soak.add_argument("--fail-p", type=float, default=None,
                      help="probability that a step's forward fails (default 0.05)")
    soak.add_argument("--seed", type=int, default=None,
                      help="the request mix's and the faults' seed (default 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 3)")
    latency = p.add_argument_group("bench latency (seed 000's latency table)")
    latency.add_argument("--batch-sizes", default=None,
                         help="comma-separated batch sizes (default 1,2,4,8,16,32,64)")
    latency.add_argument("--tokens", default=None,
                         help="comma-separated new tokens per row (default 1,2,4,8,16)")
    latency.add_argument("--context", type=int, default=None, help="positions in the KV cache (default 256)")
    latency.add_argument("--plot", default=None, metavar="FILE", help="a heat map (needs matplotlib)")
    add_dtype(p)
    add_threads(p)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(run=run_bench)


def settle(args) -> None:
    """Refuse the flags `args.which` does not take; fill in the defaults of those not given."""
    refuse_others(args, TAKES, args.which, "bench")
    if args.shape is not None and args.model is not None:
        raise UsageError("give --model or --shape, not both")
    if args.quick and args.clients is not None:
        raise UsageError("--quick shortens the sweep of bench speculative; --clients runs the concurrent "
                         "comparison instead")
    if args.prompt_tokens is not None and args.clients is None:
        raise UsageError("--prompt-tokens sets the prompt length of bench speculative --clients N; "
                         "give --clients")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise UsageError(f"--prompt-tokens must be a positive integer, got {args.prompt_tokens}")
    if args.hardening and (args.clients is not None or args.repeats is not None or args.peer is not None):
        raise UsageError("bench server --hardening runs its own fixed load: no --clients, --repeats or "
                         "--peer")
    which = "hardening" if args.hardening else args.which
    for name in dict.fromkeys(name for name, _ in DEFAULTS):
        if getattr(args, name) is None:
            for key in ((name, which), (name, args.which), (name, None)):
                if key in DEFAULTS:
                    setattr(args, name, DEFAULTS[key])
                    break
    if args.which in ("speculative", "soak") and args.draft_model is None:
        from decodekit.models.registry import default_draft

        args.draft_model = default_draft(args.model)
        if args.draft_model is None:
            raise UsageError(f"bench {args.which}: {args.model!r} has no embedded draft model; "
                             "give --draft-model")
    if args.clients is not None and args.which != "server":
        [args.clients] = int_list("--clients", args.clients, one=True)
    wanted = {"packed": "llamacpp", "server": "vllm"}.get(args.which)
    if args.peer is not None and args.peer != wanted:
        raise UsageError(f"bench {args.which} takes --peer {wanted}, not {args.peer}")
    if args.peer_url is not None and args.peer != "vllm":
        raise UsageError("--peer-url is the server of --peer vllm: give --peer vllm with it")


def run_bench(args) -> None:
    settle(args)
    if args.which in ("latency", "presets", "kv"):
        run_seed_bench(args)
        return
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

        result = bench_contrastive(args.model, args.amateur_model, progress=progress)
    elif args.which == "compress":
        from decodekit.bench.compress import bench_compress, table

        result = bench_compress(args.model, args.new_tokens, args.repeats, progress=progress, threads=threads)
        if not args.json:
            print(table(result))
            return
    elif args.which == "speculative" and args.clients is not None:
        from decodekit.bench.speculative import bench_concurrent

        result = bench_concurrent(args.model, args.draft_model, args.clients, args.new_tokens,
                                  repeats=args.repeats, threads=threads, prompt_tokens=args.prompt_tokens)
    elif args.which == "speculative":
        from decodekit.bench.speculative import bench_speculative, markdown_table

        result = bench_speculative(args.model, args.draft_model, new_tokens=args.new_tokens, quick=args.quick,
                                   threads=threads, repeats=args.repeats, progress=progress)
        if not args.json:
            print(markdown_table(result))
            return
    elif args.which == "server" and args.hardening:
        from decodekit.bench.hardening import bench_hardening

        result = bench_hardening(args.model, args.new_tokens)
    elif args.which == "server":
        from decodekit.bench.server import bench_server, table
        from decodekit.optional import require

        for module in ("fastapi", "uvicorn", "httpx"):
            require(module, "server", "bench server")

        levels = int_list("--clients", args.clients)
        result = bench_server(args.model, args.new_tokens, levels, args.repeats, progress=progress,
                              peer=args.peer, peer_url=args.peer_url)
        if not args.json:
            print(table(result))
            return
    elif args.which == "beam":
        from decodekit.bench.beam import bench_beam
        from decodekit.optional import require

        for module in ("fastapi", "uvicorn", "httpx"):
            require(module, "server", "bench beam")
        result = bench_beam(args.model, args.clients, new_tokens=args.new_tokens, repeats=args.repeats,
                            progress=progress)
    elif args.which == "soak":
        from decodekit.bench.soak import bench_soak

        if args.requests < 1 or not 0 <= args.fail_p < 1:
            raise UsageError(f"bench soak needs --requests >= 1 and --fail-p in [0, 1), got "
                             f"{args.requests} and {args.fail_p}")
        result = bench_soak(args.model, args.draft_model, args.requests, args.clients, args.fail_p, args.seed,
                            args.new_tokens, progress=progress)
    elif args.which == "startup":
        from decodekit.bench.startup import bench_startup

        result = bench_startup(args.model, args.repeats, progress=progress)
    elif args.which == "packed" and args.gguf:
        from decodekit.bench.gguf_files import bench_gguf

        for path in args.gguf:
            if read_file("--gguf", path, head=4) != b"GGUF":
                raise UsageError(f"--gguf {path}: not a GGUF file (it does not start with 'GGUF')")
        result = bench_gguf(args.gguf, args.new_tokens, args.repeats, threads=threads or 1, peer=args.peer,
                            compile=args.compile)
    elif args.which == "packed":
        from decodekit.bench.packed import bench_packed

        result = bench_packed(args.model, args.new_tokens, args.repeats, threads=threads or 1,
                              progress=progress, peer=args.peer, compile=args.compile)
    print(json.dumps(result, indent=None if args.json else 2))


def _run_shaped(args, model: str) -> dict:
    """bench decode, engine or dtype of `model` (a name or a checkpoint directory)."""
    threads = set_threads(args)
    progress = show_progress(args)
    if args.which == "engine":
        from decodekit.bench.engine import bench_engine

        # on a GPU the engine's default (CUDA graphs) unless --eager; on the CPU eager unless --compile
        default = False if args.eager or not str(args.device or "").startswith("cuda") else None
        return bench_engine(model, args.new_tokens, args.repeats, threads, progress=progress,
                            compile=args.compile or default, **model_options(args))
    if args.which == "dtype":
        from decodekit.bench.dtype import bench_dtype

        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        batches = tuple(int_list("--batches", args.batches))
        return bench_dtype(model, dtypes, args.new_tokens, batches=batches, repeats=args.repeats,
                           progress=progress, **model_options(args))
    from decodekit.bench.decode import bench_decode

    return bench_decode(model, args.new_tokens, args.repeats, progress=progress, **model_options(args))


def run_seed_bench(args) -> None:
    """bench latency, presets and kv (issue 17): a table, or JSON with --json."""
    if args.which == "presets":
        from decodekit.bench.presets import bench_presets, table

        set_threads(args)
        result = bench_presets(args.model, args.judge_model, progress=show_progress(args))
    elif args.which == "kv":
        from decodekit.bench.kv_compression import bench_kv, table

        set_threads(args)
        result = bench_kv(args.model, repeats=args.repeats, progress=show_progress(args))
    else:
        check_plot(args.plot)
        from decodekit.bench.latency import bench_latency, plot, table

        set_threads(args)
        result = bench_latency(args.model, int_list("--batch-sizes", args.batch_sizes),
                               int_list("--tokens", args.tokens), args.context, args.repeats,
                               progress=show_progress(args), **model_options(args))
        if args.plot:
            plot(result, args.plot)
    print(json.dumps(result) if args.json else table(result))


def int_list(flag: str, text: str, one: bool = False) -> list[int]:
    """A comma-separated list of positive integers (`one`: a single one), or a UsageError
    naming the flag."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if one and len(values) != 1:
        raise UsageError(f"{flag} must be one positive integer here, got {text!r}")
    if not values or min(values) < 1:
        raise UsageError(f"{flag} must be comma-separated positive integers, got {text!r}")
    return values
