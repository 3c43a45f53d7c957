"""Where decodekit's CPU kernels (models/kernels.py, csrc/) are built, found and remembered.

One library per key: a digest of csrc/'s sources, torch's version and the CPU's instruction
set (`isa_tag`), named like `gemv-1a2b3c4d5e6f-torch2.13.0_cpu-x86_64-avx2.so`, so a stale or
mismatched build is never loaded. It is looked for in two places (`find`):

- `_native/` beside the sources when they lie in a checkout (an editable install:
  `src/decodekit/models` under a directory holding pyproject.toml). scripts/setup.sh builds
  there (or copies there the library another clone built into the cache: `into_build_dir`),
  and the test suite, which points DECODEKIT_CACHE_DIR at a temporary directory, finds it
  there;
- `kernels/` in decodekit's cache directory (cache_dir.py), where an installed package (a
  wheel) builds it.

`ensure` builds it at first use when neither holds one: one g++ command per source, run side
by side, then one link. That costs ~80 s of CPU with g++ 12 on an AMD EPYC Zen 3 (21-26 s per
source, mostly torch's headers), so minutes of wall time on a busy machine: 464 s on 2 cores
at a load average of 12 (BENCHMARKS.md, "Kernel build"). One line on stderr announces it and
ends with the time it took. Two processes that start at once build once: the builder holds
`<name>.lock` (`fcntl.flock`), the other waits and then loads what it built, and the library
appears under its final name only when complete (a rename). A failure (no compiler, a
compile error) is remembered in `<name>.failed` beside it, so later processes run the
pure-torch paths without trying again (`python -m decodekit.models.kernels --build` tries
again). A CPU without AVX2 + FMA, or one that is not x86-64, is never built for.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from decodekit.cache_dir import cache_dir

CSRC = Path(__file__).with_name("csrc")
BUILD_DIR = Path(__file__).with_name("_native")  # a checkout's builds (gitignored)
CHECKOUT = Path(__file__).resolve().parents[3]  # src/decodekit/models/ -> the checkout, if any
CACHE_SUBDIR = "kernels"
# The flags detect_isa() (csrc/gemv_common.h) and the W8A8 kernels choose by; `decodekit doctor`
# lists them.
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
ISA_FLAGS = ("avx2", "fma", "f16c", *AVX512, "avx512_bf16", "avx512_vnni")


class BuildError(RuntimeError):
    """The kernels cannot be built here; the message is one line saying why."""


def sources() -> list[Path]:
    """The C++ sources compiled into the library (every csrc/*.cpp); raises BuildError when
    csrc/ is missing (a package built without its package data)."""
    found = sorted(CSRC.glob("*.cpp"))
    if not found:
        raise BuildError(f"the kernel sources are missing: no {CSRC}/*.cpp in this install")
    return found


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line), None where unreadable."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return None


def isa_tag(flags: set[str] | None) -> str:
    """The architecture and the widest kernel variant the CPU can run, e.g. "x86_64-avx2" or
    "x86_64-avx512-bf16-vnni". The library picks its variant at run time (gemv_common.h), so one
    build would serve every x86-64 CPU; the tag keeps a cache shared between machines (an NFS
    home) from handing one CPU another's build should the build ever target the CPU."""
    machine = platform.machine().lower()
    if flags is None:
        return machine
    if flags.issuperset(AVX512):
        extras = [name for flag, name in (("avx512_bf16", "bf16"), ("avx512_vnni", "vnni")) if flag in flags]
        return "-".join([machine, "avx512", *extras])
    return f"{machine}-avx2" if {"avx2", "fma"} <= flags else f"{machine}-base"


def unsupported_cpu(flags: set[str] | None) -> str | None:
    """Why this CPU cannot run the kernels, or None when it can (or its flags are unknown)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are x86-64 only (this CPU: {platform.machine()})"
    if flags is not None and not {"avx2", "fma"} <= flags:
        return "this CPU lacks AVX2 + FMA"
    return None


def library_name() -> str:
    """The library's file name for these sources, this torch and this CPU (module docstring)."""
    digest = hashlib.sha256()
    for path in [*sources(), *sorted(CSRC.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    torch_version = torch.__version__.replace("+", "_")
    return f"gemv-{digest.hexdigest()[:12]}-torch{torch_version}-{isa_tag(cpu_flags())}.so"


def in_checkout() -> bool:
    """Whether the sources are a checkout's (an editable install), not an installed package's."""
    return (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "src" / "decodekit").is_dir()


def build_dir() -> Path:
    """Where `build` puts the library: `_native/` in a checkout, else the cache's `kernels/`."""
    return BUILD_DIR if in_checkout() else cache_dir() / CACHE_SUBDIR


def find() -> Path | None:
    """The built library for this key, if any (module docstring's two places)."""
    name = library_name()
    for directory in (BUILD_DIR, cache_dir() / CACHE_SUBDIR):
        if (directory / name).is_file():
            return directory / name
    return None


def into_build_dir(found: Path) -> Path:
    """`found` copied into `build_dir()` when it lies elsewhere (a checkout whose library was
    built for another clone, in the cache): the test suite, which points DECODEKIT_CACHE_DIR
    at a temporary directory, then finds it there instead of building it again (~1 minute).
    The copy appears under its final name only when complete."""
    target = build_dir() / found.name
    if found == target or target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{found.name}.", delete=False) as part:
        shutil.copyfile(found, part.name)
    os.chmod(part.name, 0o755)
    os.replace(part.name, target)
    return target


def remembered_failure(target: Path) -> str | None:
    """The first line of the failure recorded for `target` by an earlier build, if any."""
    try:
        return Path(f"{target}.failed").read_text().partition("\n")[0] or "unknown"
    except OSError:
        return None


def compiler() -> str:
    """The C++ compiler's path: $CXX, else g++, else c++; raises BuildError when none runs."""
    named = os.environ.get("CXX")
    if named:
        found = shutil.which(named)
        if found is None:
            raise BuildError(f"no C++ compiler: CXX={named} is not an executable")
        return found
    found = shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise BuildError("no C++ compiler (g++ or c++ on PATH, or set CXX)")
    return found


def ensure() -> Path:
    """The library for this key: found, or built now (first use). Raises BuildError saying why
    there is none (a CPU it cannot run on, a failure remembered, or this attempt's)."""
    found = find()
    if found is not None:
        return found
    flags = cpu_flags()
    if (reason := unsupported_cpu(flags)) is not None:
        raise BuildError(reason)
    target = build_dir() / library_name()
    if (failure := remembered_failure(target)) is not None:
        raise BuildError(f"an earlier build failed ({failure}); `python -m decodekit.models.kernels --build` "
                         f"tries again (log: {target}.failed)")
    return build(target, retry=False)


def build(target: Path, retry: bool = True) -> Path:
    """Compile csrc/*.cpp into `target` under its lock; a library already there (another
    process built it meanwhile) is kept. `retry=False`: a failure another process recorded
    meanwhile is not tried again. A failure is recorded in `<target>.failed`, said in one line
    on stderr and raised as BuildError."""
    failed, lock = Path(f"{target}.failed"), Path(f"{target}.lock")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
    except OSError as error:  # nowhere to remember a failure either: said again by each process
        raise _failed(None, BuildError(f"cannot write {target.parent}: {error.strerror}"), False) from None
    with _locked(lock) as waited:
        if target.is_file():
            if waited:
                print(" built by the other process", file=sys.stderr, flush=True)
            return target
        if not retry and failed.exists():
            if waited:
                print(" it failed", file=sys.stderr, flush=True)
            raise BuildError(f"another process's build failed ({remembered_failure(target)})")
        start = time.perf_counter()
        try:
            cxx = compiler()
        except BuildError as error:
            raise _failed(failed, error, announced=waited) from None
        if not waited:
            print(f"decodekit: building the CPU kernels into {target.parent} (once for this torch, CPU "
                  "and kernel source; a few minutes) ...", end="", file=sys.stderr, flush=True)
        try:
            _compile(target, cxx)
        except BuildError as error:
            raise _failed(failed, error, announced=True) from None
        failed.unlink(missing_ok=True)
        print(f" done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if target.parent == BUILD_DIR:  # a checkout keeps only its newest build
        for old in BUILD_DIR.glob("gemv-*.so"):
            if old != target:
                old.unlink(missing_ok=True)
    return target


def _failed(record: Path | None, error: BuildError, announced: bool) -> BuildError:
    """Remember `error` in `record` (the compiler's output too), end or write the one line on
    stderr, and return the one-line error to raise."""
    if record is not None:
        with contextlib.suppress(OSError):
            record.write_text(f"{error}\n")
    reason = str(error).partition("\n")[0]
    said = (f" failed ({reason}; log: {record})" if announced
            else f"decodekit: the CPU kernels cannot be built ({reason})")
    print(f"{said}; the pure-torch paths run. `python -m decodekit.models.kernels --build` tries again.",
          file=sys.stderr, flush=True)
    return BuildError(reason)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on `path` (released when the process dies, so never stale);
    yields whether another process held it first (then one line on stderr says we wait)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the rename in _compile still keeps a half-built file unseen
        yield False
        return
    with open(path, "a") as handle:
        waited = False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("decodekit: waiting for another process building the CPU kernels ...", end="",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = True
        try:
            yield waited
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(target: Path, cxx: str) -> None:
    """One compiler process per source, side by side (as many as cores), then one link into a
    temporary file renamed to `target`. No ninja: plain g++ commands."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [cxx, "-O3", "-std=c++17", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += [f"-I{path}" for path in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in sources()]
        commands = [[*flags, "-c", str(source), "-o", str(obj)] for source, obj in zip(sources(), objects)]
        library = Path(scratch) / target.name
        link = [cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(library)]
        link += [f"-L{path}" for path in lib_dirs] + [f"-Wl,-rpath,{path}" for path in lib_dirs]
        link += ["-lc10", "-ltorch_cpu", "-ltorch"]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        with ThreadPoolExecutor(max(1, min(cores, len(commands)))) as pool:
            compiled = list(pool.map(_run, commands))
        for done, source in zip(compiled, sources()):
            _check(done, source.name)
        _check(_run(link), "the link")
        os.replace(library, target)


def _check(done: subprocess.CompletedProcess, step: str) -> None:
    if done.returncode:
        raise BuildError(f"{Path(done.args[0]).name} failed (exit {done.returncode}) on {step}\n"
                         f"{done.stderr[-4000:]}")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True)
    except OSError as error:  # the compiler vanished or cannot execute
        return subprocess.CompletedProcess(command, 127, "", f"{command[0]}: {error.strerror}")
