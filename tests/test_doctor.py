"""`decodekit doctor` (cli/doctor.py, environment.py): what it finds, and one line per missing
piece saying what it costs and how to get it; it reports the kernels and never builds them."""

from __future__ import annotations

import json

import pytest

from decodekit import environment
from decodekit.cli import main
from decodekit.models import kernel_build, kernels
from decodekit.optional import install_command


def doctor(capsys, *flags) -> str:
    assert main(["doctor", *flags]) == 0
    return capsys.readouterr().out


def test_it_prints_versions_devices_flags_kernels_cache_and_extras(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "cache"))
    out = doctor(capsys)
    lines = {line[:14].strip(): line[14:] for line in out.splitlines() if line[:1].isalpha()}
    assert lines["torch"] == torch.__version__
    assert lines["python"].startswith(environment.platform.python_version())
    assert {"decodekit", "transformers", "cpu", "cuda", "kernels", "compiler"} <= set(lines)
    assert lines["cache"] == f"{tmp_path / 'cache'} (DECODEKIT_CACHE_DIR moves it)"
    state = kernels.status(build=False)
    assert lines["kernels"] == f"{'available' if state.available else 'unavailable'} ({state.reason})"
    flags = kernel_build.cpu_flags()
    if flags is not None:
        assert all(flag in lines["cpu flags"] for flag in kernel_build.ISA_FLAGS)
    facts = json.loads(doctor(capsys, "--json"))
    assert facts["cache_dir"] == str(tmp_path / "cache") and facts["versions"]["torch"] == torch.__version__
    assert facts["kernels"]["available"] == state.available
    assert out.rstrip().endswith("nothing missing") == (facts["missing"] == [])
    for line in facts["missing"]:
        assert f"- {line}\n" in out


def test_every_extra_of_the_package_has_a_cost():
    extras = environment.installed_extras()
    if not extras:
        pytest.skip("decodekit is not installed (no metadata), so it has no extras to list")
    assert set(extras) <= set(environment.EXTRA_COSTS), set(extras) - set(environment.EXTRA_COSTS)
    assert {"constrained", "server", "gguf"} <= set(extras)


def test_a_missing_extra_says_what_it_costs_and_how_to_install_it(monkeypatch):
    if "constrained" not in environment.installed_extras():
        pytest.skip("decodekit is not installed (no metadata), so it has no extras to list")
    real = environment._version
    monkeypatch.setattr(environment, "_version", lambda name: None if name == "llguidance" else real(name))
    facts = environment.report()
    assert facts["extras"]["constrained"] == {"packages": {"llguidance": None}, "installed": False}
    [line] = [line for line in facts["missing"] if line.startswith("extra [constrained]")]
    cost, command = environment.EXTRA_COSTS["constrained"], install_command("constrained")
    assert line == f"extra [constrained]: {cost}; run: {command}"
    assert "[constrained]" in install_command("constrained")


@pytest.mark.usefixtures("torch_kernels_only")
def test_disabled_kernels_cost_a_line():
    facts = environment.report()
    assert not facts["kernels"]["available"]
    assert (f"CPU kernels (disabled by DECODEKIT_KERNELS=0): {environment.KERNELS_COST}; unset "
            "DECODEKIT_KERNELS to use them") in facts["missing"]


def test_unbuilt_kernels_without_a_compiler_are_reported_not_built(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(kernel_build, "BUILD_DIR", tmp_path / "no-native")
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setattr(kernel_build, "build", lambda *a, **k: pytest.fail("doctor must not build"))
    kernels.status.cache_clear()
    try:
        facts = environment.report()
    finally:
        kernels.status.cache_clear()
    if kernel_build.unsupported_cpu(kernel_build.cpu_flags()):
        pytest.skip("this CPU cannot run the kernels, so nothing is built for it")
    assert facts["kernels"]["compiler"] is None and not facts["kernels"]["available"]
    [line] = [line for line in facts["missing"] if line.startswith("CPU kernels")]
    assert line == ("CPU kernels (not built yet; `python -m decodekit.models.kernels --build` builds it): "
                    f"{environment.KERNELS_COST}; install g++ (or set CXX), then `python -m "
                    "decodekit.models.kernels --build` (or the first model run) builds them")
    assert not (tmp_path / "cache").exists()


def test_huge_pages_say_the_policy_and_what_their_absence_costs(capsys, monkeypatch):
    from decodekit.models import hugepages

    lines = {line[:14].strip(): line[14:] for line in doctor(capsys).splitlines() if line[:1].isalpha()}
    assert lines["huge pages"] == hugepages.policy()
    monkeypatch.setenv("DECODEKIT_HUGE_PAGES", "0")
    hugepages.available.cache_clear()
    try:
        facts = environment.report()
    finally:
        monkeypatch.undo()
        hugepages.available.cache_clear()
    assert facts["huge_pages"] == "off (DECODEKIT_HUGE_PAGES=0)"
    [line] = [line for line in facts["missing"] if line.startswith("transparent huge pages")]
    assert "off (DECODEKIT_HUGE_PAGES=0)" in line and environment.HUGE_PAGES_COST in line
