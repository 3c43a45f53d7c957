"""runtime.py: the automatic thread count, set_threads' checks, and progress bars on stderr."""

import re
import sys
import time

import pytest
import torch
from torch import nn

from decodekit import runtime
from decodekit.compress import prune_model, quantize_model


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def machine(monkeypatch, cores: int, other_load: float) -> None:
    """Pretend the process may use `cores` cores while other processes keep `other_load` busy."""
    monkeypatch.setattr(runtime, "available_cores", lambda: cores)
    monkeypatch.setattr(runtime, "other_load", lambda: other_load)


@pytest.mark.parametrize(
    ("parameters", "cores", "other_load", "expected"),
    [
        (3_400_000, 2, 0.0, 1),  # shakespeare: one thread even on an idle machine
        (None, 8, 0.0, 1),  # unknown size counts as small
        (9_999_999, 2, 0.0, 1),  # just under the threshold
        (10_000_000, 2, 0.0, 2),  # at the threshold, idle: every core
        (240_000_000, 2, 0.4, 2),  # 2 - 0.4 = 1.6 free cores rounds to 2
        (240_000_000, 2, 0.6, 1),  # 1.4 free rounds to 1: a second thread would wait on a busy core
        (240_000_000, 2, 6.0, 1),  # a loaded machine: never fewer than one
        (240_000_000, 8, 3.0, 5),  # 8 - 3 = 5 free
    ],
)
def test_choose_threads_rule(monkeypatch, parameters, cores, other_load, expected):
    machine(monkeypatch, cores, other_load)
    assert runtime.choose_threads(parameters) == expected


def test_other_load_scales_a_host_wide_load_to_our_cores(monkeypatch):
    # 2 of 64 host CPUs; host load 32 -> 1 core's worth on ours; no CPU time of our own yet.
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (32.0, 0.0, 0.0))
    monkeypatch.setattr(runtime.time, "process_time", lambda: 0.0)
    assert runtime.other_load() == pytest.approx(1.0)


def test_cgroup_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert runtime.cgroup_cpu_limit(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert runtime.cgroup_cpu_limit(tmp_path) is None
    assert runtime.cgroup_cpu_limit(tmp_path / "missing") is None
    assert 1 <= runtime.available_cores() <= (runtime.os.cpu_count() or 1)


class Sized:
    """A LanguageModel as far as set_threads looks: it counts its own parameters."""

    def __init__(self, parameters: int):
        self.parameters = parameters

    def num_parameters(self) -> int:
        return self.parameters


def test_set_threads(monkeypatch, threads_restored):
    with pytest.raises(ValueError, match="threads must be a positive integer, got 0"):
        runtime.set_threads(0)
    assert runtime.set_threads(1) == 1 and torch.get_num_threads() == 1
    machine(monkeypatch, 2, 0.0)
    assert runtime.set_threads(None, Sized(10_000_000)) == 2 and torch.get_num_threads() == 2
    assert runtime.set_threads(None, Sized(0)) == 1  # a LanguageModel answering 0: size unknown
    assert runtime.set_threads(None, nn.Linear(4, 4)) == 1 and torch.get_num_threads() == 1


def test_progress_disabled_iterates_silently(capsys):
    assert list(runtime.progress(range(3), desc="quiet", enabled=False)) == [0, 1, 2]
    assert list(runtime.progress(range(3), desc="not a tty")) == [0, 1, 2]  # capsys is no TTY
    bar = runtime.progress(total=2, enabled=False)
    bar.update()
    bar.close()
    assert capsys.readouterr().err == ""


def test_progress_enabled_writes_a_bar_to_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(runtime.progress(range(3), desc="work", enabled=True)) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "work" in err and "3/3" in err and "\r" in err  # tqdm's bar, redrawn in place


def test_progress_off_a_terminal_is_a_line_every_few_seconds(capsys):
    """Issue 26: a long command off a terminal prints done/total and the rate now and then."""
    lines_bar = runtime.progress(total=2, enabled=True)
    lines_bar.close()  # (its timer would print into later tests)
    assert isinstance(lines_bar, runtime.ProgressLines)  # capsys: no TTY
    assert list(runtime.progress(range(3), desc="quick", enabled=True)) == [0, 1, 2]
    assert capsys.readouterr().err == ""  # done before the first line is due: nothing
    bar = runtime.ProgressLines(total=4, desc="bench kv", interval=0.2)
    bar.update(1)
    time.sleep(0.5)  # a long step: the timer still reports
    bar.set_postfix_str("sinks_recent")
    bar.update(3)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and all(line.startswith("bench kv: ") for line in lines)
    assert re.fullmatch(r"bench kv: 1/4 \(25%\), \d+\.\d\d/s, 0 s", lines[0])
    assert re.fullmatch(r"bench kv: 4/4 \(100%\), \d+\.\d\d/s, done in \d s, sinks_recent", lines[-1])


def test_advance_to_moves_a_bar_by_a_fraction_of_a_unit(capsys, monkeypatch):
    """Issue 35: a unit of minutes shows its progress within it, two decimals, never backwards."""
    bar = runtime.ProgressLines(total=3, desc="stages", interval=60)
    for share in (0.1, 0.2, 0.3):
        runtime.advance_to(bar, 1 + share)
    assert bar.n == 1.3  # not 1.3000000000000003
    runtime.advance_to(bar, 1.0)
    assert bar.n == 1.3
    bar._line()
    bar.close()
    assert capsys.readouterr().err.startswith("stages: 1.3/3 (43%), ")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with runtime.progress(total=3, desc="stages", enabled=True) as bar:
        runtime.advance_to(bar, 0.25)
        bar.refresh()
        assert "0.25/3" in capsys.readouterr().err  # tqdm's bar too


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


@pytest.mark.parametrize("compress", [
    lambda model, progress: quantize_model(
        model, "gptq", 4, calib_batches=[torch.randn(16, 8)], skip=(), progress=progress),
    lambda model, progress: prune_model(
        model, "sparsegpt", 0.5, calib_batches=[torch.randn(16, 8)], skip=(), progress=progress),
    lambda model, progress: quantize_model(model, "rtn", 8, skip=(), progress=progress),
])
def test_compression_progress_goes_to_stderr_only_when_asked(capsys, monkeypatch, compress):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a bar (off a terminal: a line now and then)
    compress(two_layers(), progress=False)
    assert capsys.readouterr().err == ""
    summary = compress(two_layers(), progress=True)
    err = capsys.readouterr().err
    assert "compress" in err and "2/2" in err and len(summary.layers) == 2
