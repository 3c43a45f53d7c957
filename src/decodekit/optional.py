"""Optional dependencies (pyproject's extras): import one, or say in one line how to install it.

    llguidance = require("llguidance", "constrained", "constrained decoding")

A missing module raises `MissingDependency` (an ImportError) whose message is the exact
command that installs the extra in this environment: for an editable install from a
checkout, `.venv/bin/pip install -e '.[server]'` (relative paths when run from the checkout's
root, absolute ones elsewhere); otherwise `python -m pip install 'decodekit[server]'`.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message says how to install it."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise MissingDependency naming the command that installs `extra`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(module, extra, feature) from None


def missing(module: str, extra: str, feature: str) -> MissingDependency:
    top = module.split(".")[0]
    return MissingDependency(f"{feature} needs {top}, which is not installed; run: {install_command(extra)}")


def install_command(extra: str) -> str:
    """The command that installs decodekit's `extra` into the running interpreter's environment."""
    python = Path(sys.executable)
    pip = python.with_name("pip")
    checkout = Path(__file__).resolve().parents[2]  # src/decodekit/optional.py -> the checkout
    editable = (checkout / "pyproject.toml").is_file() and (checkout / "src" / "decodekit").is_dir()
    # Paths as typed from the checkout's root when that is where we are, else absolute.
    here = editable and Path.cwd().resolve() == checkout
    installer = f"{_shown(pip, here)}" if pip.is_file() else f"{_shown(python, here)} -m pip"
    if editable:
        return f"{installer} install -e '{_shown(checkout, here)}[{extra}]'"
    return f"{installer} install 'decodekit[{extra}]'"


def _shown(path: Path, relative: bool) -> str:
    absolute = Path(os.path.abspath(path))
    if relative and absolute.is_relative_to(Path.cwd()):
        return str(absolute.relative_to(Path.cwd()))
    return str(absolute)
