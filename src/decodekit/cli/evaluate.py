"""`decodekit eval arith|perplexity|alignment` (accuracy, perplexity, reward-KL frontier) and
`decodekit align bon` (the best-of-n calculator)."""

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

ARITH = ("strategies", "budgets", "seeds", "problems", "orm", "prm", "temperature", "width", "tau",
         "aggregate", "tree_final", "tree_max_n", "endpoint")
# A flag's name -> the tasks that take it; every one defaults to None, so another task refuses
# it (refuse_others) and a task that takes it gets its own default (EvalConfig's for arith).
TAKES: dict[str, tuple[str, ...]] = {
    **{name: ("perplexity",) for name in ("text", "split", "window", "stride", "dtype", "device")},
    **{name: ("arith",) for name in ARITH},
    **{name: ("alignment",) for name in ("value", "reward", "base_samples", "samples")},
    "model": ("arith", "perplexity"),
    "plot": ("arith", "alignment"),
}


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluations: accuracy against compute (prints a table or JSON)")
    p.add_argument("task", choices=sorted(EVAL_TASKS), help="arith (accuracy against compute), perplexity "
                   "(held-out text) or alignment (reward-KL frontier)")
    p.add_argument("target", nargs="?", metavar="MODEL", help="perplexity: model (default shakespeare)")
    p.add_argument("--text", default=None, help="perplexity: text file (default: the held-out "
                   "Shakespeare plays of --split)")
    p.add_argument("--split", default=None, choices=["test", "val"],
                   help="perplexity: which shipped held-out plays (default test)")
    p.add_argument("--window", type=int, default=None, help="perplexity: tokens per window (context)")
    p.add_argument("--stride", type=int, default=None, help="perplexity: window step (window / 2)")
    p.add_argument("--strategies", default=None,
                   help="arith: comma-separated, e.g. majority,bon-orm,beam-prm,rebase-oracle (default all; "
                   "with several --model: majority,weighted-orm,rebase-prm)")
    p.add_argument("--budgets", "--n", action=Renamed, default=None, metavar="N[,N...]",
                   help="arith: the budgets N (samples per problem), comma-separated (default "
                   "1,2,4,8,16,32; with several --model: 1,2,4,8,16,32,64; --n: deprecated)")
    p.add_argument("--seeds", type=int, default=None,
                   help="arith: sampling seeds (bands in the plot; default 3)")
    p.add_argument("--problems", type=int, default=None, help="arith: held-out problems (default 50)")
    p.add_argument("--model", action="append", default=None,
                   help="arith: the policy (default arith); repeat it to compare sizes by accuracy "
                   "against inference FLOPs (meta/compute_optimal.py); perplexity: the model")
    p.add_argument("--orm", action="append", default=None, help="arith: outcome reward model (name or "
                   "directory), one per --model in order (default: MODEL-orm)")
    p.add_argument("--prm", action="append", default=None, help="arith: process reward model (name or "
                   "directory), one per --model in order (default: MODEL-prm)")
    p.add_argument("--temperature", type=float, default=None, help="arith: sampling temperature (default 1)")
    p.add_argument("--width", type=int, default=None, help="arith: tree search's children per expanded node "
                   "(default 4)")
    p.add_argument("--tau", type=float, default=None,
                   help="arith: REBASE's softmax temperature (default 0.2)")
    p.add_argument("--aggregate", default=None,
                   help="arith: a solution's score from its step scores: last (default), min or product")
    p.add_argument("--tree-final", default=None,
                   help="arith: tree search's answer: best, vote or weighted_vote (default)")
    p.add_argument("--tree-max-n", type=int, default=None,
                   help="arith: run tree search only up to this N (default: every N)")
    p.add_argument("--value", default=None, choices=["bag", "hidden"],
                   help="alignment: the controlled-decoding value: an embedding bag on token ids (bag, "
                   "the default) or a Q head on the model's hidden states (hidden)")
    p.add_argument("--reward", default=None, choices=["keywords", "style"],
                   help="alignment: keyword count (sparse, the default) or log-likelihood per token "
                   "under another speaker's prompt (style, dense)")
    p.add_argument("--base-samples", type=int, default=None, metavar="N",
                   help="alignment: base samples that train the values (default 256 for bag, "
                   "4096 for hidden)")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="alignment: samples per controlled-decoding point (default 64)")
    add_threads(p)
    add_dtype(p)
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="arith: accuracy against compute, alignment: the frontier, as a PNG to FILE")
    p.add_argument("--endpoint", action="append", default=None, metavar="URL",
                   help="arith: generate on an OpenAI-compatible server serving --model (meta/remote.py); "
                   "repeat it to spread the samples over a pool of servers")
    p.set_defaults(run=run_eval)


def run_eval(args) -> None:
    if args.target is not None and args.task != "perplexity":
        raise UsageError(f"eval {args.task} takes no MODEL argument (use --model), got {args.target!r}")
    refuse_others(args, TAKES, args.task, "eval")
    if args.model and len(args.model) > 1 and args.task != "arith":
        raise UsageError(f"several --model compare sizes in eval arith only, not eval {args.task}")
    EVAL_TASKS[args.task](args)


def run_eval_arith(args) -> None:
    from decodekit.meta.evaluate import STRATEGIES, EvalConfig, evaluate_arith, plot, table

    models = reward_pairs(args)
    several = len(models) > 1
    if several and args.endpoint:
        raise UsageError(f"--endpoint serves one model; got {len(models)} --model")
    options = {name: getattr(args, name) for name in ("seeds", "problems", "temperature", "width", "tau",
                                                      "aggregate", "tree_final", "tree_max_n")
               if getattr(args, name) is not None}  # the others: EvalConfig's defaults
    if args.budgets is not None or several:
        budgets = args.budgets or "1,2,4,8,16,32,64"
        try:
            options["ns"] = tuple(int(x) for x in budgets.split(","))
        except ValueError:
            raise UsageError(f"--budgets must be comma-separated integers, got {args.budgets!r}") from None
    strategies = args.strategies or ("majority,weighted-orm,rebase-prm" if several else "all")
    names = STRATEGIES if strategies == "all" else tuple(s.strip() for s in strategies.split(","))
    (model, orm, prm) = models[0]
    config = EvalConfig(strategies=names, model=model, orm=orm, prm=prm, **options)
    check_plot(args.plot)
    set_threads(args)  # the models load inside evaluate_arith; None picks for a small model
    if several:
        run_eval_sizes(args, config, models)
        return
    generator, failures = None, ()
    if args.endpoint:
        from decodekit.meta.remote import RemoteError, RemoteGenerator
        from decodekit.optional import require

        require("httpx", "server", "--endpoint")

        urls = args.endpoint[0] if len(args.endpoint) == 1 else args.endpoint
        generator, failures = RemoteGenerator(urls, model), (RemoteError,)
    try:
        report = evaluate_arith(config, generator=generator, progress=show_progress(args))
    except failures as error:  # the endpoint failed after every retry: one line, no traceback
        raise UsageError(f"--endpoint: {error}") from None
    show_report(args, report, plot, "accuracy (generated tokens per problem)", table)


def show_report(args, report: dict, plot, title: str, table) -> None:
    """An eval arith report: the plot to --plot, then JSON with --json, else title and table."""
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(title)
    print(table(report))
    if args.plot:
        print(f"plot: {args.plot}")


def reward_pairs(args) -> list[tuple[str, str, str]]:
    """(model, orm, prm) per --model: --orm/--prm in order when given, else MODEL-orm/-prm."""
    from decodekit.meta.compute_optimal import reward_names

    models = args.model or ["arith"]
    pairs = []
    for flag, given in (("--orm", args.orm), ("--prm", args.prm)):
        if given is not None and len(given) != len(models):
            raise UsageError(f"give {flag} once per --model ({len(models)}) or not at all, "
                             f"got {len(given)}")
    for i, model in enumerate(models):
        orm, prm = reward_names(model)
        pairs.append((model, args.orm[i] if args.orm else orm, args.prm[i] if args.prm else prm))
    return pairs


def run_eval_sizes(args, config, models) -> None:
    """Several --model: accuracy against inference FLOPs and the compute-optimal frontier."""
    from decodekit.meta.compute_optimal import evaluate_sizes, plot_sizes, table_sizes

    report = evaluate_sizes(config, models, progress=show_progress(args))
    show_report(args, report, plot_sizes, "accuracy (inference FLOPs per problem)", table_sizes)


def run_eval_perplexity(args) -> None:
    """Held-out per-token perplexity in strided windows (compress/evaluate.py)."""
    from pathlib import Path

    import decodekit as dk
    from decodekit.compress.evaluate import HELD_OUT, text_perplexity

    name = args.target or (args.model[0] if args.model else "shakespeare")
    if args.text is not None and args.split is not None:
        raise UsageError("give --text or --split, not both")
    text_path = Path(args.text) if args.text else HELD_OUT[args.split or "test"]
    text = read_file("--text", args.text) if args.text else text_path.read_text()
    model = dk.load_model(name, **model_options(args))
    set_threads(args, model)
    result = text_perplexity(model, text, args.window, args.stride, progress=show_progress(args))
    if args.json:
        print(json.dumps({"model": name, "text": str(text_path), **result.to_dict()}, indent=1))
        return
    print(f"{name}: perplexity {result.perplexity:.4f} (nll {result.nll:.4f} nats/token, "
          f"{result.bits_per_char:.4f} bits/char over {result.tokens} tokens of {text_path.name}; "
          f"window {result.window}, stride {result.stride})")


def run_eval_alignment(args) -> None:
    """Reward–KL frontier on the Shakespeare model (align/frontier.py)."""
    from decodekit.align.frontier import FrontierConfig, alignment_frontier, plot_frontier, table

    check_plot(args.plot)
    value = args.value or "bag"
    base_samples = args.base_samples if args.base_samples is not None else 4096 if value == "hidden" else 256
    samples = 64 if args.samples is None else args.samples
    for flag, number in (("--base-samples", base_samples), ("--samples", samples)):
        if number < 1:
            raise UsageError(f"{flag} must be >= 1, got {number}")
    config = FrontierConfig(value=value, reward=args.reward or "keywords", base_samples=base_samples,
                            samples=samples, threads=set_threads(args))  # set around its run
    report = alignment_frontier(config, progress=show_progress(args))
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


def add_align(sub) -> None:
    p = sub.add_parser("align", help="inference-time alignment calculators")
    align = p.add_subparsers(dest="align_command", required=True)
    bon = align.add_parser("bon", help="best-of-n: exact KL, bound, estimate and win rate")
    bon.add_argument("--n", type=int, required=True, help="number of samples (best of n)")
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
    check_plot(args.plot)
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
