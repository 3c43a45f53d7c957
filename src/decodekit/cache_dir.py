"""Where decodekit keeps what it works out once per machine: the dtype probe's verdict
(models/dtype_probe.py), the measured compile warm-ups (engine/compiled.py) and the CPU kernels
it builds (models/kernels.py, under `kernels/`).

`$DECODEKIT_CACHE_DIR`, else `$XDG_CACHE_HOME/decodekit`, else `~/.cache/decodekit`. Nothing in
it is needed: a deleted cache is measured or built again.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DECODEKIT_CACHE_DIR"


def cache_dir() -> Path:
    """decodekit's cache directory (module docstring); read from the environment on every call,
    so a test or a server can point it elsewhere."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "decodekit"
    return Path.home() / ".cache" / "decodekit"
