"""`decodekit generate`: one prompt -> n completions (sampling, greedy, beam, contrastive,
constrained, healed, speculative), printed as text or one JSON document per completion."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from decodekit.cli.common import (
    Renamed,
    UsageError,
    add_compile,
    add_dtype,
    add_threads,
    apply_compile,
    given,
    model_options,
    parse_file,
    read_file,
    set_threads,
    unescape,
    warn,
)
from decodekit.params import FLAGS, INTEGER_FIELDS, PRESETS, SamplingParams, preset_values

# SamplingParams fields exposed as flags: name -> (type of one value, help), as each field
# declares (params.py `option`). Each flag is the field's name (and the server's,
# docs/server.md); None (not given) leaves the field's default.
SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    name: (int if name in INTEGER_FIELDS else float, text) for name, text in FLAGS.items()
}
STRATEGIES = ("greedy", "sample", "beam", "contrastive")
CONSTRAINT_FLAGS = ("json_schema", "regex", "grammar", "choices")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt text, taken as it is ('@FILE' too: read a file with --prompt-file); "
                   "'-' reads it from standard input")
    p.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="read the prompt from FILE (UTF-8, exactly as it is, final newline included; "
                   "'-': standard input) instead of the PROMPT argument: for prompts too long for a "
                   "command line")
    p.add_argument("--model", default="shakespeare", help="embedded model name or local directory")
    p.add_argument("--strategy", default="sample", help="|".join(STRATEGIES) + " (default sample)")
    p.add_argument("--n", type=int, default=None,
                   help="samples (or beams returned) per prompt (SamplingParams.n; default 1)")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help=f"use case's temperature and top-p (seed 003): {', '.join(PRESETS)}; "
                   "--temperature and --top-p override it")
    for name, (kind, text) in SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    p.add_argument("--stop", action="append", default=None,
                   help=r"stop string (repeatable); escapes are interpreted: \n \t \r \\ \xHH \uHHHH, "
                   r"so --stop '\n\n' stops at a blank line")
    p.add_argument("--order", default=None,
                   help="comma-separated adapter order (default: penalties, temperature, truncation; "
                   "docs/decoding.md, Sampling adapters)")
    beam = p.add_argument_group("beam search: --strategy beam (decode/beam.py)")
    beam.add_argument("--num-beams", type=int, default=None, help="beams kept per step (default 4)")
    beam.add_argument("--length-penalty", type=float, default=None,
                      help="a finished beam's score is its log-probability / length^L (default 1)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print each completion as one JSON line")
    p.add_argument("--static-decode", action="store_true",
                   help="one compiled static-shape decode step for a single row (models/static.py; "
                        "compiles on the first step)")
    add_dtype(p)
    add_compile(p)
    add_threads(p)
    add_structure_flags(p)
    add_speculative_flags(p)
    add_chat_flags(p)
    p.set_defaults(run=run_generate)


def add_chat_flags(p) -> None:
    chat = p.add_argument_group("chat: the prompt as a user message (decodekit/conversation.py, dk.chat)")
    chat.add_argument("--chat", action="store_true",
                      help="send the prompt as a user message through the model's chat template (the plain "
                      "one for a model without) and print the assistant's reply: its text, its tool calls, "
                      "a reasoning model's thinking (on stderr)")
    chat.add_argument("--system", default=None, metavar="TEXT",
                      help="a system message before it (with --chat)")
    chat.add_argument("--tools", default=None, metavar="FILE",
                      help="a JSON file of OpenAI tools (a list of {'type': 'function', 'function': {...}}) "
                      "the model may call (with --chat; examples/tools.json)")
    chat.add_argument("--tool-choice", default=None, metavar="CHOICE",
                      help="none, auto (the default with --tools), required, or a tool's name: 'required' "
                      "and a name hold the reply to calls whose arguments fit the tools' schemas")


def add_speculative_flags(p) -> None:
    spec = p.add_argument_group("speculative decoding (decode/speculative.py)")
    spec.add_argument("--draft-model", "--speculative", action=Renamed, nargs="?", const="auto", default=None,
                      metavar="DRAFT",
                      help="draft with DRAFT: a model name or directory, 'prompt-lookup', or 'self-int4' "
                      "(the target's own int4 copy); alone (after the prompt) or 'auto': the target's "
                      "'-draft' model (--speculative: deprecated)")
    spec.add_argument("--num-draft-tokens", "--gamma", action=Renamed, type=int, default=None, metavar="K",
                      help="draft tokens per target call (default 4; --gamma: deprecated)")
    spec.add_argument("--verify", choices=["block", "token"], default=None,
                      help="block (default) or token verification; both exact")
    spec.add_argument("--adaptive", "--adaptive-gamma", action=Renamed, nargs=0, const=True, default=False,
                      help="--num-draft-tokens +2 after a fully accepted draft, -1 otherwise "
                      "(--adaptive-gamma: deprecated)")
    spec.add_argument("--no-fallback", dest="fallback", action="store_const", const=False, default=None,
                      help="speculate at every step; by default a row whose measured acceptance does not "
                      "pay for the measured cost of its drafts decodes plainly, and probes again now and "
                      "then")


def add_structure_flags(p) -> None:
    """Contrastive decoding, constraints and token healing (decode/contrastive.py, constrained.py,
    healing.py)."""
    cd = p.add_argument_group("contrastive decoding: --strategy contrastive (greedy on CD scores), "
                              "or --amateur-model with any strategy")
    cd.add_argument("--amateur-model", "--amateur", action=Renamed, default=None, metavar="AMATEUR",
                    help="amateur model (default: shakespeare-draft; --amateur: deprecated)")
    cd.add_argument("--contrastive-alpha", "--alpha", action=Renamed, type=float, default=None,
                    metavar="ALPHA",
                    help="plausibility cut: keep tokens with p_e >= ALPHA max p_e (default 0.1; "
                    "--alpha: deprecated)")
    cd.add_argument("--amateur-temperature", type=float, default=None,
                    help="the amateur's temperature (default 1)")
    cd.add_argument("--amateur-window", type=int, default=None, help="amateur sees the last W tokens")
    cd.add_argument("--amateur-weight", type=float, default=None, help="beta: p_e / p_a^beta")
    structure = p.add_argument_group("structured output (at most one; a completion that runs out of "
                                     "tokens first ends with finish reason 'length' and a warning)")
    structure.add_argument("--json-schema", metavar="FILE", help="JSON schema file")
    structure.add_argument("--regex", help="regular expression the output must match")
    structure.add_argument("--grammar", metavar="FILE", help="Lark grammar file")
    structure.add_argument("--choices", help="comma-separated options: the output is one of them")
    p.add_argument("--heal", action="store_true", help="token healing of the prompt's last token")


def generation_model(args):
    """The model, or a ContrastiveLM of it against --amateur for contrastive decoding."""
    import decodekit as dk

    knobs = {"alpha": args.contrastive_alpha, "amateur_temperature": args.amateur_temperature,
             "amateur_window": args.amateur_window, "amateur_weight": args.amateur_weight}
    flags = {"alpha": "--contrastive-alpha", "amateur_temperature": "--amateur-temperature",
             "amateur_window": "--amateur-window", "amateur_weight": "--amateur-weight"}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if args.amateur_model is None and args.strategy != "contrastive" and knobs:
        raise UsageError(f"{flags[next(iter(knobs))]} needs --amateur-model or --strategy contrastive")
    model = dk.load_model(args.model, **model_options(args))
    if args.static_decode:
        from decodekit.models.native import NativeLM
        from decodekit.models.static import StaticDecodeLM

        if not isinstance(model, NativeLM):
            raise UsageError(f"--static-decode runs Llama-family models on decodekit's own forward; "
                             f"{args.model!r} loads as {type(model).__name__}")
        return StaticDecodeLM(model)
    if args.amateur_model is None and args.strategy != "contrastive":
        return model
    amateur = dk.load_model(args.amateur_model or "shakespeare-draft", **model_options(args))
    return dk.ContrastiveLM(model, amateur, **knobs)


def read_prompt(args) -> str:
    """The prompt: the PROMPT argument ('-': standard input) or the text of --prompt-file,
    exactly one of them. A PROMPT of '@FILE' stays text (a prompt may start with '@'), with
    a warning when FILE exists, since curl-style '@FILE' reading is what was likely meant."""
    if args.prompt is None and args.prompt_file is None:
        raise UsageError("no prompt: give it as an argument ('-': standard input) or with --prompt-file FILE")
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError(f"give the prompt as an argument or with --prompt-file, not both (got "
                         f"{args.prompt!r:.40} and --prompt-file {args.prompt_file})")
    if args.prompt_file is not None:
        return read_file("--prompt-file", args.prompt_file)
    if args.prompt == "-":
        return read_file("PROMPT", "-")
    if args.prompt.startswith("@") and Path(args.prompt[1:]).expanduser().is_file():
        warn(args, f"the prompt {args.prompt!r} is taken as text; to read the file, give "
             f"--prompt-file {args.prompt[1:]}")
    return args.prompt


def constraint_from(args):
    """The constraint of --json-schema, --regex, --grammar or --choices, or None."""
    given = [name for name in CONSTRAINT_FLAGS if getattr(args, name) is not None]
    if len(given) > 1:
        raise UsageError("give at most one of --json-schema, --regex, --grammar, --choices")
    if not given:
        return None
    import decodekit as dk

    if args.json_schema is not None:
        return parse_file("--json-schema", args.json_schema, dk.JsonSchema)
    if args.regex is not None:
        return dk.Regex(args.regex)
    if args.grammar is not None:
        return parse_file("--grammar", args.grammar, dk.Grammar)
    return dk.Choices([c for c in args.choices.split(",") if c] if args.choices else [])


def sampling_params(args) -> SamplingParams:
    values = {}
    if args.preset is not None:
        values["temperature"], values["top_p"] = preset_values(args.preset)
    values.update({name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None})
    if args.stop:
        values["stop"] = tuple(unescape("--stop", stop) for stop in args.stop)
    if args.order:
        values["order"] = tuple(s.strip() for s in args.order.split(","))
    if args.n is not None:
        values["n"] = args.n
    if args.strategy not in STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {args.strategy!r}")
    if args.strategy in ("greedy", "contrastive"):
        if args.preset is not None:
            raise UsageError(f"--strategy {args.strategy} takes no --preset (its temperature is 0)")
        if values.get("temperature", 0.0) != 0.0:
            raise UsageError(f"--strategy {args.strategy} takes no --temperature (it is 0)")
        values["temperature"] = 0.0
    return SamplingParams(**values)


def run_generate(args) -> None:
    args.prompt = read_prompt(args)
    params = sampling_params(args)
    mask = {"constraint": constraint_from(args), "heal": args.heal}
    check_combination(args, params, mask)
    if args.chat:
        return run_chat(args, params)
    # Loading copies the weights; torch's default of a thread per core spin-waits wherever a
    # core is busy (issue 26: 0.16 s of CPU against 0.01 s for the shipped model on a loaded
    # 2-core machine), so load on --threads or one, then choose for the model.
    set_threads(args)
    model = generation_model(args)
    set_threads(args, model)
    apply_compile(args, model)
    warn_beyond_context(args, model, params)
    # The one library call every front end makes (decode/sample.py `Run`): the strategy's `prepare`
    # checks and routes the request, and the run's deltas stream or its completions return.
    run = strategy_of(args).prepare(model, [args.prompt], params, **mask)
    streamed = args.stream and not args.json
    completions = [stream_one(args.prompt, run)] if streamed else run.completions()[0]
    if args.draft_model is not None:
        print(json.dumps({"speculative": run.stats().as_dict()}), file=sys.stderr)
    if args.json:
        for c in completions:
            print(json.dumps(completion_json(c)))
    elif not args.stream:  # (a streamed sample is printed already)
        for i, c in enumerate(completions):
            if len(completions) > 1:
                score = f" score={c.score:.4f}" if c.score is not None else ""
                print(f"--- sample {i} ({c.finish_reason}{score})")
            print(args.prompt + c.text)
    if mask["constraint"] is not None:
        warn_incomplete(args, model, params, completions)


def run_chat(args, params: SamplingParams) -> None:
    """`--chat`: the prompt as a user message (after --system), with --tools; prints each reply."""
    import decodekit as dk
    from decodekit.conversation import ChatError

    tools = None if args.tools is None else parse_file("--tools", args.tools, json.loads)
    if tools is not None and not isinstance(tools, list):
        raise UsageError(f"--tools {args.tools}: a JSON list of tools, got {type(tools).__name__}")
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
        [{"role": "user", "content": args.prompt}]
    set_threads(args)
    model = dk.load_model(args.model, **model_options(args))
    set_threads(args, model)
    apply_compile(args, model)
    flags = {"tools": "--tools", "tool_choice": "--tool-choice", "messages": "the prompt or --system",
             "chat_template_kwargs": "--chat", "model": "--model"}
    try:
        replies = dk.chat(model, messages, params, tools=tools, tool_choice=args.tool_choice)
    except ChatError as error:
        raise UsageError(f"{flags.get(error.field, error.field)}: {error}") from None
    for i, reply in enumerate(replies):
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
        if args.json:
            usage = reply.completion.usage
            print(json.dumps({"content": reply.content, "reasoning": reply.reasoning, "tool_calls": calls,
                              "finish_reason": reply.finish_reason,
                              "usage": {"prompt_tokens": usage.prompt_tokens,
                                        "completion_tokens": usage.completion_tokens}}))  # fmt: skip
            continue
        if len(replies) > 1:
            print(f"--- sample {i} ({reply.finish_reason})")
        if reply.reasoning:
            print(f"thinking: {reply.reasoning.strip()}", file=sys.stderr)
        if reply.content is not None:
            print(reply.content)
        for call in calls:
            print(f"tool call: {call['name']} {call['arguments']}")


def check_combination(args, params: SamplingParams, mask: dict) -> None:
    """Flags that cannot go together, refused before any model is loaded."""
    chat = [flag for flag, name in (("--system", "system"), ("--tools", "tools"),
                                    ("--tool-choice", "tool_choice")) if getattr(args, name) is not None]
    if chat and not args.chat:
        raise UsageError(f"{chat[0]} applies to --chat")
    if args.chat and (args.strategy not in ("greedy", "sample") or args.draft_model is not None
                      or args.amateur_model is not None or args.stream or args.static_decode
                      or any(mask.values())):  # fmt: skip
        raise UsageError("--chat works with --strategy greedy or sample, without --draft-model, "
                         "--amateur-model, --stream, --static-decode, constraints or --heal")
    speculative = ["--" + name.replace("_", "-") for name in ("num_draft_tokens", "verify", "adaptive")
                   if given(args, name)] + (["--no-fallback"] if args.fallback is False else [])  # fmt: skip
    if speculative and args.draft_model is None:
        raise UsageError(f"{speculative[0]} applies to speculative decoding: give --draft-model")
    for name in ("num_beams", "length_penalty"):
        if given(args, name) and args.strategy != "beam":
            raise UsageError(f"--{name.replace('_', '-')} applies to --strategy beam, not {args.strategy}")
    if args.draft_model is not None and (
        args.stream or args.strategy not in ("greedy", "sample") or any(mask.values())
    ):
        raise UsageError("--draft-model works with --strategy greedy or sample, without --stream, "
                         "constraints or --heal")
    if args.static_decode and (args.draft_model is not None or args.amateur_model is not None
                               or args.strategy not in ("greedy", "sample")):
        raise UsageError("--static-decode works with --strategy greedy or sample, without "
                         "--draft-model or --amateur-model")
    if args.stream and args.strategy == "beam":
        raise UsageError("--stream works with --strategy greedy or sample, not beam")
    if args.stream and not args.json and params.n != 1:
        raise UsageError(f"--stream prints one sample, so --n must be 1, got {params.n}")


def strategy_of(args):
    """The library strategy the flags ask for (decode/sample.py `Run`): speculative decoding with
    --draft-model, beam search with --strategy beam, else sampling (greedy is temperature 0)."""
    from decodekit.decode.beam import Beam
    from decodekit.decode.sample import Sample
    from decodekit.decode.speculative import Speculative

    if args.draft_model is not None:
        options = {name: getattr(args, name) for name in ("num_draft_tokens", "verify", "adaptive")
                   if given(args, name)}
        if args.fallback is False:
            options["fallback"] = False
        return Speculative(args.draft_model, **options)
    if args.strategy == "beam":
        options = {name: getattr(args, name) for name in ("num_beams", "length_penalty") if given(args, name)}
        return Beam(**options)
    return Sample()


def stream_one(prompt: str, run):
    """Print the prompt and then the run's text as it is accepted; returns the completion."""
    sys.stdout.write(prompt)
    completion = None
    for delta in run.deltas():
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        completion = delta.completion or completion
    sys.stdout.write("\n")
    return completion


def warn_beyond_context(args, model, params: SamplingParams) -> None:
    """max_new_tokens past the room the context leaves is capped by the decoders: say so."""
    prompt_tokens = len(model.encode(args.prompt))
    room = model.max_context - prompt_tokens
    if 0 < room < params.max_new_tokens:
        warn(args, f"--max-new-tokens {params.max_new_tokens} is more than the context leaves "
             f"({model.max_context} tokens, {prompt_tokens} in the prompt): at most {room} will be generated")


def warn_incomplete(args, model, params: SamplingParams, completions) -> None:
    """A constrained completion that ran out of tokens is an unfinished prefix: say so."""
    cut = [i for i, c in enumerate(completions) if c.finish_reason == "length"]
    if not cut:
        return
    which = "the output is" if len(completions) == 1 else f"sample(s) {', '.join(map(str, cut))} are"
    limit = f"--max-new-tokens {params.max_new_tokens}"
    if all(len(completions[i].token_ids) < params.max_new_tokens for i in cut):
        limit = f"the model's context ({model.max_context} tokens)"
    warn(args, f"{which} incomplete: generation reached {limit} before the constraint was complete "
         "(finish reason 'length')")


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
