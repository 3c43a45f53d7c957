"""decodekit as users install it (issue 35): the sdist and, from it, the wheel (`python -m build`
on a copy of the sources), installed with pip into a temporary venv, run from a folder outside
the checkout: `decodekit generate "ROMEO:"` with the kernels and without a compiler, `decodekit
doctor` and one server request.

The temporary venv reuses this environment's packages (torch and the rest) through a .pth file,
which adds their directory to sys.path without running its .pth files, so this environment's
editable decodekit stays out: every check asserts that decodekit was imported from the wheel.
With the kernels, the cache (DECODEKIT_CACHE_DIR) is given the library this checkout built, so
nothing compiles for minutes; without, the cache is empty, CXX names a missing compiler and
g++ is off PATH. The tests skip, saying so, where `build` or `setuptools` are not installed
(the dev extra installs them) or the checkout's kernels are not built."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from decodekit.models import kernel_build
from serving import served

ROOT = Path(__file__).resolve().parents[1]
CSRC = sorted(p.name for p in (ROOT / "src" / "decodekit" / "models" / "csrc").iterdir())
PROMPT = ["generate", "ROMEO:", "--max-new-tokens", "6", "--seed", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and wheel of a copy of the sources (a build writes egg-info beside them)."""
    missing = [name for name in ("build", "setuptools") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"building the wheel needs {' and '.join(missing)}: pip install -e '.[dev]'")
    tmp = tmp_path_factory.mktemp("install")
    shutil.copy(ROOT / "pyproject.toml", tmp)
    shutil.copy(ROOT / "README.md", tmp)
    shutil.copytree(ROOT / "src", tmp / "src", ignore=shutil.ignore_patterns(
        "_native", "__pycache__", "*.egg-info", "*.so"))
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(tmp)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return tmp / "dist"


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A venv with the wheel installed by pip, reusing this environment's packages (module docstring)."""
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "reuse-the-test-environment.pth").write_text("\n".join(sorted(ours)) + "\n")
    [wheel] = dist.glob("decodekit-*.whl")
    # --force-reinstall: pip sees this environment's decodekit through the .pth and would call
    # the wheel installed; it leaves that one alone ("outside environment") and installs ours.
    done = subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
                           "--force-reinstall", "--no-compile", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=300, env=environment(path, None))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return path


def environment(venv: Path, cache: Path | None, **extra: str) -> dict[str, str]:
    dropped = ("PYTHONPATH", "CXX", "DECODEKIT_KERNELS")  # the checkout's sources, and what a test set
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", **extra)
    if cache is not None:
        env["DECODEKIT_CACHE_DIR"] = str(cache)
    return env


def run(venv: Path, args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "decodekit"), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory) -> Path:
    """A cache directory holding the library this checkout built (its name is the same for the
    wheel: the same sources, torch and CPU)."""
    if reason := kernel_build.unsupported_cpu(kernel_build.cpu_flags()):
        pytest.skip(f"no kernels on this CPU: {reason}")
    built = kernel_build.find()
    if built is None:
        pytest.skip("the checkout's kernels are not built (python -m decodekit.models.kernels --build); "
                    "the installed package would spend minutes building them")
    cache = tmp_path_factory.mktemp("cache-with-kernels")
    (cache / kernel_build.CACHE_SUBDIR).mkdir()
    shutil.copy(built, cache / kernel_build.CACHE_SUBDIR / built.name)
    return cache


def test_the_sdist_and_the_wheel_carry_the_kernel_sources(dist):
    [sdist] = dist.glob("decodekit-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert {name.split("/csrc/")[-1] for name in names if "/models/csrc/" in name} >= set(CSRC)
    [wheel] = dist.glob("decodekit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.removeprefix("decodekit/models/csrc/") for n in names if "/csrc/" in n) == CSRC
    assert "decodekit/py.typed" in names and "decodekit/models/assets/registry.json" in names
    assert not [n for n in names if "_native" in n or n.endswith(".so")]


def test_generate_from_the_wheel_on_the_kernels(venv, kernel_cache, tmp_path):
    env = environment(venv, kernel_cache)
    done = run(venv, PROMPT, tmp_path, env)
    assert done.returncode == 0 and done.stdout.startswith("ROMEO:"), done.stderr
    assert "building" not in done.stderr and "kernels" not in done.stderr, done.stderr
    facts = json.loads(run(venv, ["doctor", "--json"], tmp_path, env).stdout)
    assert Path(facts["decodekit_path"]).is_relative_to(venv), facts["decodekit_path"]
    assert facts["kernels"]["available"], facts["kernels"]
    assert Path(facts["kernels"]["library"]).parent == kernel_cache / kernel_build.CACHE_SUBDIR
    assert facts["cache_dir"] == str(kernel_cache)


def test_generate_from_the_wheel_without_a_compiler(venv, tmp_path):
    cache, missing = tmp_path / "fresh-cache", tmp_path / "no-such-g++"
    env = environment(venv, cache, CXX=str(missing))
    env["PATH"] = str(venv / "bin")  # and no g++ or c++ to fall back on
    done = run(venv, PROMPT, tmp_path, env)
    assert done.returncode == 0 and done.stdout.startswith("ROMEO:"), done.stderr
    if kernel_build.unsupported_cpu(kernel_build.cpu_flags()):
        assert done.stderr == "", done.stderr  # nothing to build here: nothing said
        return
    assert done.stderr == (f"decodekit: the CPU kernels cannot be built (no C++ compiler: CXX={missing} "
                           "is not an executable); the pure-torch paths run. `python -m "
                           "decodekit.models.kernels --build` tries again.\n")
    facts = json.loads(run(venv, ["doctor", "--json"], tmp_path, env).stdout)
    assert Path(facts["decodekit_path"]).is_relative_to(venv), facts["decodekit_path"]
    assert not facts["kernels"]["available"]
    assert facts["kernels"]["reason"].startswith("an earlier build failed (no C++ compiler")  # remembered


def test_serve_from_the_wheel(venv, kernel_cache, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    command = [str(venv / "bin" / "decodekit"), "serve", "--model", "shakespeare", "--port", "0",
               "--threads", "1"]
    with served(command, environment(venv, kernel_cache), cwd=tmp_path) as (port, log):
        body = {"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    assert "building" not in "".join(log)
