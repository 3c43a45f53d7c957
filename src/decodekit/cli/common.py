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


def warn(args, message: str) -> None:
    """One line on stderr: `decodekit COMMAND: warning: message`."""
    print(f"decodekit {args.command}: warning: {message}", file=sys.stderr, flush=True)


def add_threads(p) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads (default: automatic, from the model's size and the free cores: "
                   "1 for the shipped models; see README, Threads)")


def add_dtype(p) -> None:
    # Checked by load_model (models/registry.py DTYPES), which names the allowed values.
    p.add_argument("--dtype", default="auto", metavar="DTYPE",
                   help="weights, activations and KV cache: auto (the checkpoint's; float32 for the "
                   "shipped models), float32, bfloat16 or float16; logits stay float32")
    # Checked by load_model too (models/registry.py resolve_device).
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where the weights, activations, KV cache and logits live: cpu (default), "
                   "cuda, cuda:N, mps or auto (cuda if available, else cpu)")


def set_threads(args, model=None) -> int:
    """Apply --threads (None: the automatic choice for `model`), once per command (runtime.py)."""
    from decodekit.runtime import set_threads as runtime_set_threads

    return runtime_set_threads(args.threads, model)


def show_progress(args) -> bool:
    """Progress bars on stderr: on a terminal, and not with --json."""
    return not getattr(args, "json", False) and sys.stderr.isatty()


def quiet_model_loading() -> None:
    """Silence transformers' progress bars ("Loading weights" of every from_pretrained):
    decodekit's own output is the command's answer, not a loading log."""
    from transformers.utils import logging

    logging.disable_progress_bar()


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
