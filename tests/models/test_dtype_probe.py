"""`dtype="auto"` on the CPU by measurement (models/dtype_probe.py): the rule on given timings,
the cache's round trip, invalidation and corruption, and load_model following the verdict.
No test depends on this machine's speed: the timings are injected."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from decodekit.models import dtype_probe
from decodekit.models.dtype_probe import CACHE_FILE, choose, probe
from decodekit.models.registry import load_model, resolve_dtype

BF16_SLOW = {"decode_float32": 0.004, "decode_bfloat16": 0.0055, "prefill_float32": 0.007,
             "prefill_bfloat16": 0.0024}  # fmt: skip  # a Zen 5 without AMX (0.73x)
BF16_FAST = {"decode_float32": 0.004, "decode_bfloat16": 0.0027, "prefill_float32": 0.007,
             "prefill_bfloat16": 0.002}  # fmt: skip  # an AMX machine (1.5x)


class Timer:
    """A fixed `measure` that counts its calls."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings, self.calls = timings, 0

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return dict(self.timings)


@pytest.fixture
def probe_with(tmp_path, monkeypatch):
    """probe() with `timer` as its measurement and `directory` (default tmp_path) as its cache."""

    def run(timer, directory=None):
        monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(directory or tmp_path))
        monkeypatch.setattr(dtype_probe, "measure", timer)
        return probe()

    return run


def test_bfloat16_is_kept_only_where_it_decodes_at_least_as_fast_as_float32():
    assert choose(BF16_SLOW) == torch.float32
    assert choose(BF16_FAST) == torch.bfloat16
    assert choose({"decode_float32": 0.004, "decode_bfloat16": 0.004}) == torch.bfloat16  # a tie keeps it
    assert choose({"decode_float32": 0.004, "decode_bfloat16": 0.00401}) == torch.float32
    # Prefill is reported, not ruled on: a fast bf16 prefill does not keep a slow bf16 decode.
    assert choose({**BF16_SLOW, "prefill_bfloat16": 0.0001}) == torch.float32


def test_the_verdict_is_measured_once_then_read_from_the_cache(probe_with, tmp_path):
    timer = Timer(BF16_FAST)
    first = probe_with(timer, tmp_path)
    assert (first["dtype"], first["cached"], timer.calls) == (torch.bfloat16, False, 1)
    assert first["cache"] == str(tmp_path / CACHE_FILE)
    again = probe_with(Timer(BF16_SLOW), tmp_path)  # a different timer would disagree: it is not asked
    assert (again["dtype"], again["cached"], again["timings"]) == (torch.bfloat16, True, BF16_FAST)
    stored = json.loads((tmp_path / CACHE_FILE).read_text())
    [entry] = stored["entries"].values()
    assert entry["key"]["torch"] == torch.__version__ and entry["timings"] == BF16_FAST


def test_a_new_torch_cpu_or_linear_path_measures_again(probe_with, tmp_path, monkeypatch):
    probe_with(Timer(BF16_FAST), tmp_path)
    key = dtype_probe.probe_key()
    for change in ({"torch": "9.9.9"}, {"cpu": {**key["cpu"], "flags": "0" * 16}}, {"source": "f" * 16}):
        monkeypatch.setattr(dtype_probe, "probe_key", lambda c=change: {**key, **c})
        timer = Timer(BF16_SLOW)
        assert probe_with(timer, tmp_path)["dtype"] == torch.float32 and timer.calls == 1, change
    monkeypatch.undo()
    assert probe_with(Timer(BF16_SLOW), tmp_path)["cached"]  # the first machine's entry is still there
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())["entries"]) == 4


def test_the_cache_keeps_the_newest_entries_only(probe_with, tmp_path, monkeypatch):
    key = dtype_probe.probe_key()
    for i in range(dtype_probe.MAX_ENTRIES + 3):
        monkeypatch.setattr(dtype_probe, "probe_key", lambda i=i: {**key, "torch": f"v{i}"})
        monkeypatch.setattr(dtype_probe.time, "strftime", lambda _, i=i: f"2026-11-24T00:00:{i:02d}")
        probe_with(Timer(BF16_FAST), tmp_path)
    entries = json.loads((tmp_path / CACHE_FILE).read_text())["entries"].values()
    assert sorted(e["key"]["torch"] for e in entries) == sorted(f"v{i}" for i in range(3, 11))


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format": 1, "entries": []}',
                                     '{"format": 99, "entries": {}}', '{"format": 1, "entries": {"k": "x"}}',
                                     "BAD-ENTRY"])  # fmt: skip
def test_a_corrupt_cache_is_ignored_and_replaced(probe_with, tmp_path, content):
    if content == "BAD-ENTRY":  # the right key, timings that cannot be read
        key = dtype_probe.probe_key()
        entry = {"key": key, "timings": {"decode_float32": "fast", "decode_bfloat16": 0}}
        content = json.dumps({"format": 1, "entries": {dtype_probe.key_id(key): entry}})
    (tmp_path / CACHE_FILE).write_text(content)
    timer = Timer(BF16_SLOW)
    assert probe_with(timer, tmp_path)["dtype"] == torch.float32 and timer.calls == 1
    assert probe_with(timer, tmp_path)["cached"] and timer.calls == 1  # rewritten whole


def test_an_unwritable_cache_is_no_error(probe_with, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory should be")
    timer = Timer(BF16_FAST)
    found = probe_with(timer, blocked / "decodekit")
    assert found["dtype"] == torch.bfloat16 and found["cache"] is None
    assert probe_with(timer, blocked / "decodekit")["dtype"] == torch.bfloat16 and timer.calls == 2


def test_the_cache_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "mine"))
    assert dtype_probe.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("DECODEKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dtype_probe.cache_dir() == tmp_path / "xdg" / "decodekit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dtype_probe.cache_dir() == tmp_path / "home" / ".cache" / "decodekit"


@pytest.fixture
def bf16_checkpoint(tiny_llama_dir, tmp_path):
    """tiny_llama_dir whose config.json says its weights are bfloat16."""
    path = shutil.copytree(tiny_llama_dir, tmp_path / "tiny-bf16")
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return path


@pytest.mark.parametrize(("timings", "expected"), [(BF16_SLOW, torch.float32), (BF16_FAST, torch.bfloat16)])
def test_auto_loads_a_bfloat16_checkpoint_in_the_probes_dtype(bf16_checkpoint, tmp_path, monkeypatch,
                                                              timings, expected):  # fmt: skip
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dtype_probe, "measure", Timer(timings))
    assert load_model(bf16_checkpoint).dtype == expected
    assert load_model(bf16_checkpoint, dtype="bfloat16").dtype == torch.bfloat16  # explicit: as asked
    # float16 becomes float32, float32 is never lowered, an accelerator keeps the checkpoint's.
    assert resolve_dtype("auto", {"torch_dtype": "float16"}) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "float32"}) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, torch.device("cuda")) == torch.bfloat16
    assert dtype_probe.measure.calls == 1


def test_the_report_names_the_verdict_and_the_ratios(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dtype_probe, "measure", Timer(BF16_SLOW))
    report = dtype_probe.dtype_report()
    assert report["bfloat16_checkpoint"] == "float32" and report["float16_checkpoint"] == "float32"
    assert report["bf16_speed_vs_float32"] == {"decode": 0.73, "prefill": 2.92}
    assert not report["cached"] and dtype_probe.dtype_report()["cached"]
    json.dumps(report)


def test_the_real_probe_times_both_dtypes_through_the_linear_path(one_thread):
    timings = dtype_probe.measure()
    assert set(timings) == {"decode_float32", "decode_bfloat16", "prefill_float32", "prefill_bfloat16"}
    assert all(seconds > 0 for seconds in timings.values())
    assert torch.get_num_threads() == 1  # restored
