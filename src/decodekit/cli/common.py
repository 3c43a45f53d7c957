"""What every subcommand shares: one-line errors and warnings, --threads, progress, plot checks.

Light at import time (no torch, no transformers) so that `decodekit --help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path


class UsageError(Exception):
    """A bad command line: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag or value prints one line (not the whole usage), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class Renamed(argparse.Action):
    """An option whose first name is current and whose later names are old ones, kept as
    deprecated aliases (issue 26: one name per thing): using one prints one warning line.
    nargs=0 with const=True is a switch; otherwise the value is stored (or const, for nargs="?")."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.option_strings[1:]:
            print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.option_strings[0]}",
                  file=sys.stderr, flush=True)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def given(args, name: str) -> bool:
    """Whether the flag of `name` was given: every flag a check depends on defaults to None
    (or False for a switch), so a value equal to the default counts as given too."""
    return getattr(args, name) not in (None, False)


def refuse_others(args, takes: dict[str, tuple[str, ...]], kind: str, label: str) -> None:
    """A flag given to a `label KIND` that does not take it (not in takes[flag]) is an error
    naming the ones that do: no flag is silently ignored."""
    for name, kinds in takes.items():
        if given(args, name) and kind not in kinds:
            flag = "--" + name.replace("_", "-")
            listed = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} and {kinds[-1]}"
            raise UsageError(f"{flag} applies to {label} {listed}, not {label} {kind}")


def warn(args, message: str) -> None:
    """One line on stderr: `decodekit COMMAND: warning: message`."""
    print(f"decodekit {args.command}: warning: {message}", file=sys.stderr, flush=True)


def add_compile(p) -> None:
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's compiled decode step (engine/compiled.py): --compile compiles it "
                   "on the first decode step, --no-compile never; default: automatic, once the "
                   "decode steps run would have repaid the compilation (a short command never waits); "
                   "on a GPU the steps replay CUDA graphs by default, --compile records inductor's "
                   "compiled step in them, --no-compile runs them eager")


def apply_compile(args, model) -> None:
    """--compile / --no-compile: the model's persistent engine (engine/engine.py `engine_for`) with the
    compiled decode step on or off; a contrastive pair's expert's."""
    if args.compile is None:
        return
    import dataclasses

    from decodekit.engine.engine import DEFAULT_CONFIG, engine_for

    model = getattr(model, "expert", model)
    if model.supports_paged_kv:
        engine_for(model, dataclasses.replace(DEFAULT_CONFIG, compile=args.compile))


def add_threads(p) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads (default: automatic, from the model's size and the free cores: "
                   "1 for the shipped models; see docs/models.md, Threads)")


def add_dtype(p) -> None:
    # Checked by load_model (models/registry.py DTYPES), which names the allowed values.
    # None when not given (model_options), so a command that takes neither can refuse them.
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="weights, activations and KV cache: auto (the checkpoint's; float32 for the "
                   "shipped models), float32, bfloat16 or float16; logits stay float32")
    # Checked by load_model too (models/registry.py resolve_device).
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the weights, activations, KV cache and logits live: cpu (default), "
                   "cuda, cuda:N, mps or auto (cuda if available, else cpu)")


def model_options(args) -> dict:
    """load_model's dtype and device, where --dtype and --device were given (its defaults:
    "auto" and "cpu")."""
    return {name: getattr(args, name) for name in ("dtype", "device") if getattr(args, name) is not None}


def set_threads(args, model=None) -> int:
    """Apply --threads (None: the automatic choice for `model`, one thread without one), before
    a command's work and again once its model is loaded (runtime.py)."""
    from decodekit.runtime import set_threads as runtime_set_threads

    return runtime_set_threads(args.threads, model)


def show_progress(args) -> bool:
    """Progress on stderr unless --json: a bar on a terminal, off one a line every few
    seconds (runtime.progress), so a long command never looks hung."""
    return not getattr(args, "json", False)


def check_plot(path: str | None) -> None:
    """Before a long run: --plot needs matplotlib and an existing directory for FILE."""
    if path is None:
        return
    from decodekit.optional import require

    require("matplotlib", "eval", "--plot")
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise UsageError(f"--plot {path}: directory {str(folder)!r} does not exist")


def check_out_dir(path: str) -> None:
    """Before a long run: `path` must be new or an empty directory, in a writable place."""
    out = Path(path).expanduser()
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"--out {path} exists and is not a directory")
        if any(out.iterdir()):
            raise UsageError(f"--out {path} is not empty; give a new or empty directory")
    parent = out.resolve()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {path}: {str(parent)!r} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: directory {str(parent)!r} is not writable")


def check_out_file(path: str) -> None:
    """Before a long run: `path` must be a new file in an existing, writable directory."""
    out = Path(path).expanduser()
    if out.exists():
        raise UsageError(f"--out {path} exists; give a new file")
    folder = out.resolve().parent
    if not folder.is_dir():
        raise UsageError(f"--out {path}: directory {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: directory {str(folder)!r} is not writable")


def read_file(flag: str, path: str, head: int | None = None) -> str | bytes:
    """The contents of the file a flag names ('-': standard input) as UTF-8 text, or its first
    `head` bytes; a missing, unreadable or undecodable file is a UsageError naming the flag
    and the path (not a raw `[Errno 2]` line that does not say which flag)."""
    if path == "-":
        if sys.stdin.isatty():  # a user typing: say how to end, so it does not look hung
            print(f"{flag} -: reading standard input; end it with Ctrl-D", file=sys.stderr, flush=True)
        data = sys.stdin.buffer.read()
    else:
        try:
            with Path(path).expanduser().open("rb") as file:
                data = file.read(-1 if head is None else head)
        except FileNotFoundError:
            raise UsageError(f"{flag} {path}: no such file") from None
        except IsADirectoryError:
            raise UsageError(f"{flag} {path}: is a directory, not a file") from None
        except OSError as error:  # permission denied, an unreadable device, ...
            raise UsageError(f"{flag} {path}: cannot read it ({error.strerror or error})") from None
    if head is not None:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte {error.start} is "
                         f"{data[error.start:error.start + 1]!r})") from None


def parse_file(flag: str, path: str, parse):
    """`parse` of the text of the file a flag names: a malformed file (`parse` raises
    ValueError or TypeError) is a UsageError naming the flag and the path."""
    text = read_file(flag, path)
    try:
        return parse(text)
    except (ValueError, TypeError) as error:
        raise UsageError(f"{flag} {path}: {error}") from None


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}
ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.|$)", re.DOTALL)


def unescape(flag: str, text: str) -> str:
    r"""Python's string escapes in a flag's value: \n \t \r \0 \\ \" \' \xHH \uHHHH \UHHHHHHHH
    (a shell passes "\n" as a backslash and an n)."""

    def one(match: re.Match) -> str:
        code = match.group(1)
        if code in ESCAPES:
            return ESCAPES[code]
        if len(code) > 1:
            value = int(code[1:], 16)
            if value <= 0x10FFFF:
                return chr(value)
        shown = "\\" + code if code else "a trailing \\"
        raise UsageError(f"{flag} {text!r}: unknown escape {shown!r} (write \\\\ for a backslash)")

    return ESCAPE.sub(one, text)
