"""Whether a bfloat16 checkpoint stays bfloat16 on this CPU: `dtype="auto"` by measurement.

One CPU flag does not say whether bfloat16 is fast: an AMD Zen 4/5 has AVX-512-BF16 but no
AMX, and there bfloat16 decodes at 0.72-0.76x float32 (Qwen2.5-0.5B's layers, one thread;
BENCHMARKS.md), while on an AMX machine it decodes 1.5x faster. So "auto" asks the machine:
`measure` times decode-shaped work through decodekit's own linear path
(`models.linear.apply_linear` over layers prepared by `transpose_weight_layout`, as a loaded
model's are), so a faster kernel landing in that path changes the verdict by itself.

The work: Qwen2.5-0.5B's MLP (the fused gate/up 896 -> 9728 and down 4864 -> 896), `COPIES`
times over so that even the bfloat16 weights (52 MB) outgrow a 32 MB L3 and stream from
memory as a real model's do. Decode: one row through every layer, the best of `DECODE_ROUNDS`
rounds; prefill (reported, not part of the rule): `PREFILL_ROWS` rows through one pair. The
two dtypes alternate round by round, on one torch thread (what a CPU decode of one request
uses; `--threads` may differ, and BENCHMARKS.md shows the verdict at two threads).

The rule (`choose`): bfloat16 is kept where its decode is at least as fast as float32's
(`BF16_KEEP_AT` = 1.0: t_float32 / t_bfloat16 >= 1.0); otherwise the model loads as float32.
The machines measured sit far from the line (0.72-0.76x without AMX, ~1.5x with it), beyond
the probe's few percent of noise; a machine within that noise of 1.0 may get either, at a
cost of those few percent.

The verdict is cached in `dtype-probe.json` in decodekit's cache directory (cache_dir.py:
`$DECODEKIT_CACHE_DIR`, else `$XDG_CACHE_HOME/decodekit`, else `~/.cache/decodekit`), keyed
by the CPU (vendor, family, model, name, flags), torch's and decodekit's versions, a digest of
the linear path's source and whether decodekit's GEMV kernels run (models/kernels.py); an
unreadable, corrupt or unwritable cache is ignored (the probe runs again).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from decodekit.cache_dir import cache_dir

CACHE_FILE = "dtype-probe.json"
CACHE_FORMAT = 1
MAX_ENTRIES = 8  # several machines may share one home directory
BF16_KEEP_AT = 1.0  # keep bfloat16 where t_float32 / t_bfloat16 at decode is at least this
HIDDEN, INTERMEDIATE = 896, 4864  # Qwen2.5-0.5B
COPIES = 2
DECODE_ROUNDS = 5
PREFILL_ROWS, PREFILL_ROUNDS = 16, 2
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name")
SOURCES = ("native.py", "kernels.py")  # the linear path, hashed into the key


def cpu_identity() -> dict[str, str]:
    """The CPU's vendor, family, model, name and a digest of its flags (/proc/cpuinfo on
    Linux; `platform` elsewhere)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in (*CPU_FIELDS, "flags") and name not in fields:
                    fields[name] = value.strip()
                if not line.strip() and fields:
                    break  # the first processor's block is enough
    except OSError:
        pass
    flags = fields.pop("flags", "")
    identity = {name: fields.get(name, "") for name in CPU_FIELDS}
    identity["machine"] = platform.machine()
    identity["processor"] = platform.processor()
    identity["flags"] = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]
    identity["bf16_flags"] = " ".join(f for f in sorted(flags.split()) if "bf16" in f or "amx" in f)
    return identity


def decodekit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("decodekit")
    except PackageNotFoundError:
        return "unknown"


def probe_key() -> dict[str, Any]:
    """What the cached verdict depends on (module docstring)."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in SOURCES:
        path = here / name
        digest.update(path.read_bytes() if path.exists() else b"")
    from decodekit.models import kernels

    status = kernels.status()  # built or not, loaded or disabled: it changes what apply_linear runs
    kernel = f"{status.reason} {status.library.name}" if status.available else status.reason
    return {"cpu": cpu_identity(), "torch": torch.__version__, "decodekit": decodekit_version(),
            "source": digest.hexdigest()[:16], "kernels": kernel,
            "probe": [HIDDEN, INTERMEDIATE, COPIES]}  # fmt: skip


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _layers(dtype: torch.dtype) -> list[torch.nn.Linear]:
    """COPIES of the MLP's two weights in `dtype`, laid out as a loaded NativeLM's are."""
    from decodekit.models.native import transpose_weight_layout

    layers = []
    for _ in range(COPIES):
        for out_features, in_features in ((2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)):
            with torch.device("meta"):
                layer = torch.nn.Linear(in_features, out_features, bias=False)
            # Constant weights: a GEMV's speed does not depend on the values (no denormals).
            weight = torch.full((out_features, in_features), 0.01, dtype=dtype)
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            layers.append(layer)
    transpose_weight_layout(torch.nn.ModuleList(layers))
    return layers


def _run(layers: list[torch.nn.Linear], rows: int) -> None:
    """`rows` rows through each layer, as a forward sends them (x [1, rows, in])."""
    from decodekit.models.linear import apply_linear

    for layer in layers:
        apply_linear(layer, torch.ones(1, rows, layer.in_features, dtype=layer.weight.dtype), False)


@torch.inference_mode()
def measure() -> dict[str, float]:
    """Seconds of one decode pass and one prefill block in float32 and bfloat16 (module
    docstring): {"decode_float32": s, "decode_bfloat16": s, "prefill_float32": s, ...}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the verdict is for one thread (module docstring); restored below
    try:
        layers = {dtype: _layers(dtype) for dtype in (torch.float32, torch.bfloat16)}
        best: dict[str, float] = {}
        for stage, rows, rounds, count in (("decode", 1, DECODE_ROUNDS, None), ("prefill", PREFILL_ROWS,
                                           PREFILL_ROUNDS, 2)):  # fmt: skip
            for round_ in range(rounds + 1):  # round 0 warms up
                for dtype, stack in layers.items():
                    start = time.perf_counter()
                    _run(stack[:count], rows)
                    seconds = time.perf_counter() - start
                    name = f"{stage}_{str(dtype).removeprefix('torch.')}"
                    if round_:
                        best[name] = min(best.get(name, seconds), seconds)
        return best
    finally:
        torch.set_num_threads(threads)


def choose(timings: dict[str, float]) -> torch.dtype:
    """The rule (module docstring): bfloat16 where its decode is at least BF16_KEEP_AT times
    float32's speed, else float32."""
    speedup = timings["decode_float32"] / timings["decode_bfloat16"]
    return torch.bfloat16 if speedup >= BF16_KEEP_AT else torch.float32


def read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries by key id; {} for a missing, unreadable or malformed file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) and data.get("format") == CACHE_FORMAT else None
    if not isinstance(entries, dict):
        return {}
    return {name: entry for name, entry in entries.items() if isinstance(entry, dict)}


def valid_entry(entry: Any, key: dict[str, Any]) -> bool:
    """An entry made for `key` whose timings `choose` can read."""
    if not isinstance(entry, dict) or entry.get("key") != key:
        return False
    timings = entry.get("timings")
    names = ("decode_float32", "decode_bfloat16")
    return isinstance(timings, dict) and all(
        isinstance(timings.get(n), int | float) and timings[n] > 0 for n in names
    )


def write_cache(path: Path, entries: dict[str, Any]) -> bool:
    """Write `entries` (the newest MAX_ENTRIES) atomically; False where it cannot."""
    newest = dict(sorted(entries.items(), key=lambda item: str(item[1].get("probed", "")))[-MAX_ENTRIES:])
    out = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".dtype-probe-", delete=False) as out:
            json.dump({"format": CACHE_FORMAT, "entries": newest}, out, indent=1)
        os.replace(out.name, path)
    except OSError:
        if out is not None:
            Path(out.name).unlink(missing_ok=True)
        return False
    return True


def probe() -> dict[str, Any]:
    """This machine's verdict with its evidence: from the cache when it holds one for this
    machine and build, else measured (`measure`) and cached where it can be."""
    path = cache_dir() / CACHE_FILE
    key = probe_key()
    entries = read_cache(path)
    entry = entries.get(key_id(key))
    if valid_entry(entry, key):
        return {**entry, "dtype": choose(entry["timings"]), "cached": True, "cache": str(path)}
    start = time.perf_counter()
    timings = measure()
    entry = {"key": key, "timings": timings, "probe_s": round(time.perf_counter() - start, 3),
             "probed": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    stored = write_cache(path, {**entries, key_id(key): entry})
    return {**entry, "dtype": choose(timings), "cached": False, "cache": str(path) if stored else None}


def cpu_bfloat16_dtype() -> torch.dtype:
    """The dtype "auto" gives a bfloat16 checkpoint on the CPU (module docstring)."""
    return probe()["dtype"]


def dtype_report() -> dict[str, Any]:
    """What "auto" does on this CPU, and why: JSON-able (`decodekit models` prints it)."""
    found = probe()
    timings = found["timings"]
    ratio = {stage: round(timings[f"{stage}_float32"] / timings[f"{stage}_bfloat16"], 2)
             for stage in ("decode", "prefill") if f"{stage}_bfloat16" in timings}  # fmt: skip
    from decodekit.models import kernels

    return {"bfloat16_checkpoint": str(found["dtype"]).removeprefix("torch."),
            "float16_checkpoint": "float32", "float32_checkpoint": "float32",
            # a half checkpoint run in float32: its linear weights (registry.py `half_weights_dtype`)
            "half_checkpoint_weights": "as stored" if kernels.available() else "float32",
            "bf16_speed_vs_float32": ratio, "rule": f"bfloat16 kept where its decode is >= "
            f"{BF16_KEEP_AT}x float32's (one thread, Qwen2.5-0.5B's MLP)",
            "bf16_flags": found["key"]["cpu"]["bf16_flags"], "timings_s": timings,
            "probe_s": found["probe_s"], "probed": found["probed"], "cached": found["cached"],
            "cache": found["cache"]}  # fmt: skip
