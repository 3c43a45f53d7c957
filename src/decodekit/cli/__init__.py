"""The `decodekit` command: a thin layer over the Python API.

Heavy modules (torch, transformers) are imported inside the command functions so
that `decodekit --help` answers at once. User errors print one line to stderr and
exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from decodekit.params import SamplingParams

# SamplingParams fields exposed as flags: name -> type of one value.
SAMPLING_FLAGS: dict[str, type] = {
    "max_new_tokens": int,
    "min_new_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "typical_p": float,
    "epsilon": float,
    "eta": float,
    "top_n_sigma": float,
    "min_tokens_to_keep": int,
    "mirostat_tau": float,
    "mirostat_eta": float,
    "xtc_threshold": float,
    "xtc_probability": float,
    "dry_multiplier": float,
    "dry_base": float,
    "dry_allowed_length": int,
    "repetition_penalty": float,
    "frequency_penalty": float,
    "presence_penalty": float,
    "no_repeat_ngram_size": int,
    "seed": int,
    "logprobs": int,
}
STRATEGIES = ("greedy", "sample", "beam", "contrastive")
CONSTRAINT_FLAGS = ("json_schema", "regex", "grammar", "choices")


class UsageError(Exception):
    """A bad command line: printed as one line, exit status 2."""


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt")
    p.add_argument("--model", default="shakespeare", help="embedded model name or local directory")
    p.add_argument("--strategy", default="sample", help="|".join(STRATEGIES))
    p.add_argument("--n", type=int, default=1, help="samples (or beams returned) per prompt")
    for name, kind in SAMPLING_FLAGS.items():
        if name != "seed":
            p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--order", default=None, help="comma-separated adapter order")
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print completions as JSON")
    add_structure_flags(p)
    add_speculative_flags(p)
    p.set_defaults(run=run_generate)


def add_speculative_flags(p) -> None:
    spec = p.add_argument_group("speculative decoding (decode/speculative.py)")
    spec.add_argument("--speculative", nargs="?", const="auto", default=None, metavar="DRAFT",
                      help="draft with DRAFT: a model name or directory, or 'prompt-lookup'; "
                      "alone (after the prompt): the target's '-draft' model")
    spec.add_argument("--gamma", type=int, default=4, help="draft tokens per target call")
    spec.add_argument("--verify", choices=["block", "token"], default="block")
    spec.add_argument("--adaptive-gamma", action="store_true",
                      help="gamma +2 after a fully accepted draft, -1 otherwise")


def add_structure_flags(p) -> None:
    """Contrastive decoding, constraints and token healing (decode/contrastive.py, constrained.py,
    healing.py)."""
    cd = p.add_argument_group("contrastive decoding: --strategy contrastive (greedy on CD scores), "
                              "or --amateur with any strategy")
    cd.add_argument("--amateur", default=None, help="amateur model (default: shakespeare-draft)")
    cd.add_argument("--alpha", type=float, default=None, help="plausibility cut (default 0.1)")
    cd.add_argument("--amateur-temperature", type=float, default=None)
    cd.add_argument("--amateur-window", type=int, default=None, help="amateur sees the last W tokens")
    cd.add_argument("--amateur-weight", type=float, default=None, help="beta: p_e / p_a^beta")
    structure = p.add_argument_group("structured output (at most one)")
    structure.add_argument("--json-schema", metavar="FILE", help="JSON schema file")
    structure.add_argument("--regex", help="regular expression the output must match")
    structure.add_argument("--grammar", metavar="FILE", help="Lark grammar file")
    structure.add_argument("--choices", help="comma-separated options: the output is one of them")
    p.add_argument("--heal", action="store_true", help="token healing of the prompt's last token")


def generation_model(args):
    """The model, or a ContrastiveLM of it against --amateur for contrastive decoding."""
    import decodekit as dk

    model = dk.load_model(args.model)
    knobs = {"alpha": args.alpha, "amateur_temperature": args.amateur_temperature,
             "amateur_window": args.amateur_window, "amateur_weight": args.amateur_weight}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if args.amateur is None and args.strategy != "contrastive":
        if knobs:
            raise UsageError(f"--{next(iter(knobs)).replace('_', '-')} needs --amateur or "
                             "--strategy contrastive")
        return model
    return dk.ContrastiveLM(model, dk.load_model(args.amateur or "shakespeare-draft"), **knobs)


def constraint_from(args):
    """The constraint of --json-schema, --regex, --grammar or --choices, or None."""
    from pathlib import Path

    import decodekit as dk

    given = [name for name in CONSTRAINT_FLAGS if getattr(args, name) is not None]
    if len(given) > 1:
        raise UsageError("give at most one of --json-schema, --regex, --grammar, --choices")
    if args.json_schema is not None:
        return dk.JsonSchema(Path(args.json_schema).read_text())
    if args.regex is not None:
        return dk.Regex(args.regex)
    if args.grammar is not None:
        return dk.Grammar(Path(args.grammar).read_text())
    if args.choices is not None:
        return dk.Choices([c for c in args.choices.split(",") if c] if args.choices else [])
    return None


def sampling_params(args) -> SamplingParams:
    values = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.stop:
        values["stop"] = tuple(args.stop)
    if args.order:
        values["order"] = tuple(s.strip() for s in args.order.split(","))
    values["n"] = args.n
    if args.strategy not in STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {args.strategy!r}")
    if args.strategy in ("greedy", "contrastive"):
        if values.get("temperature", 0.0) != 0.0:
            raise UsageError(f"--strategy {args.strategy} takes no --temperature (it is 0)")
        values["temperature"] = 0.0
    return SamplingParams(**values)


def run_generate(args) -> None:
    import decodekit as dk

    params = sampling_params(args)
    model = generation_model(args)
    mask = {"constraint": constraint_from(args), "heal": args.heal}
    if args.speculative is not None:
        completions = speculative_completions(args, model, params, mask)
    elif args.strategy == "beam":
        if args.stream:
            raise UsageError("--stream works with --strategy greedy or sample, not beam")
        completions = dk.beam_search(
            model, args.prompt, params, num_beams=args.num_beams, length_penalty=args.length_penalty,
            **mask,
        )
    elif args.stream and not args.json:
        if params.n != 1:
            raise UsageError(f"--stream prints one sample, so --n must be 1, got {params.n}")
        sys.stdout.write(args.prompt)
        for piece in dk.stream(model, args.prompt, params, **mask):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    else:
        completions = dk.generate(model, args.prompt, params, **mask)
    if args.json:
        print(json.dumps([completion_json(c) for c in completions], indent=2))
        return
    for i, c in enumerate(completions):
        if len(completions) > 1:
            score = f" score={c.score:.4f}" if c.score is not None else ""
            print(f"--- sample {i} ({c.finish_reason}{score})")
        print(args.prompt + c.text)


def speculative_completions(args, model, params, mask) -> list:
    import decodekit as dk

    if args.stream or args.strategy not in ("greedy", "sample") or any(mask.values()):
        raise UsageError("--speculative works with --strategy greedy or sample, without --stream, "
                         "constraints or --heal")
    result = dk.speculative_generate(model, args.speculative, args.prompt, params,
                                     num_draft_tokens=args.gamma, verify=args.verify,
                                     adaptive=args.adaptive_gamma)
    print(json.dumps({"speculative": result.stats.as_dict()}), file=sys.stderr)
    return result.completions


def completion_json(c) -> dict:
    return {
        "text": c.text,
        "token_ids": c.token_ids,
        "logprobs": c.logprobs,
        "processed_logprobs": c.processed_logprobs,
        "top_logprobs": c.top_logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "score": c.score,
        "usage": {"prompt_tokens": c.usage.prompt_tokens, "completion_tokens": c.usage.completion_tokens},
    }


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list the embedded models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_models)


def run_models(args) -> None:
    from decodekit.models.registry import embedded_models

    models = embedded_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return
    print(f"{'name':<20} {'kind':<6} {'parameters':>11} {'size':>9}  measured")
    for name, entry in models.items():
        size = entry.get("size_bytes") or entry.get("size") or 0
        size_text = f"{size / 1e6:.1f} MB" if isinstance(size, int | float) else str(size)
        params = entry.get("parameters", "")
        params_text = f"{params:,}" if isinstance(params, int) else str(params)
        metric = entry.get("metric") or entry.get("metrics") or ""
        if isinstance(metric, dict):
            metric = ", ".join(f"{k}={v}" for k, v in metric.items())
        print(f"{name:<20} {entry.get('kind', 'hf'):<6} {params_text:>11} {size_text:>9}  {metric}")


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    p.add_argument("which", choices=["decode", "constrained", "contrastive", "compress", "speculative",
                                     "server", "engine"])
    p.add_argument("--model", default="shakespeare")
    p.add_argument("--amateur", default="shakespeare-draft", help="bench contrastive: the amateur")
    p.add_argument("--draft", default="shakespeare-draft", help="bench speculative: the draft model")
    p.add_argument("--quick", action="store_true", help="bench speculative: a short run")
    p.add_argument("--concurrency", default="1,8,32,64", help="bench server: client counts")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="bench engine: torch threads")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(run=run_bench)


def run_bench(args) -> None:
    if args.which == "constrained":
        from decodekit.bench.constrained import bench_constrained

        result = bench_constrained(args.model, args.repeats)
    elif args.which == "contrastive":
        from decodekit.bench.contrastive import bench_contrastive

        result = bench_contrastive(args.model, args.amateur)
    elif args.which == "compress":
        from decodekit.bench.compress import bench_compress, table

        result = bench_compress(args.model, args.new_tokens, args.repeats,
                                progress=lambda row: print(json.dumps(row), file=sys.stderr, flush=True))
        if not args.json:
            print(table(result))
            return
    elif args.which == "speculative":
        from decodekit.bench.speculative import bench_speculative, markdown_table

        result = bench_speculative(args.model, args.draft, new_tokens=args.new_tokens, quick=args.quick)
        if not args.json:
            print(markdown_table(result))
            return
    elif args.which == "server":
        from decodekit.bench.server import bench_server, table

        levels = [int(c) for c in args.concurrency.split(",")]
        result = bench_server(args.model, args.new_tokens, levels, args.repeats)
        if not args.json:
            print(table(result))
            return
    elif args.which == "engine":
        from decodekit.bench.engine import bench_engine

        result = bench_engine(args.model, args.new_tokens, args.repeats, args.threads)
    else:
        from decodekit.bench.decode import bench_decode

        result = bench_decode(args.model, args.new_tokens, args.repeats)
    print(json.dumps(result, indent=None if args.json else 2))


def add_align(sub) -> None:
    p = sub.add_parser("align", help="inference-time alignment calculators")
    align = p.add_subparsers(dest="align_command", required=True)
    bon = align.add_parser("bon", help="best-of-n: exact KL, bound, estimate and win rate")
    bon.add_argument("--n", type=int, required=True, help="number of samples")
    bon.add_argument("--p", required=True, help="base probabilities, comma-separated")
    bon.add_argument("--r", required=True, help="rewards, comma-separated (ties allowed)")
    bon.add_argument("--json", action="store_true", help="print JSON (with the curve 1..n)")
    bon.add_argument("--plot", default=None, help="write KL and win rate against n to FILE.png")
    bon.set_defaults(run=run_align_bon)


def float_list(flag: str, text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def run_align_bon(args) -> None:
    from decodekit.align.report import bon_report, plot_bon

    p, r = float_list("--p", args.p), float_list("--r", args.r)
    report = bon_report(p, r, args.n, curve=args.json)
    if args.plot:
        plot_bon(p, r, args.n, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"best-of-{report['n']} over p = {report['p']}, r = {report['r']}")
    print(f"  KL(pi_n || p)  exact     {report['kl']:.6f} nats")
    print(f"                 bound     {report['kl_bound']:.6f}  (log n - (n-1)/n)")
    print(f"                 estimate  {report['kl_estimate']:.6f}  (E over pi_n of D^(p(y)))")
    print(f"                 max       {report['kl_max']:.6f}  (-log p(top reward))")
    print(f"  win rate       exact     {report['win_rate']:.6f}  (ties count 1/2)")
    print(f"                 bound     {report['win_rate_bound']:.6f}  (n/(n+1))")
    if args.plot:
        print(f"  plot: {args.plot}")


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluations: accuracy against compute (prints a table or JSON)")
    p.add_argument("task", choices=sorted(EVAL_TASKS))
    p.add_argument("target", nargs="?", metavar="MODEL", help="perplexity: model (default shakespeare)")
    p.add_argument("--text", default=None, help="perplexity: text file (default: held-out Shakespeare)")
    p.add_argument("--window", type=int, default=None, help="perplexity: tokens per window (context)")
    p.add_argument("--stride", type=int, default=None, help="perplexity: window step (window / 2)")
    p.add_argument("--strategies", default="all",
                   help="comma-separated, e.g. majority,bon-orm,beam-prm,rebase-oracle (default all)")
    p.add_argument("--n", default="1,2,4,8,16,32", help="budgets N, comma-separated")
    p.add_argument("--seeds", type=int, default=3, help="sampling seeds (bands in the plot)")
    p.add_argument("--problems", type=int, default=50, help="held-out problems")
    p.add_argument("--model", default="arith")
    p.add_argument("--orm", default="arith-orm", help="outcome reward model (name or directory)")
    p.add_argument("--prm", default="arith-prm", help="process reward model (name or directory)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--width", type=int, default=4, help="tree search: children per expanded node")
    p.add_argument("--tau", type=float, default=0.2, help="REBASE softmax temperature")
    p.add_argument("--aggregate", default="last", help="step scores: last|min|product")
    p.add_argument("--tree-final", default="weighted_vote", help="best|vote|weighted_vote")
    p.add_argument("--tree-max-n", type=int, default=None, help="run tree search only up to this N")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--plot", default=None, help="write accuracy against tokens to FILE.png")
    p.add_argument("--endpoint", default=None, help="generate on an OpenAI-compatible server (URL) "
                   "serving --model (meta/remote.py)")
    p.set_defaults(run=run_eval)


def run_eval(args) -> None:
    if args.target is not None and args.task != "perplexity":
        raise UsageError(f"eval {args.task} takes no MODEL argument (use --model), got {args.target!r}")
    EVAL_TASKS[args.task](args)


def run_eval_arith(args) -> None:
    import torch

    from decodekit.meta.evaluate import STRATEGIES, EvalConfig, evaluate_arith, plot, table

    try:
        ns = tuple(int(x) for x in args.n.split(","))
    except ValueError:
        raise UsageError(f"--n must be comma-separated integers, got {args.n!r}") from None
    names = STRATEGIES if args.strategies == "all" else tuple(s.strip() for s in args.strategies.split(","))
    config = EvalConfig(
        strategies=names, ns=ns, seeds=args.seeds, problems=args.problems,
        temperature=args.temperature, width=args.width, tau=args.tau, aggregate=args.aggregate,
        tree_final=args.tree_final, tree_max_n=args.tree_max_n, model=args.model, orm=args.orm,
        prm=args.prm,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    progress = None if args.json else lambda line: print(line, file=sys.stderr, flush=True)
    generator = None
    if args.endpoint:
        from decodekit.meta.remote import RemoteGenerator

        generator = RemoteGenerator(args.endpoint, args.model)
    report = evaluate_arith(config, generator=generator, progress=progress)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("accuracy (generated tokens per problem)")
    print(table(report))
    if args.plot:
        print(f"plot: {args.plot}")


def run_eval_perplexity(args) -> None:
    """Held-out per-token perplexity in strided windows (compress/evaluate.py)."""
    from pathlib import Path

    import decodekit as dk
    from decodekit.compress.evaluate import TEST_TEXT, text_perplexity

    name = args.target or (args.model if args.model != "arith" else "shakespeare")
    text_path = Path(args.text) if args.text else TEST_TEXT
    result = text_perplexity(dk.load_model(name), text_path.read_text(), args.window, args.stride)
    if args.json:
        print(json.dumps({"model": name, "text": str(text_path), **result.to_dict()}, indent=1))
        return
    print(f"{name}: perplexity {result.perplexity:.4f} (nll {result.nll:.4f} nats/token over "
          f"{result.tokens} tokens of {text_path.name}; window {result.window}, stride {result.stride})")


def run_eval_alignment(args) -> None:
    """Reward–KL frontier on the Shakespeare model (align/frontier.py)."""
    from decodekit.align.frontier import FrontierConfig, alignment_frontier, plot_frontier, table

    config = FrontierConfig()
    progress = None if args.json else lambda line: print(line, file=sys.stderr, flush=True)
    report = alignment_frontier(config, progress)
    if args.plot:
        plot_frontier(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(table(report))
    if args.plot:
        print(f"plot: {args.plot}")


EVAL_TASKS = {"arith": run_eval_arith, "perplexity": run_eval_perplexity,  # `decodekit eval TASK`
              "alignment": run_eval_alignment}


def add_compress(sub) -> None:
    p = sub.add_parser("compress", help="quantise or prune a model's Linear layers and save it")
    p.add_argument("model", help="embedded model name or local Llama-family directory")
    p.add_argument("--method", required=True, help="rtn|gptq (quantise) or magnitude|sparsegpt (prune)")
    p.add_argument("--bits", type=int, default=None, help="2..8 (default 8 for rtn, 4 for gptq)")
    p.add_argument("--group", type=int, default=None, help="inputs per scale (default: per channel)")
    p.add_argument("--act-order", action="store_true", help="gptq: columns by decreasing Hessian diag")
    p.add_argument("--sparsity", type=float, default=None, help="fraction pruned, [0, 1) (default 0.5)")
    p.add_argument("--n-m", default=None, help="semi-structured pruning, e.g. 2:4")
    p.add_argument("--calib", type=int, default=128, help="calibration windows (gptq, sparsegpt)")
    p.add_argument("--calib-len", type=int, default=None, help="tokens per window (default: context)")
    p.add_argument("--calib-file", default=None, help="calibration text (default: Shakespeare val)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run_compress)


def run_compress(args) -> None:
    from decodekit.compress.recipe import CompressConfig, compress_to_dir

    config = CompressConfig(
        args.method, bits=args.bits, group_size=args.group, act_order=args.act_order,
        sparsity=args.sparsity, n_m=args.n_m, calib_windows=args.calib, calib_length=args.calib_len,
    )
    report = compress_to_dir(args.model, config, args.out, args.calib_file)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    mb = 1e6
    print(f"{report['model']} -> {report['out']} ({report['label']}, {report['layers']} layers): "
          f"{report['memory_bytes_before'] / mb:.2f} MB -> {report['memory_bytes_after'] / mb:.2f} MB "
          f"in memory, {report['disk_bytes'] / mb:.2f} MB on disk")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (README: Server)")
    p.add_argument("--model", action="append", default=None,
                   help="embedded name, directory or ALIAS=PATH; repeatable (default shakespeare)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=2048, help="bound on a request's max_tokens")
    p.add_argument("--max-queued", type=int, default=256, help="queued requests per model before 503")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request before 504")
    p.add_argument("--reward-model", action="append", default=[], help="scorer requests may name")
    p.set_defaults(run=run_serve)


def run_serve(args) -> None:
    from decodekit.server.app import serve
    from decodekit.server.backend import ServerConfig

    config = ServerConfig(max_tokens=args.max_tokens, max_queued=args.max_queued,
                          request_timeout=args.timeout, reward_models=tuple(args.reward_model))
    serve(args.model or ["shakespeare"], args.host, args.port, config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decodekit", description="Language-model decoding, meta-generation and alignment."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_models(sub)
    add_bench(sub)
    add_align(sub)
    add_eval(sub)
    add_compress(sub)
    add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (UsageError, ValueError, TypeError, FileNotFoundError) as error:
        print(f"decodekit {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
