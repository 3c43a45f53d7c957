"""The `decodekit` command: a thin layer over the Python API, one module per subcommand.

Heavy modules (torch, transformers) are imported inside the command functions so
that `decodekit --help` answers at once. User errors print one line to stderr and
exit with status 2; a missing optional dependency prints one line naming the command
that installs it and exits with status 1; Ctrl-C ends the line, prints "interrupted" and
exits with status 130; no traceback.
"""

from __future__ import annotations

import argparse
import sys

from decodekit.cli.bench import add_bench
from decodekit.cli.common import Parser, UsageError
from decodekit.cli.compress import add_compress
from decodekit.cli.doctor import add_doctor
from decodekit.cli.evaluate import add_align, add_eval
from decodekit.cli.generate import add_generate
from decodekit.cli.models import add_models
from decodekit.cli.plan import add_plan
from decodekit.cli.serve import add_serve

__all__ = ["UsageError", "build_parser", "main"]

# Commands that load a model (and so get --threads).
RUNS_A_MODEL = ("generate", "bench", "eval", "compress", "serve")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("decodekit")
    except PackageNotFoundError:
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """--version, looked up only when asked (importlib.metadata costs every start 40 ms)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"decodekit {version()}")
        parser.exit()


def build_parser() -> Parser:
    parser = Parser(prog="decodekit", description="Language-model decoding, meta-generation and alignment.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_models(sub)
    add_bench(sub)
    add_align(sub)
    add_eval(sub)
    add_compress(sub)
    add_serve(sub)
    add_plan(sub)
    add_doctor(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from decodekit.optional import MissingDependency

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except MissingDependency as error:
        print(f"decodekit {args.command}: error: {error}", file=sys.stderr)
        return 1
    except (UsageError, ValueError, TypeError, FileNotFoundError) as error:
        print(f"decodekit {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: end a streamed line, say so in one line, 128 + SIGINT
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"decodekit {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0
