"""scripts/gpu_step_profile.py (issue 33): where a decode step's time goes; its CPU path (no
graph to replay) runs here, the GPU's in scripts/gpu_check.sh."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_step_profile", REPO / "scripts" / "gpu_step_profile.py")
gpu_step_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_step_profile)


def test_it_times_and_profiles_the_engines_steps(capsys):
    argv = ["--model", "shakespeare", "--rows", "1,3", "--steps", "3", "--top", "5"]
    assert gpu_step_profile.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["rows"] for line in lines] == [1, 3]
    assert all(line["wall_ms_per_step"] > 0 and line["graph_replay_gpu_ms"] is None for line in lines)


def test_it_times_samples_of_a_prompt_with_its_kv_shared_and_not(capsys):
    """`--shared N:P`: each form checked to be the one timed (the rows' prefixes), and the
    threshold of rows.py restored after."""
    from decodekit.engine import rows

    threshold = rows.GPU_SHARE_MIN_BYTES
    argv = ["--model", "shakespeare", "--rows", "1", "--steps", "3", "--top", "3", "--shared", "4:40"]
    assert gpu_step_profile.main(argv) == 0
    [line] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"')
              and "samples" in line]  # fmt: skip
    assert (line["samples"], line["prompt_tokens"]) == (4, 40)
    assert line["wall_ms_per_step"]["shared"] > 0 and line["wall_ms_per_step"]["whole rows"] > 0
    assert threshold == rows.GPU_SHARE_MIN_BYTES


@pytest.mark.parametrize("argv", [["--rows", "1"], ["--model", "shakespeare", "--rows", "0"],
                                  ["--model", "shakespeare", "--shape", "qwen2.5-0.5b"],
                                  ["--model", "shakespeare", "--shared", "4"],
                                  ["--model", "shakespeare", "--shared", "1:40"]])  # fmt: skip
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as exit_info:
        gpu_step_profile.main(argv)
    assert exit_info.value.code == 2
