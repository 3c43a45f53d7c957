import json

import pytest

from decodekit.cli import main
from decodekit.compress.evaluate import text_perplexity
from decodekit.models.registry import load_model

TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet. " * 10


def cli_json(capsys, *args) -> dict:
    code = main([*args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.mark.usefixtures("torch_kernels_only")  # names PyTorch's kernels
def test_compress_then_generate_from_the_directory(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "int8"
    report = cli_json(capsys, "compress", str(tiny_llama_dir), "--method", "rtn", "--bits", "8",
                      "--out", str(out))  # fmt: skip
    assert report["label"] == "rtn-8b" and report["layers"] == 8
    assert report["kernels"] == {"int8pack": 8} and report["source_dtype"] == "float32"
    assert report["memory_bytes_after"] < report["memory_bytes_before"]
    assert report["disk_bytes"] == (out / "model.compressed.safetensors").stat().st_size
    # The directory is a model for every command that takes one.
    completion = cli_json(capsys, "generate", "ROMEO:", "--model", str(out), "--max-new-tokens",
                            "6", "--strategy", "greedy")  # fmt: skip
    assert len(completion["token_ids"]) == 6 or completion["finish_reason"] == "stop"
    assert completion["usage"]["prompt_tokens"] == len(load_model(out).encode("ROMEO:"))


def test_gptq_and_sparsegpt_with_a_calibration_file(tiny_llama_dir, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    gptq = cli_json(capsys, "compress", str(tiny_llama_dir), "--method", "gptq", "--group", "16",
                    "--calib", "3", "--calib-len", "24", "--calib-file", str(calib),
                    "--out", str(tmp_path / "g"))  # fmt: skip
    assert gptq["summary"]["bits"] == 4 and gptq["summary"]["calib_batches"] == 3
    assert gptq["kernels"] == {"unpack": 8}  # groups of 16: smaller than the int4 kernel's 32
    sparse = cli_json(capsys, "compress", str(tiny_llama_dir), "--method", "sparsegpt",
                      "--sparsity", "0.25", "--calib", "2", "--calib-len", "24",
                      "--calib-file", str(calib), "--out", str(tmp_path / "s"))  # fmt: skip
    assert sparse["summary"]["sparsity"] == 0.25
    weight = load_model(tmp_path / "s").net.layers[0].mlp.down_proj.weight  # [32, 64]
    assert int((weight == 0).sum()) == 32 * 64 // 4  # 25 % of each 64-column block


def test_eval_perplexity_matches_the_api(tiny_llama_dir, tmp_path, capsys):
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT)
    report = cli_json(capsys, "eval", "perplexity", str(tiny_llama_dir), "--text", str(text),
                      "--window", "32", "--stride", "16")  # fmt: skip
    expected = text_perplexity(load_model(tiny_llama_dir), TEXT, window=32, stride=16)
    assert report["perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert report["tokens"] == expected.tokens and report["window"] == 32


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "rtn", "--bits", "9"], "bits must be in 2..8, got 9"),
        (["--method", "gptq", "--bits", "1"], "bits must be in 2..8, got 1"),
        (["--method", "magnitude", "--sparsity", "1"], "sparsity must be in [0, 1), got 1.0"),
        (["--method", "sparsegpt", "--sparsity", "-0.5"], "sparsity must be in [0, 1), got -0.5"),
        (["--method", "zip"], "method must be one of rtn, gptq, magnitude, sparsegpt, got 'zip'"),
        (["--method", "magnitude", "--n-m", "2-4"], "n_m must look like '2:4'"),
        (["--method", "rtn", "--activation-bits", "4"],
         "activation_bits must be None (weight-only) or 8, got 4"),
        (["--method", "rtn", "--activation-bits", "8", "--group", "48"],
         "activation_bits 8 needs group_size None or a multiple of 32, got 48"),
        (["--method", "magnitude", "--activation-bits", "8"],
         "activation_bits does not apply to method 'magnitude'"),
        (["--method", "rtn", "--head-bits", "6"], "--head-bits must be 8, 4, none or auto, got '6'"),
    ],
)
def test_bad_compress_values_exit_2_with_one_line(tiny_llama_dir, tmp_path, capsys, flags, message):
    code = main(["compress", str(tiny_llama_dir), *flags, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_bad_eval_values_exit_2_with_one_line(tiny_llama_dir, capsys):
    assert main(["eval", "perplexity", str(tiny_llama_dir), "--stride", "200", "--window", "64"]) == 2
    err = capsys.readouterr().err
    assert "stride must be in [1, window - 1] = [1, 63], got 200" in err and err.count("\n") == 1
    assert main(["eval", "arith", "shakespeare"]) == 2
    assert "eval arith takes no MODEL argument" in capsys.readouterr().err


def test_compress_reads_a_bfloat16_checkpoint(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    import shutil

    import safetensors.torch
    import torch

    from decodekit.models import dtype_probe
    from decodekit.models.quant_grid import QuantSpec, quantize_rtn

    # The dtype probe's verdict pinned (bfloat16, as on AVX-512-BF16 CPUs): what "auto" makes of a
    # bfloat16 checkpoint is measured per CPU and load (tests/models/test_dtype.py covers both verdicts).
    monkeypatch.setattr(dtype_probe, "cpu_bfloat16_dtype", lambda: torch.bfloat16)

    source = tmp_path / "bf16"
    shutil.copytree(tiny_llama_dir, source)
    weights = safetensors.torch.load_file(source / "model.safetensors")
    safetensors.torch.save_file({k: v.bfloat16() for k, v in weights.items()},
                                source / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    report = cli_json(capsys, "compress", str(source), "--method", "rtn", "--bits", "4", "--group", "32",
                      "--out", str(tmp_path / "q"))  # fmt: skip
    assert report["source_dtype"] == "bfloat16" and report["layers"] == 8
    # Memory before: the bfloat16 model, 2 bytes per parameter.
    assert report["memory_bytes_before"] == 2 * sum(v.numel() for v in weights.values())
    loaded = load_model(tmp_path / "q")
    assert loaded.dtype == torch.float32
    # The codes are round-to-nearest of the bfloat16 weights, computed in float32.
    up = weights["model.layers.1.mlp.down_proj.weight"].bfloat16().float()
    codes, scales = quantize_rtn(up, QuantSpec(4, 32))
    layer = loaded.net.layers[1].mlp.down_proj
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.scales, scales)
    completion = cli_json(capsys, "generate", "ROMEO:", "--model", str(tmp_path / "q"),
                          "--max-new-tokens", "4", "--strategy", "greedy")  # fmt: skip
    assert completion["usage"]["completion_tokens"] >= 1


def test_a_real_vocabularys_head_is_quantised_and_named_by_default(tmp_path, capsys):
    """--head-bits auto (the default): 8 bits at 32,000 tokens or more, said in the report;
    none keeps the head in float."""
    from test_pretrained import tied_checkpoint

    source = tied_checkpoint(tmp_path / "real", vocab_size=32_000)
    rtn4 = ["compress", str(source), "--method", "rtn", "--bits", "4"]
    assert main([*rtn4, "--out", str(tmp_path / "a")]) == 0
    assert "output head: int8, one scale per channel (--head-bits auto;" in capsys.readouterr().out
    assert main([*rtn4, "--head-bits", "none", "--out", str(tmp_path / "b")]) == 0
    assert "output head" not in capsys.readouterr().out


@pytest.mark.usefixtures("torch_kernels_only")  # names PyTorch's kernels
def test_compress_text_report_names_the_kernels(tiny_llama_dir, tmp_path, capsys):
    assert main(["compress", str(tiny_llama_dir), "--method", "rtn", "--bits", "4", "--group", "32",
                 "--out", str(tmp_path / "q")]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "matmul kernels of the quantised layers: 8 int4pack"


def test_activation_bits_are_stored_and_a_reloaded_model_computes_the_same(tiny_llama_dir, tmp_path, capsys):
    import dataclasses

    import torch

    from decodekit.models import kernels
    from decodekit.models.qlinear import QuantizedLinear

    out = tmp_path / "w4a8"
    report = cli_json(capsys, "compress", str(tiny_llama_dir), "--method", "rtn", "--bits", "4",
                      "--group", "32", "--activation-bits", "8", "--out", str(out))  # fmt: skip
    assert report["label"] == "rtn-4b-g32-a8" and report["summary"]["activation_bits"] == 8
    assert report["kernels"] == {"int4a8" if kernels.available() else "unpack": report["layers"]}
    model = load_model(out)
    layers = [m for m in model.net.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == report["layers"] and all(m.spec.activation_bits == 8 for m in layers)
    # Weight-only from the same codes: another function (the activations are not quantised).
    tokens = torch.tensor([model.encode("ROMEO: But soft")])
    quantised = model.forward(tokens, model.new_cache(1))
    weight_only = load_model(out)
    for m in weight_only.net.modules():
        if isinstance(m, QuantizedLinear):
            m.spec = dataclasses.replace(m.spec, activation_bits=None)
            m.set_kernel("auto")
    plain = weight_only.forward(tokens, weight_only.new_cache(1))
    assert not torch.allclose(quantised, plain, atol=1e-4)
    assert torch.allclose(quantised, plain, atol=0.1 * float(plain.abs().max()))


def test_a_gguf_out_refuses_a_quantised_head(tiny_llama_dir, tmp_path, capsys):
    """--head-bits quantises the head per channel, which no GGUF block type stores: refused in
    one line, before anything is compressed or written."""
    out = tmp_path / "m.gguf"
    code = main(["compress", str(tiny_llama_dir), "--method", "rtn", "--bits", "8", "--group", "32",
                 "--head-bits", "8", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "head_bits applies to a directory out, not a GGUF file, got 8" in err
    assert "Traceback" not in err and not out.exists()
