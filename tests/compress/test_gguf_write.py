"""`decodekit compress ... --out FILE.gguf` (compress/gguf.py): decodekit's own codes written as
q8_0 / q4_0 blocks, read back by `load_model` and by the CLI and server that take a model."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf")

import decodekit as dk  # noqa: E402
from decodekit.cli import main  # noqa: E402
from decodekit.compress.gguf import compress_to_gguf  # noqa: E402
from decodekit.compress.recipe import CompressConfig, compress_to_dir  # noqa: E402
from decodekit.models.qlinear import QuantizedLinear  # noqa: E402
from decodekit.models.registry import load_model  # noqa: E402


@pytest.mark.parametrize("bits", [8, 4])
def test_compressed_codes_reach_the_file_unchanged(bits, tmp_path, one_thread):
    config = CompressConfig("rtn", bits=bits, group_size=32)
    compress_to_dir("shakespeare", config, tmp_path / "dir")
    report = compress_to_gguf("shakespeare", config, tmp_path / "model.gguf")
    assert report["format"] == "gguf" and report["disk_bytes"] == (tmp_path / "model.gguf").stat().st_size
    ours, file = load_model(str(tmp_path / "dir")), load_model(str(tmp_path / "model.gguf"))
    layers = [(name, m) for name, m in ours.net.named_modules() if isinstance(m, QuantizedLinear)]
    assert layers
    for name, module in layers:
        stored = file.net.get_submodule(name)
        assert isinstance(stored, QuantizedLinear) and stored.spec == module.spec
        assert torch.equal(stored.codes(), module.codes())  # the codes themselves
        assert torch.equal(stored.scales, module.scales.half().float())  # scales as float16 blocks
    params = dk.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [ours.encode("ROMEO:"), ours.encode("JULIET:\nO ")]
    assert [c[0].token_ids for c in dk.generate(file, prompts, params)] == \
           [c[0].token_ids for c in dk.generate(ours, prompts, params)]  # fmt: skip


def test_only_q8_0_and_q4_0_grids_are_written(tmp_path):
    with pytest.raises(ValueError, match="GGUF stores 8- or 4-bit codes in groups of 32 .* group 64"):
        compress_to_gguf("shakespeare", CompressConfig("gptq", bits=4, group_size=64), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_the_cli_writes_gguf_and_takes_it_as_a_model(tmp_path, capsys, one_thread):
    out = tmp_path / "int4.gguf"
    flags = ["--method", "rtn", "--bits", "4", "--group", "32", "--out", str(out)]
    code = main(["compress", "shakespeare", *flags, "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["out"] == str(out)
    assert main(["compress", "shakespeare", *flags]) == 2
    assert f"--out {out} exists; give a new file" in capsys.readouterr().err
    assert main(["generate", "ROMEO:", "--model", str(out), "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    from decodekit.server.app import load_models

    assert list(load_models([str(out)])) == ["int4"]  # served under the file's stem
