"""Where and when decodekit's CPU kernels are built (models/kernel_build.py): at first use into
the cache, once (a second process, or two at once, compile nothing more), a failure remembered
and not retried until `--build`, and `kernels.status()` never raising.

A stand-in compiler (CXX, a script that logs its calls and links by copying the checkout's
built library, or a placeholder where there is none) makes these take seconds, not the
minutes of a real build. The checkout's `_native/` is pointed elsewhere so that the cache is
where builds go, as for an installed package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from decodekit.models import kernel_build, kernels

FAKE_CXX = """#!{python}
import pathlib, shutil, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(("compile " if "-c" in args else "link ") + args[args.index("-o") + 1] + "\\n")
if {fail!r}:
    sys.exit(print("error: boom", file=sys.stderr) or 1)
out = pathlib.Path(args[args.index("-o") + 1])
if "-c" in args:
    out.write_bytes(b"")
else:
    time.sleep({delay!r})  # so that two processes started together overlap
    library = {library!r}
    shutil.copy(library, out) if library else out.write_bytes(b"not a library")
"""


@pytest.fixture
def cxx(tmp_path):
    """Make a stand-in compiler: cxx(fail=False, delay=0.0) -> its path; calls() reads its log."""
    log = tmp_path / "cxx.log"
    real = kernel_build.find()

    def make(fail: bool = False, delay: float = 0.0) -> Path:
        path = tmp_path / f"cxx-{'fail' if fail else 'ok'}"
        path.write_text(FAKE_CXX.format(python=sys.executable, log=str(log), fail=fail, delay=delay,
                                         library=str(real) if real else ""))
        path.chmod(0o755)
        return path

    make.calls = lambda: log.read_text().splitlines() if log.exists() else []
    return make


@pytest.fixture
def installed(monkeypatch, tmp_path):
    """This process as an installed package sees it: no checkout's `_native/`, a fresh cache."""
    monkeypatch.setattr(kernel_build, "BUILD_DIR", tmp_path / "no-native")
    monkeypatch.setattr(kernel_build, "CHECKOUT", tmp_path / "no-checkout")
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    if kernel_build.unsupported_cpu(kernel_build.cpu_flags()):
        pytest.skip(f"nothing is built here: {kernel_build.unsupported_cpu(kernel_build.cpu_flags())}")
    return tmp_path / "cache" / kernel_build.CACHE_SUBDIR / kernel_build.library_name()


def test_the_first_use_builds_into_the_cache_once(installed, cxx, monkeypatch, capfd):
    monkeypatch.setenv("CXX", str(cxx()))
    assert kernel_build.ensure() == installed and installed.is_file()
    err = capfd.readouterr().err
    assert err.startswith(f"decodekit: building the CPU kernels into {installed.parent} (once for this "
                          "torch, CPU and kernel source; a few minutes) ... done in ")
    assert err.endswith(" s\n") and err.count("\n") == 1
    sources = [path.name for path in kernel_build.sources()]
    assert len(cxx.calls()) == len(sources) + 1 and cxx.calls()[-1].startswith("link ")
    assert kernel_build.ensure() == installed  # a second use: found, nothing compiled, nothing said
    assert len(cxx.calls()) == len(sources) + 1 and capfd.readouterr().err == ""
    assert sorted(p.name for p in installed.parent.iterdir()) == [installed.name, f"{installed.name}.lock"]


def test_a_failure_is_remembered_until_build_tries_again(installed, cxx, monkeypatch, capfd):
    monkeypatch.setenv("CXX", str(cxx(fail=True)))
    first = kernel_build.sources()[0].name  # the first source compiled, the one that fails
    with pytest.raises(kernel_build.BuildError, match=rf"cxx-fail failed \(exit 1\) on {re.escape(first)}$"):
        kernel_build.ensure()
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decodekit: building the CPU kernels into")
    assert err.endswith(f"... failed (cxx-fail failed (exit 1) on {first}; log: {installed}.failed); the "
                        "pure-torch paths run. `python -m decodekit.models.kernels --build` tries again.\n")
    assert "error: boom" in Path(f"{installed}.failed").read_text()  # the log keeps the compiler's output
    tried = len(cxx.calls())
    with pytest.raises(kernel_build.BuildError, match="an earlier build failed .* tries again"):
        kernel_build.ensure()  # a later process start: not tried again, and silent
    assert len(cxx.calls()) == tried and capfd.readouterr().err == ""
    kernels.status.cache_clear()
    try:
        state = kernels.status()
        assert not state.available and state.reason.startswith("an earlier build failed (cxx-fail failed")
    finally:
        kernels.status.cache_clear()
    monkeypatch.setenv("CXX", str(cxx()))
    assert kernel_build.build(installed) == installed  # what `--build` does: tries again
    assert len(cxx.calls()) > tried and not Path(f"{installed}.failed").exists()


def test_no_compiler_means_one_line_and_no_retry(installed, monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    for attempt in range(2):
        with pytest.raises(kernel_build.BuildError) as raised:
            kernel_build.ensure()
        err = capfd.readouterr().err
        if attempt == 0:
            reason = f"no C++ compiler: CXX={tmp_path / 'no-such-g++'} is not an executable"
            assert str(raised.value) == reason
            assert err == (f"decodekit: the CPU kernels cannot be built ({reason}); the pure-torch paths "
                           "run. `python -m decodekit.models.kernels --build` tries again.\n")
        else:
            assert "an earlier build failed (no C++ compiler" in str(raised.value) and err == ""


def test_two_processes_starting_at_once_build_once(installed, cxx, tmp_path):
    script = textwrap.dedent(f"""
        from pathlib import Path
        from decodekit.models import kernel_build
        kernel_build.BUILD_DIR = Path({str(tmp_path / "no-native")!r})
        kernel_build.CHECKOUT = Path({str(tmp_path / "no-checkout")!r})
        print(kernel_build.ensure())
    """)
    env = {**os.environ, "CXX": str(cxx(delay=3.0)), "DECODEKIT_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert {out.strip() for out, _ in outputs} == {str(installed)}
    assert sum(call.startswith("link ") for call in cxx.calls()) == 1
    errs = sorted(err for _, err in outputs)
    assert all(err.count("\n") == 1 for err in errs), errs
    assert errs[0].startswith("decodekit: building the CPU kernels into") and "done in" in errs[0]
    assert errs[1] == ("decodekit: waiting for another process building the CPU kernels ... "
                       "built by the other process\n")


def test_disabled_kernels_build_nothing(installed, cxx, monkeypatch):
    monkeypatch.setenv("CXX", str(cxx()))
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    kernels.status.cache_clear()
    try:
        assert kernels.status() == kernels.Status(False, "disabled by DECODEKIT_KERNELS=0", None)
    finally:
        kernels.status.cache_clear()
    assert cxx.calls() == [] and not installed.parent.exists()


def test_status_never_raises_without_the_sources(installed, monkeypatch, tmp_path):
    """A package built without its C++ sources: `status()` says so (it raised FileNotFoundError)."""
    monkeypatch.setattr(kernel_build, "CSRC", tmp_path / "no-csrc")
    kernels.status.cache_clear()
    try:
        for build in (True, False):
            state = kernels.status(build=build)
            assert not state.available
            missing = f"the kernel sources are missing: no {tmp_path / 'no-csrc'}/*.cpp in this install"
            assert state.reason == missing
    finally:
        kernels.status.cache_clear()


@pytest.mark.parametrize(("flags", "tag"), [
    ({"avx2", "fma", "f16c"}, "x86_64-avx2"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "x86_64-avx512"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"},
     "x86_64-avx512-bf16-vnni"),
    ({"avx2", "fma", "avx512f"}, "x86_64-avx2"),  # AVX-512F alone is not the kernels' AVX-512
    ({"sse4_2"}, "x86_64-base"),
    (None, "x86_64"),
])
def test_the_library_is_named_per_instruction_set(flags, tag, monkeypatch):
    monkeypatch.setattr(kernel_build.platform, "machine", lambda: "x86_64")
    assert kernel_build.isa_tag(flags) == tag
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: flags)
    assert kernel_build.library_name().endswith(f"-{tag}.so")


def test_a_cpu_without_avx2_is_not_built_for(installed, cxx, monkeypatch):
    monkeypatch.setenv("CXX", str(cxx()))
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: {"sse4_2", "fma"})
    with pytest.raises(kernel_build.BuildError, match="this CPU lacks AVX2 \\+ FMA"):
        kernel_build.ensure()
    monkeypatch.setattr(kernel_build.platform, "machine", lambda: "aarch64")
    with pytest.raises(kernel_build.BuildError, match=r"x86-64 only \(this CPU: aarch64\)"):
        kernel_build.ensure()
    assert cxx.calls() == []


def test_the_kernels_command_reports_without_building(installed, cxx, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(cxx()))
    kernels.status.cache_clear()
    try:
        assert kernels.main([]) == 0
    finally:
        kernels.status.cache_clear()
    out = capsys.readouterr().out
    assert out == ("decodekit kernels: unavailable (not built yet; `python -m decodekit.models.kernels "
                   f"--build` builds it): {installed}\n")
    assert cxx.calls() == []


def test_an_unwritable_cache_means_one_line_and_the_pure_torch_paths(installed, cxx, monkeypatch, capfd):
    monkeypatch.setenv("CXX", str(cxx()))
    installed.parent.parent.write_text("a file where the cache directory should be")
    with pytest.raises(kernel_build.BuildError, match="cannot write .*/kernels: Not a directory"):
        kernel_build.ensure()
    err = capfd.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("decodekit: the CPU kernels cannot be built (cannot write ")
    assert cxx.calls() == []


def test_a_checkouts_build_copies_a_library_built_for_another_clone(monkeypatch, tmp_path):
    """scripts/setup.sh in a second clone finds the library built for the first in the user's
    cache; `--build` copies it into the checkout's `_native/`, where the test suite (whose
    DECODEKIT_CACHE_DIR is a temporary directory) looks, instead of building it again there."""
    native, cache = tmp_path / "native", tmp_path / "cache"
    monkeypatch.setattr(kernel_build, "BUILD_DIR", native)
    monkeypatch.setattr(kernel_build, "in_checkout", lambda: True)
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(cache))
    built = cache / kernel_build.CACHE_SUBDIR / kernel_build.library_name()
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF stand-in")
    assert kernel_build.find() == built
    copied = kernel_build.into_build_dir(built)
    assert copied == native / built.name and copied.read_bytes() == built.read_bytes()
    assert kernel_build.find() == copied and kernel_build.into_build_dir(copied) == copied
    assert [p.name for p in native.iterdir()] == [built.name]  # no partial copy left behind
