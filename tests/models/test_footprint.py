"""`plan_memory` / `decodekit plan`: seed 001's KV formula with the KV heads, weights from headers."""

from __future__ import annotations

import json

import pytest

from decodekit.cli import main
from decodekit.models.footprint import kv_cache_bytes, plan_memory
from decodekit.models.registry import embedded_models


def hf_parameters(path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


def test_formula_by_hand_counts_kv_heads_not_query_heads(tiny_llama_dir):
    # tiny Llama: 2 layers, 4 query heads sharing 2 KV heads of 32 / 4 = 8
    plan = plan_memory(str(tiny_llama_dir), context=50, batch_size=3)
    assert (plan["num_heads"], plan["num_kv_heads"], plan["head_dim"]) == (4, 2, 8)
    assert plan["kv_bytes"] == 3 * 50 * 2 * 2 * 2 * 8 * 4 == 38_400
    assert plan["weight_bytes"] == hf_parameters(tiny_llama_dir) * 4
    assert plan["total_bytes"] == plan["weight_bytes"] + plan["kv_bytes"]
    int8 = plan_memory(str(tiny_llama_dir), context=50, batch_size=3, kv_dtype="int8", dtype="bfloat16")
    assert int8["kv_bytes"] == 38_400 // 4 and int8["weight_bytes"] == plan["weight_bytes"] // 2
    assert kv_cache_bytes(1, 1, 1, 1, 1, 2) == 4  # one key and one value of 2 bytes


def test_formula_is_the_dense_cache_bytes(tiny_llama_dir, tiny_lm):
    cache = tiny_lm.new_cache(3)
    cache.reserve(50)  # capacity exactly 50 positions
    assert cache.capacity == 50
    plan = plan_memory(str(tiny_llama_dir), context=50, batch_size=3)
    assert cache.keys.nbytes + cache.values.nbytes == plan["kv_bytes"]


def test_embedded_model_and_fit(tiny_llama_dir):
    plan = plan_memory("shakespeare", context=512, batch_size=8)
    assert plan["weight_bytes"] == embedded_models()["shakespeare"]["parameters"] * 4
    assert plan["kv_bytes"] == 8 * 512 * 2 * 4 * 2 * 64 * 4  # 4 layers, 2 KV heads of 64
    if plan["available_bytes"] is not None:
        assert plan["fits"] is (plan["total_bytes"] <= plan["available_bytes"])
        huge = plan_memory(str(tiny_llama_dir), context=96, batch_size=10**9)
        assert huge["fits"] is False  # 2.5e13 bytes of KV


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"context": 0}, "context must be an integer >= 1, got 0"),
    ({"context": 513}, "context must be <= 512 (the context of model 'shakespeare'), got 513"),
    ({"context": 8, "batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"context": 8, "kv_dtype": "int4"}, "kv_dtype must be one of 'auto', 'float32'.*got 'int4'"),
    ({"context": 8, "dtype": "int8"}, "dtype must be one of 'auto', 'float32'.*got 'int8'"),
])
def test_bad_values_name_what_is_allowed(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_memory("shakespeare", **kwargs)


def test_models_without_a_kv_cache_are_refused():
    with pytest.raises(ValueError, match="'shakespeare-5gram' .ngram. has no KV cache"):
        plan_memory("shakespeare-5gram", context=8)


def test_cli_prints_the_plan_and_one_line_errors(capsys):
    assert main(["plan", "shakespeare", "--context", "256", "--batch", "2", "--kv-dtype", "bfloat16",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes"] == 2 * 256 * 2 * 4 * 2 * 64 * 2 and plan["kv_dtype"] == "bfloat16"
    assert main(["plan", "shakespeare", "--context", "256"]) == 0
    out = capsys.readouterr().out
    assert f"{plan['weight_bytes']:,} bytes" in out and "2 KV heads" in out and "fits" in out
    assert main(["plan", "shakespeare", "--context", "9999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodekit plan: error: context must be <= 512") and err.count("\n") == 1


def test_compressed_weights_count_as_stored(tiny_llama_dir, tmp_path):
    from decodekit.compress.apply import model_nbytes
    from decodekit.compress.recipe import CompressConfig, compress_to_dir
    from decodekit.models.registry import load_model

    compress_to_dir(tiny_llama_dir, CompressConfig("rtn", bits=8), tmp_path / "int8")
    plan = plan_memory(str(tmp_path / "int8"), context=50, batch_size=3)
    net = load_model(tmp_path / "int8").net
    # codes + scales as stored (the persistent state); torch's packed kernels' copies come on
    # top (int8pack: bf16 scales, 2 bytes a row); decodekit's int8gemv reads the stored ones
    stored = sum(t.nbytes for t in {id(t): t for t in net.state_dict().values()}.values())
    assert plan["weight_bytes"] == stored <= model_nbytes(net)
    assert plan["weight_bytes"] < plan_memory(str(tiny_llama_dir), context=50)["weight_bytes"]
    assert plan["kv_bytes"] == 38_400 and plan["parameters"] is None  # the cache stays float32
    with pytest.raises(ValueError, match="runs in float32 only, got dtype 'bfloat16'"):
        plan_memory(str(tmp_path / "int8"), context=8, dtype="bfloat16")


def test_gpt2_config_is_read_through_transformers_attribute_map(tmp_path, capsys):
    """GPT-2 spells the heads n_head, the layers n_layer, the width n_embd (issue 26)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_head=4, n_embd=32, n_positions=64, vocab_size=50)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    assert "n_head" in json.loads((tmp_path / "config.json").read_text())
    assert main(["plan", str(tmp_path), "--context", "64", "--batch", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["num_layers"], plan["num_heads"], plan["num_kv_heads"], plan["head_dim"]) == (3, 4, 4, 8)
    assert plan["kv_bytes"] == kv_cache_bytes(2, 64, 3, 4, 8, 4)
    assert main(["plan", str(tmp_path), "--context", "65"]) == 2  # n_positions is the context
    assert "context must be <= 64" in capsys.readouterr().err
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "n_head"}))
    assert main(["plan", str(tmp_path), "--context", "8"]) == 2  # not GPT2Config's default of 12 heads
    err = capsys.readouterr().err
    assert "config.json has no 'num_attention_heads'" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "no-such-type"}))
    assert main(["plan", str(tmp_path), "--context", "8"]) == 2  # no map: n_layer is no known name
    assert "config.json has no 'num_hidden_layers'" in capsys.readouterr().err


def test_a_hub_id_says_nothing_is_downloaded_and_names_the_directory_form(capsys):
    hub = "Qwen/Qwen2.5-0.5B"
    for argv in (["plan", hub, "--context", "8"], ["generate", "x", "--model", hub],
                 ["eval", "perplexity", hub]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "looks like a Hugging Face hub ID: nothing is downloaded" in err
        assert "--local-dir ./Qwen2.5-0.5B) and give the directory (./Qwen2.5-0.5B)" in err
    assert main(["plan", "./no/such/dir", "--context", "8"]) == 2  # a path, not an ID
    assert "model path './no/such/dir' does not exist" in capsys.readouterr().err
