"""`decodekit serve`: the OpenAI-compatible HTTP server (server/) over the named models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from decodekit.cli.common import (
    add_compile,
    add_dtype,
    add_threads,
    apply_compile,
    model_options,
    set_threads,
)


def port_number(text: str) -> int:
    """--port: 1-65535, or 0 for a free port (uvicorn prints the one it picked)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1-65535 (0: any free port), got {text!r}")
    return port


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)")
    p.add_argument("--model", action="append", default=None,
                   help="embedded name, directory or ALIAS=PATH; repeatable (default shakespeare)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="TCP port, 1-65535; 0 picks a free one and prints it (default 8000)")
    p.add_argument("--max-tokens", type=int, default=2048, help="bound on a request's max_tokens")
    p.add_argument("--max-n", type=int, default=64, help="bound on a request's n, best_of and num_beams")
    p.add_argument("--max-queued", type=int, default=256, help="queued requests per model before 503")
    p.add_argument("--kv-gib", type=float, default=None, metavar="GIB",
                   help="each model's KV cache bound in GiB (default: 0.25 on the CPU, 40%% of a GPU's "
                   "free memory)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request before 504")
    p.add_argument("--reward-model", action="append", default=[], help="scorer requests may name")
    add_dtype(p)
    add_compile(p)
    p.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on every route but /health "
                   "(default: $DECODEKIT_API_KEY, else no key)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body; larger: 413")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST[,HOST]",
                   help="Host names accepted besides localhost, 127.0.0.1, [::1] and --host ('*': any)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed to call the server (CORS); none by default")
    p.add_argument("--chat-template", action="append", default=[], metavar="[MODEL=]FILE",
                   help="a Jinja chat template file for /v1/chat/completions, replacing the model's "
                   "own; MODEL=FILE for one served model; repeatable")
    p.add_argument("--strict-fields", action="store_true",
                   help="answer 400 to a body key the server does not know, as OpenAI does "
                   "(default: ignore it, log it and name it in the X-Ignored-Fields header, as vLLM does)")
    p.add_argument("--strict-max-tokens", action="store_true",
                   help="answer 400 to a max_tokens beyond the context left after the prompt "
                   "(default: shorten it to fit, finish_reason \"length\", as vLLM does)")
    p.add_argument("--truncate-prompts", action="store_true",
                   help="cut a prompt that does not fit the context to its last tokens, leaving one to "
                   "generate, and name what was cut in the X-Prompt-Tokens-Dropped header (default: 400, "
                   "as vLLM; a request's truncate_prompt_tokens applies either way)")
    add_threads(p)
    p.set_defaults(run=run_serve)


def chat_templates(specs: list[str], served: list[str]) -> dict[str, str]:
    """Served name -> template text from --chat-template FILE (every model) or MODEL=FILE; a
    file that cannot be read, or is not a Jinja template, is a ValueError naming it."""
    from jinja2 import Environment, TemplateSyntaxError

    templates: dict[str, str] = {}
    for spec in specs:
        name, given, rest = spec.partition("=")
        names, path = ([name], rest) if given and name in served else (served, spec)
        try:
            text = Path(path).expanduser().read_text()
            Environment().parse(text)
        except OSError as error:
            raise ValueError(f"--chat-template {spec}: cannot read {path} ({error.strerror}); give FILE or "
                             f"MODEL=FILE with MODEL one of {served}") from None
        except TemplateSyntaxError as error:
            raise ValueError(f"--chat-template {spec}: not a Jinja template (line {error.lineno}: "
                             f"{error.message})") from None
        templates.update(dict.fromkeys(names, text))
    return templates


def run_serve(args) -> None:
    import os

    from decodekit.optional import require
    from decodekit.runtime import count_parameters
    from decodekit.server.app import directory_aliases, load_served, serve  # needs the server extra
    from decodekit.server.backend import Backend, ServerConfig

    require("uvicorn", "server", "the server")
    if not 0 < args.max_body_mb < 2**30:
        raise ValueError(f"--max-body-mb must be a number of megabytes > 0, got {args.max_body_mb}")
    if args.kv_gib is not None and not 0 < args.kv_gib < 2**20:
        raise ValueError(f"--kv-gib must be a number of GiB > 0, got {args.kv_gib}")
    kv_bytes = None if args.kv_gib is None else max(int(args.kv_gib * 2**30), 1)
    hosts = tuple(name.strip() for names in args.allowed_hosts for name in names.split(",") if name.strip())
    config = ServerConfig(max_tokens=args.max_tokens, max_n=args.max_n, max_queued=args.max_queued,
                          kv_bytes=kv_bytes,
                          request_timeout=args.timeout, reward_models=tuple(args.reward_model),
                          api_key=args.api_key or os.environ.get("DECODEKIT_API_KEY") or None,
                          max_body_bytes=max(int(args.max_body_mb * 2**20), 1), allowed_hosts=hosts,
                          cors_origins=tuple(args.cors_origin), strict_fields=args.strict_fields,
                          strict_max_tokens=args.strict_max_tokens, truncate_prompts=args.truncate_prompts)
    models, sources = load_served(args.model or ["shakespeare"], **model_options(args))
    templates = chat_templates(args.chat_template, list(models))
    aliases = directory_aliases(sources)
    for name, source in sources.items():
        also = [alias for alias, served in aliases.items() if served == name]
        print(f"decodekit serve: model {name!r} from {source}" + (f" (also as {also[0]!r})" if also else ""),
              file=sys.stderr, flush=True)
    set_threads(args, max(models.values(), key=lambda m: count_parameters(m) or 0))
    for model in models.values():
        apply_compile(args, model)
    serve(Backend(models, config, aliases, templates), args.host, args.port)
