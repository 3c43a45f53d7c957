"""`decodekit serve`: the OpenAI-compatible HTTP server (server/) over the named models."""

from __future__ import annotations

from decodekit.cli.common import add_dtype, add_threads, set_threads


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
    add_dtype(p)
    add_threads(p)
    p.set_defaults(run=run_serve)


def run_serve(args) -> None:
    from decodekit.optional import require
    from decodekit.runtime import count_parameters
    from decodekit.server.app import load_models, serve  # fails at once without the server extra
    from decodekit.server.backend import Backend, ServerConfig

    require("uvicorn", "server", "the server")
    config = ServerConfig(max_tokens=args.max_tokens, max_queued=args.max_queued,
                          request_timeout=args.timeout, reward_models=tuple(args.reward_model))
    models = load_models(args.model or ["shakespeare"], dtype=args.dtype)
    set_threads(args, max(models.values(), key=lambda m: count_parameters(m) or 0))
    serve(Backend(models, config), args.host, args.port)
