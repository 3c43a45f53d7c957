"""AI2's OLMo 2 and OLMoE on decodekit's own forward, beyond tests/models/test_native.py's
parity suite (which runs both against transformers): their GGUF files (llama.cpp's olmo2 and
olmoe), written and read back, and what llama.cpp's graphs cannot hold. llama.cpp itself reads
them in tests/models/test_gguf_peer.py."""

from __future__ import annotations

import pytest
import torch

from decodekit.models.registry import load_model
from decodekit.models.shapes import save_checkpoint, shape_config

pytest.importorskip("gguf")

from decodekit.compress.gguf import write_gguf  # noqa: E402
from decodekit.models.gguf_model import read_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
FAMILIES = {
    "olmo2": {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "num_key_value_heads": 2},
    "olmoe": {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "num_experts": 6,
              "num_experts_per_tok": 2, "intermediate_size": 32},
}  # fmt: skip


def checkpoint(family: str, path, **changes):
    return save_checkpoint({**shape_config("qwen2.5-0.5b"), **BASE, **FAMILIES[family], **changes}, path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_gguf_file_reads_back_as_the_checkpoints_model(family, tmp_path):
    """OLMo 2's norms after each sublayer and both families' q/k norms over the whole projection
    are stored under llama.cpp's names (post_attention_norm, post_ffw_norm, attn_q_norm as wide
    as the queries) and read back: the same config and logits."""
    reference = load_model(checkpoint(family, tmp_path / "hf"))
    path = write_gguf(tmp_path / "hf", tmp_path / f"{family}.gguf")
    _, tensors = read_gguf(path)
    c = reference.config
    assert [int(d) for d in tensors["blk.0.attn_q_norm.weight"].shape] == [c.num_heads * c.head_dim]
    assert ("blk.0.post_ffw_norm.weight" in tensors) == (family == "olmo2")
    assert ("blk.0.attn_norm.weight" in tensors) == (family == "olmoe")
    model = load_model(str(path))
    assert model.config == reference.config
    tokens = torch.tensor([[5, 17, 3, 99, 42, 8, 8, 61, 2, 30]])
    expected = reference.forward(tokens, reference.new_cache(1))
    assert torch.equal(model.forward(tokens, model.new_cache(1)), expected)


def test_gguf_writing_refuses_an_olmoe_with_grouped_key_value_heads(tmp_path):
    """llama.cpp's olmoe reads attn_k_norm as wide as the model: OLMoE-1B-7B has no GQA."""
    checkpoint("olmoe", tmp_path / "hf", num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"llama.cpp's olmoe takes num_key_value_heads equal to "
                                         r"num_attention_heads \(4\), got 2"):
        write_gguf(tmp_path / "hf", tmp_path / "x.gguf")


def test_what_nativelm_cannot_run_is_named(tmp_path):
    from decodekit.models.native_config import unsupported_reason

    config = {**shape_config("qwen2.5-0.5b"), **BASE, **FAMILIES["olmoe"], "clip_qkv": 8.0}
    assert unsupported_reason(config) == "clip_qkv must be null (OLMoE's q/k/v clamp is not run), got 8.0"
