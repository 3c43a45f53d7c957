"""GGUF files (models/gguf_model.py, gguf_tensors.py, gguf_tokenizer.py; compress/gguf.py): every
file is built here with gguf-py's writer, nothing is downloaded. Block types are checked against
reference dequantisations written from ggml's block definitions (ggml-common.h and
ggml-quants.c `dequantize_row_*`), one block at a time in plain Python loops."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

import decodekit as dk  # noqa: E402
from decodekit.compress.gguf import write_gguf  # noqa: E402
from decodekit.models import kernels  # noqa: E402
from decodekit.models.gguf_model import ConcatLinear, read_gguf  # noqa: E402
from decodekit.models.gguf_tensors import decode  # noqa: E402
from decodekit.models.qlinear import QuantizedLinear, set_kernels  # noqa: E402
from decodekit.models.registry import ASSETS, load_model  # noqa: E402

T = gguf.GGMLQuantizationType
PROMPTS = ("ROMEO:", "JULIET:\nO ", "First Citizen:\nBefore we proceed", "KING HENRY:\nOnce more")


# --- reference dequantisation, one block at a time (ggml-quants.c) -------------------------------


def f16(block: bytes, at: int) -> float:
    return float(np.frombuffer(block[at : at + 2], dtype=np.float16)[0])


def ref_q8_0(block: bytes) -> list[float]:
    d = f16(block, 0)
    return [d * int(q) for q in np.frombuffer(block[2:34], dtype=np.int8)]


def ref_q4_0(block: bytes) -> list[float]:
    d, qs = f16(block, 0), block[2:18]
    return [d * ((qs[j] & 0xF) - 8) for j in range(16)] + [d * ((qs[j] >> 4) - 8) for j in range(16)]


def ref_q5_0(block: bytes) -> list[float]:
    d, qh, qs = f16(block, 0), int.from_bytes(block[2:6], "little"), block[6:22]
    low = [((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - 16 for j in range(16)]
    high = [((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16 for j in range(16)]
    return [d * q for q in low + high]


def ref_q4_1(block: bytes) -> list[float]:
    d, m, qs = f16(block, 0), f16(block, 2), block[4:20]
    return [d * (qs[j] & 0xF) + m for j in range(16)] + [d * (qs[j] >> 4) + m for j in range(16)]


def ref_q5_1(block: bytes) -> list[float]:
    d, m, qh, qs = f16(block, 0), f16(block, 2), int.from_bytes(block[4:8], "little"), block[8:24]
    low = [(qs[j] & 0xF) | (((qh >> j) << 4) & 0x10) for j in range(16)]
    high = [(qs[j] >> 4) | ((qh >> (j + 12)) & 0x10) for j in range(16)]
    return [d * q + m for q in low + high]


def scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q4_k(block: bytes) -> list[float]:
    d, dmin, scales, qs = f16(block, 0), f16(block, 2), block[4:16], block[16:144]
    out, at, index = [], 0, 0
    for _ in range(4):  # 64 weights per step: sub-blocks `index` (low nibbles) and `index + 1`
        sc, m = scale_min_k4(index, scales)
        out += [np.float32(d * sc) * (qs[at + l] & 0xF) - np.float32(dmin * m) for l in range(32)]
        sc, m = scale_min_k4(index + 1, scales)
        out += [np.float32(d * sc) * (qs[at + l] >> 4) - np.float32(dmin * m) for l in range(32)]
        at, index = at + 32, index + 2
    return out


def ref_q6_k(block: bytes) -> list[float]:
    ql, qh = block[0:128], block[128:192]
    sc, d = np.frombuffer(block[192:208], dtype=np.int8), f16(block, 208)
    out = [0.0] * 256
    for half in range(2):
        y, l_at, h_at, s_at = 128 * half, 64 * half, 32 * half, 8 * half
        for l in range(32):
            i = l // 16
            q1 = ((ql[l_at + l] & 0xF) | (((qh[h_at + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l_at + l + 32] & 0xF) | (((qh[h_at + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l_at + l] >> 4) | (((qh[h_at + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l_at + l + 32] >> 4) | (((qh[h_at + l] >> 6) & 3) << 4)) - 32
            out[y + l] = d * sc[s_at + i] * q1
            out[y + l + 32] = d * sc[s_at + i + 2] * q2
            out[y + l + 64] = d * sc[s_at + i + 4] * q3
            out[y + l + 96] = d * sc[s_at + i + 6] * q4
    return out


REFERENCES = {"Q8_0": ref_q8_0, "Q4_0": ref_q4_0, "Q5_0": ref_q5_0, "Q4_1": ref_q4_1, "Q5_1": ref_q5_1,
              "Q4_K": ref_q4_k, "Q6_K": ref_q6_k, "Q5_K": None}
GRIDS = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q5_0": (8, 32), "Q4_1": (4, 32), "Q5_1": (8, 32), "Q4_K": (4, 32),
         "Q6_K": (8, 16)}  # fmt: skip


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes] of random blocks of `kind` whose float16 fields are small, finite
    scales (random bytes elsewhere: every code, 6-bit scale and min)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fields = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208]}[kind]  # fmt: skip
    for at in fields:
        scale = rng.uniform(1e-3, 4e-3, (rows, cols // block)).astype(np.float16)
        data[..., at : at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def reference(kind: str, data: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] by the block-at-a-time reference."""
    size = gguf.GGML_QUANT_SIZES[T[kind]][1]
    rows = [[w for at in range(0, len(row), size) for w in REFERENCES[kind](row[at : at + size].tobytes())]
            for row in data]  # fmt: skip
    return np.array(rows, dtype=np.float32)


def write_file(path, tensors: dict, arch: str = "llama", **meta) -> None:
    """A GGUF file of `tensors` (name -> float array, or (kind, uint8 blocks))."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        getattr(writer, f"add_{key}")(value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[1], raw_dtype=T[value[0]])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- tensor types ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(REFERENCES))
def test_blocks_dequantise_as_ggml_defines_them(kind, tmp_path):
    data = random_blocks(kind, rows=6, cols=512)
    write_file(tmp_path / "w.gguf", {"w": (kind, data)})
    _, tensors = read_gguf(tmp_path / "w.gguf")
    value = decode(tensors["w"].data, kind, (6, 512))
    if kind not in GRIDS:  # no kernel grid: dequantised once, at load, by gguf-py's own reference
        assert isinstance(value, torch.Tensor) and value.dtype == torch.float32
        np.testing.assert_array_equal(value.numpy(), gguf.quants.dequantize(data, T[kind]))
        return
    expected = reference(kind, data)
    bits, group = GRIDS[kind]
    assert (value.bits, value.group_size) == (bits, group)
    assert value.codes.dtype == torch.int8 and -(2 ** (bits - 1)) <= int(value.codes.min())
    assert int(value.codes.max()) < 2 ** (bits - 1)
    offsets = kind in ("Q4_K", "Q4_1", "Q5_1")
    assert (value.offsets is not None) == offsets
    if offsets:  # an offset (8·d·sc - dmin·m, m + 8·d) is one float32 rounding from ggml's own sum
        np.testing.assert_allclose(value.dequantize().numpy(), expected, rtol=1e-6, atol=1e-7)
    else:  # codes and scales (float16 times small integers) are exact
        np.testing.assert_array_equal(value.dequantize().numpy(), expected)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_tensors_are_read_as_stored(kind, tmp_path):
    values = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    if kind == "BF16":
        stored = ("BF16", gguf.quants.quantize(values, T.BF16))
        expected = torch.from_numpy(values).bfloat16()
    else:
        stored = values.astype(np.float16 if kind == "F16" else np.float32)
        expected = torch.from_numpy(stored)
    write_file(tmp_path / "w.gguf", {"w": stored})
    _, tensors = read_gguf(tmp_path / "w.gguf")
    value = decode(tensors["w"].data, kind, (4, 64))
    if isinstance(value, np.ndarray):  # F32 and F16: a view of the file
        value = torch.from_numpy(np.array(value))
    assert value.dtype == expected.dtype and torch.equal(value, expected)


@pytest.mark.parametrize("kind", list(GRIDS))
@pytest.mark.parametrize("kernel", ["auto", "unpack"])
def test_quantized_layers_compute_with_the_files_weights(kind, kernel, tmp_path):
    data = random_blocks(kind, rows=48, cols=256, seed=2)
    write_file(tmp_path / "w.gguf", {"w": (kind, data)})
    _, tensors = read_gguf(tmp_path / "w.gguf")
    grid = decode(tensors["w"].data, kind, (48, 256))
    layer = QuantizedLinear(256, 48, grid.bits, grid.group_size, bias=False, offsets=grid.offsets is not None)
    layer.set_codes(grid.codes, grid.scales, grid.offsets)
    layer.set_kernel(kernel)
    weight = torch.from_numpy(reference(kind, data))
    for rows in (1, 3, 80):  # decode, a few rows, a prefill past PACKED_MAX_ROWS
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        # The int4 kernels round x to bfloat16, the prefill path (> 64 rows) x and the weight
        # (models/qlinear.py); the others compute in float32.
        exact = kernel == "unpack" or (grid.bits == 8 and rows <= 64)
        rounded = x if exact or rows > 64 else x.bfloat16().float()
        expected = rounded @ weight.T
        tolerance = 1e-5 if exact else 1e-3 if rows <= 64 else 2e-2
        scale = (x.abs() @ weight.abs().T).max()  # rounding errors scale with Σ|x||w|, not |Σ x w|
        assert (layer(x) - expected).abs().max() <= tolerance * scale, (rows, layer.kernel)


def test_q4_k_zero_points_survive_torchs_int4_kernel(tmp_path, torch_kernels_only):
    data = random_blocks("Q4_K", rows=32, cols=256, seed=3)
    write_file(tmp_path / "w.gguf", {"w": ("Q4_K", data)})
    _, tensors = read_gguf(tmp_path / "w.gguf")
    grid = decode(tensors["w"].data, "Q4_K", (32, 256))
    layer = QuantizedLinear(256, 32, 4, 32, bias=False, offsets=True)
    layer.set_codes(grid.codes, grid.scales, grid.offsets)
    x = torch.randn(2, 256)
    expected = x @ torch.from_numpy(reference("Q4_K", data)).T
    assert (layer(x) - expected).abs().max() <= 2e-2 * expected.abs().max(), layer.kernel


# --- whole models -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shakespeare():
    return load_model("shakespeare", backend="native")


def greedy(model, new_tokens: int = 32) -> list[list[int]]:
    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = [model.encode(text) for text in PROMPTS]
    return [list(c[0].token_ids) for c in dk.generate(model, prompts, params)]


def test_an_f32_gguf_of_shakespeare_is_the_same_model(shakespeare, tmp_path, tiny_text, one_thread):
    path = write_gguf(ASSETS / "shakespeare", tmp_path / "shakespeare-f32.gguf", "f32")
    model = load_model(str(path))
    assert model.dtype == torch.float32 and model.eos_token_ids == shakespeare.eos_token_ids
    assert model.tokenizer.encode(tiny_text) == shakespeare.tokenizer.encode(tiny_text)
    assert model.decode(model.encode(tiny_text)) == tiny_text
    tokens = torch.tensor([shakespeare.encode(tiny_text)[:64]])
    expected = shakespeare.forward(tokens, shakespeare.new_cache(1))
    assert torch.equal(model.forward(tokens, model.new_cache(1)), expected)
    assert greedy(model) == greedy(shakespeare)


@pytest.mark.parametrize("tensor_type", ["f16", "bf16", "q8_0", "q4_0"])
def test_half_and_quantised_ggufs_load_onto_their_kernels(tensor_type, shakespeare, tmp_path, one_thread):
    path = write_gguf(ASSETS / "shakespeare", tmp_path / f"s-{tensor_type}.gguf", tensor_type)
    model = load_model(str(path))
    assert model.dtype == (torch.bfloat16 if tensor_type == "bf16" and model.dtype != torch.float32
                           else torch.float32)  # fmt: skip
    qkv = model.net.layers[0].self_attn.qkv_proj
    half = torch.float16 if kernels.available() else torch.float32
    if tensor_type in ("q8_0", "q4_0"):
        assert isinstance(qkv, QuantizedLinear) and qkv.spec.group_size == 32
        assert qkv.spec.bits == (8 if tensor_type == "q8_0" else 4)
        # 688 inputs are not a multiple of 32: stored as f16 (as llama.cpp falls back), loaded as a
        # float layer keeping the file's f16 weight (registry.py `half_weights_dtype`)
        down = model.net.layers[0].mlp.down_proj
        assert isinstance(down, nn.Linear) and down.weight.dtype == half
        # the tied embedding's grid is the output head (the file's codes), and the lookup reads its
        # rows from them: the values a float copy of the file's embedding held, and no such copy
        head = model.net.lm_head
        assert isinstance(head, QuantizedLinear) and head.spec == qkv.spec
        ids = torch.tensor([[0, 5, 2047], [17, 17, 1]])
        assert torch.equal(model.net.embed_tokens(ids), head.dequantized_weight()[ids])
        assert not any(p.shape[0] == model.vocab_size for p in model.net.parameters())
    else:
        assert model.net.lm_head.weight is model.net.embed_tokens.weight  # tied: one tensor
        if model.dtype == torch.float32:  # a half file run in float32 keeps its matrices as stored
            stored = torch.float16 if tensor_type == "f16" else torch.bfloat16
            assert qkv.weight.dtype == (stored if kernels.available() else torch.float32)
    tokens = torch.tensor([shakespeare.encode("ROMEO:\nBut soft, what light")])
    ours = torch.log_softmax(model.forward(tokens, model.new_cache(1)), -1)
    theirs = torch.log_softmax(shakespeare.forward(tokens, shakespeare.new_cache(1)), -1)
    # KL(float || file) per position: small for 16/8 bits, larger (but bounded) for 4.
    kl = (theirs.exp() * (theirs - ours)).sum(-1).max().item()
    assert kl < {"f16": 1e-4, "bf16": 5e-3, "q8_0": 5e-3, "q4_0": 0.3}[tensor_type]


def tiny_checkpoint(directory, tokenizer_dir, kind: str):
    """A random 2-layer Qwen2 (q/k/v biases) or Qwen3 (q/k norms) with the tiny tokenizer."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]  # fmt: skip
    torch.manual_seed(0)
    config = config_class(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=128, tie_word_embeddings=kind == "qwen3")  # fmt: skip
    model_class(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_ggufs_are_the_same_model(kind, tiny_llama_dir, tmp_path, one_thread):
    from decodekit.models.native import NativeLM

    directory = tiny_checkpoint(tmp_path / kind, tiny_llama_dir, kind)
    model = load_model(str(write_gguf(directory, tmp_path / f"{kind}.gguf")))
    expected = NativeLM.from_pretrained(directory)
    assert model.config == expected.config
    tokens = torch.tensor([list(range(5, 40))])
    logits = expected.forward(tokens, expected.new_cache(1))
    assert torch.equal(model.forward(tokens, model.new_cache(1)), logits)


def test_llama3_rope_scaling_travels_as_frequency_factors(tiny_llama_dir, tmp_path, one_thread):
    """Llama 3's RoPE scaling is the tensor rope_freqs.weight in a GGUF file (llama.cpp's
    converter): divisors of each frequency, which must reproduce the scaled frequencies."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from decodekit.models.native import NativeLM

    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         rope_scaling=rope)  # fmt: skip
    directory = tmp_path / "llama3"
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, directory / name)
    expected = NativeLM.from_pretrained(directory)
    assert expected.config.rope.kind == "llama3"
    model = load_model(str(write_gguf(directory, tmp_path / "llama3.gguf")))
    factors = torch.tensor(model.config.rope.frequency_factors)
    assert factors.shape == (16,) and factors[0] == 1 and factors[-1] == 8  # high kept, low / 8
    tokens = torch.tensor([list(range(5, 100))])
    want = expected.forward(tokens, expected.new_cache(1))
    assert torch.allclose(model.forward(tokens, model.new_cache(1)), want, rtol=1e-4, atol=1e-4)


def rewrite(source, out, tensors: dict | None = None, strings: dict | None = None) -> None:
    """`source` with `tensors` (name -> (kind, data), or None to drop it; new names are added)
    and string metadata `strings` (key -> value) swapped in."""
    tensors, strings = tensors or {}, strings or {}
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in strings:
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        sub_type = field.types[-1] if array else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in strings.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    stored = {t.name: (t.tensor_type, np.array(t.data)) for t in reader.tensors}
    for name, value in {**stored, **tensors}.items():
        if value is not None:
            kind, data = value
            writer.add_tensor(name, data, raw_dtype=T[kind] if isinstance(kind, str) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dense_copy(model):
    """The model with every quantised or concatenated layer replaced by an nn.Linear of its
    dequantised weight."""
    dense = copy.deepcopy(model)
    for name, module in list(dense.net.named_modules()):
        if isinstance(module, QuantizedLinear | ConcatLinear) and ".parts." not in name:
            parts = module.parts if isinstance(module, ConcatLinear) else [module]
            weight = torch.cat([p.dequantized_weight() if isinstance(p, QuantizedLinear) else p.weight.float()
                                for p in parts])  # fmt: skip
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight.data.copy_(weight)
            dense.net.set_submodule(name, linear)
    return dense


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory, tiny_llama_dir):
    """A random 2-layer Llama of width 256 (K-quant blocks are 256 wide) with the tiny tokenizer."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("wide-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, directory / name)
    return directory


def hf_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a llama-arch GGUF q or k projection in Hugging Face's order: row h·D + j·D/2 + i
    (half j of head h) is GGUF's row h·D + 2i + j (convert_hf_to_gguf.py interleaves the halves)."""
    dim = rows.shape[0] // heads
    order = [h * dim + 2 * i + j for h in range(heads) for j in range(2) for i in range(dim // 2)]
    return rows[order]


def test_mixed_grids_keep_each_parts_blocks(wide_llama_dir, tmp_path, one_thread):
    """Q4_K_M's pattern: q and k in Q4_K beside v in Q6_K (so q/k/v is a ConcatLinear), gate in
    Q4_K and up in q4_0 (one int4 layer: zero points only where Q4_K has them), down in q8_0,
    the output head in Q6_K; llama-arch q and k rows back in Hugging Face's RoPE order."""
    f32 = write_gguf(wide_llama_dir, tmp_path / "f32.gguf")
    kinds = {"attn_q": ("Q4_K", 256, 256), "attn_k": ("Q4_K", 128, 256), "attn_v": ("Q6_K", 128, 256),
             "ffn_gate": ("Q4_K", 512, 256), "ffn_up": ("Q4_0", 512, 256), "ffn_down": ("Q8_0", 256, 512)}
    replace = {f"blk.{layer}.{name}.weight": (kind, random_blocks(kind, rows, cols, seed=10 * layer + i))
               for layer in range(2) for i, (name, (kind, rows, cols)) in enumerate(kinds.items())}
    replace["output.weight"] = ("Q6_K", random_blocks("Q6_K", 300, 256, seed=99))
    rewrite(f32, tmp_path / "mixed.gguf", replace)
    model = load_model(str(tmp_path / "mixed.gguf"))
    block = model.net.layers[1]
    qkv, gate_up = block.self_attn.qkv_proj, block.mlp.gate_up_proj
    assert isinstance(qkv, ConcatLinear) and [p.spec.bits for p in qkv.parts] == [4, 4, 8]
    assert isinstance(gate_up, QuantizedLinear) and gate_up.offsets is not None
    assert torch.equal(gate_up.offsets[512:], torch.zeros(512, 8))  # q4_0 has no zero points
    assert (block.mlp.down_proj.spec.bits, block.mlp.down_proj.spec.group_size) == (8, 32)
    assert (model.net.lm_head.spec.bits, model.net.lm_head.spec.group_size) == (8, 16)

    def expected(name: str) -> np.ndarray:
        kind, blocks = replace[f"blk.1.{name}.weight"]
        return reference(kind, blocks)

    want = np.concatenate([hf_rows(expected("attn_q"), heads=4), hf_rows(expected("attn_k"), heads=2),
                           expected("attn_v")])  # fmt: skip
    got = torch.cat([p.dequantized_weight() for p in qkv.parts]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    want = np.concatenate([expected("ffn_gate"), expected("ffn_up")])
    np.testing.assert_allclose(gate_up.dequantized_weight().numpy(), want, rtol=1e-6, atol=1e-7)
    dense = dense_copy(model)
    tokens = torch.tensor([list(range(3, 40))])
    want_logits = dense.forward(tokens, dense.new_cache(1))
    set_kernels(model.net, "unpack")
    scale = want_logits.abs().max()
    assert (model.forward(tokens, model.new_cache(1)) - want_logits).abs().max() <= 1e-4 * scale


# --- errors ------------------------------------------------------------------------------------------


def test_a_file_that_is_not_gguf_says_so(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"model.gguf: not a GGUF file \(it starts with b'\{\}'"):
        load_model(str(path))
    other = tmp_path / "weights.bin"
    other.write_text("x")
    with pytest.raises(ValueError, match="is a file but not a GGUF file"):
        load_model(str(other))


def test_a_truncated_file_is_named_and_nothing_loads(tmp_path):
    whole = write_gguf(ASSETS / "shakespeare", tmp_path / "whole.gguf", "q8_0")
    data = whole.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut.gguf: (truncated|truncated or corrupt) GGUF file"):
            load_model(str(tmp_path / "cut.gguf"))


def test_unsupported_architecture_tensor_type_and_tokenizer_are_named(tmp_path, tiny_llama_dir):
    write_file(tmp_path / "gpt2.gguf", {"w": np.zeros((2, 2), np.float32)}, arch="gpt2")
    allowed = (r"\['gemma', 'gemma2', 'gemma3', 'llama', 'olmo2', 'olmoe', 'phi3', 'qwen2', 'qwen2moe', "
               r"'qwen3', 'qwen3moe'\]")
    with pytest.raises(ValueError, match=rf"gpt2.gguf: general.architecture must be one of {allowed}, got"):
        load_model(str(tmp_path / "gpt2.gguf"))
    f32 = write_gguf(tiny_llama_dir, tmp_path / "f32.gguf")
    rows = np.zeros((64, 32), np.int32)  # an integer matrix: no float weight to make of it
    rewrite(f32, tmp_path / "int.gguf", {"blk.0.ffn_up.weight": ("I32", rows)})
    message = r"int.gguf: tensor 'blk.0.ffn_up.weight' has type I32, which decodekit cannot read \(supported"
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "int.gguf"))
    rewrite(f32, tmp_path / "bert.gguf", strings={"tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match=r"bert.gguf: tokenizer.ggml.model must be 'gpt2' \(byte-level BPE\) "
                                         r"or 'llama' \(SentencePiece\), got 'bert'"):  # fmt: skip
        load_model(str(tmp_path / "bert.gguf"))
    rewrite(f32, tmp_path / "yarn.gguf", strings={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match=r"llama.rope.scaling.type must be 'none' or 'linear', got 'yarn'"):
        load_model(str(tmp_path / "yarn.gguf"))


def test_missing_and_unexpected_tensors_are_named(tmp_path, tiny_llama_dir):
    f32 = write_gguf(tiny_llama_dir, tmp_path / "f32.gguf")
    rewrite(f32, tmp_path / "missing.gguf", {"blk.1.ffn_down.weight": None})
    with pytest.raises(ValueError, match=r"missing.gguf: tensor 'blk.1.ffn_down.weight' is missing"):
        load_model(str(tmp_path / "missing.gguf"))
    rewrite(f32, tmp_path / "extra.gguf", {"blk.0.attn_sinks.weight": ("F32", np.zeros(4, np.float32))})
    with pytest.raises(ValueError, match=r"extra.gguf: unexpected tensor 'blk.0.attn_sinks.weight'"):
        load_model(str(tmp_path / "extra.gguf"))
    rewrite(f32, tmp_path / "shape.gguf", {"blk.0.ffn_up.weight": ("F32", np.zeros((64, 16), np.float32))})
    with pytest.raises(ValueError, match=r"shape.gguf: tensor 'blk.0.ffn_up.weight' has shape \[64, 16\], "
                                         r"the metadata implies \[64, 32\]"):  # fmt: skip
        load_model(str(tmp_path / "shape.gguf"))


# --- SentencePiece vocabularies ("llama") ---------------------------------------------------------


def spm_reference(text: str, pieces: dict[str, float], byte_ids: dict[int, int],
                  ids: dict[str, int]) -> list[int]:  # fmt: skip
    """SentencePiece's BPE as llama.cpp's llm_tokenizer_spm runs it: the text with " " -> "▁"
    and one "▁" in front, split into characters, then repeatedly the adjacent pair whose
    concatenation is a piece of the highest score (the leftmost among equals) merged; a
    symbol left that is no piece becomes its UTF-8 bytes' <0xXX> tokens."""
    symbols = list("▁" + text.replace(" ", "▁"))
    while True:
        best, best_score = None, 0.0
        for i in range(len(symbols) - 1):
            merged = symbols[i] + symbols[i + 1]
            if merged in pieces and (best is None or pieces[merged] > best_score):
                best, best_score = i, pieces[merged]
        if best is None:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    out = []
    for symbol in symbols:
        out += [ids[symbol]] if symbol in ids else [byte_ids[b] for b in symbol.encode()]
    return out


def test_sentencepiece_vocabularies_tokenise_as_llama_cpp_defines(tmp_path):
    rng = np.random.default_rng(0)
    control = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    letters = sorted(set("▁abcdefghijklmnopqrstuvwxyz,.'RJOMEULIT"))
    words = ["▁t", "he", "▁the", "▁a", "an", "▁an", "▁and", "in", "▁in", "er", "ou", "▁o", "▁R", "om",
             "eo", "▁Rom", "▁Romeo", "▁wh", "ere", "▁where", "for", "▁wherefore", "ar", "▁art", "▁thou",
             "th", "▁th"]  # fmt: skip
    pieces = letters + words
    tokens = control + byte_tokens + pieces
    scores = [0.0] * (len(control) + len(byte_tokens)) + [float(s) for s in -rng.permutation(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    write_file(tmp_path / "spm.gguf", {"token_embd.weight": np.zeros((len(tokens), 8), np.float32)},
               tokenizer_model="llama", token_list=tokens, token_scores=scores, token_types=types,
               bos_token_id=1, eos_token_id=2, unk_token_id=0)  # fmt: skip
    from decodekit.models.gguf_tokenizer import build_tokenizer

    meta, _ = read_gguf(tmp_path / "spm.gguf")
    tokenizer = build_tokenizer(meta, "spm.gguf")
    ids = {t: i for i, t in enumerate(tokens)}
    score = {t: s for t, s in zip(tokens, scores) if t in pieces}
    byte_ids = {b: ids[f"<0x{b:02X}>"] for b in range(256)}
    for text in ["O Romeo, Romeo, wherefore art thou Romeo?", "the and in the", "Zounds! ünïcode 7"]:
        want = [1, *spm_reference(text, score, byte_ids, ids)]  # BOS: added by default for SentencePiece
        assert tokenizer.encode(text) == want, text
        assert tokenizer.decode(want, skip_special_tokens=True) == text


def test_plan_sizes_a_gguf_file(shakespeare, tmp_path):
    from decodekit.models.footprint import plan_memory

    path = write_gguf(ASSETS / "shakespeare", tmp_path / "s.gguf")
    plan = plan_memory(str(path), context=512)
    assert plan["parameters"] == shakespeare.num_parameters()
    assert plan["weight_bytes"] == 4 * plan["parameters"]
    assert (plan["num_layers"], plan["num_kv_heads"], plan["head_dim"]) == (4, 2, 64)
    quantised = plan_memory(str(write_gguf(ASSETS / "shakespeare", tmp_path / "q.gguf", "q4_0")), context=512)
    assert quantised["parameters"] is None and quantised["weight_bytes"] < plan["weight_bytes"] / 2


@pytest.mark.skipif(not kernels.available(), reason="half weights are kept only where the kernels read them")
def test_an_f16_files_memory_plan_is_what_it_holds(tmp_path):
    """An f16 file runs in float32 with its matrices, the tied embedding and head among them,
    kept in float16 (half_linear.py): `decodekit plan` counts them at 2 bytes."""
    from decodekit.models.footprint import plan_memory
    from decodekit.models.half_linear import HalfEmbedding

    path = write_gguf(ASSETS / "shakespeare", tmp_path / "s-f16.gguf", "f16")
    model = load_model(str(path))
    assert isinstance(model.net.embed_tokens, HalfEmbedding) and model.dtype == torch.float32
    held = sum(p.nbytes for p in model.net.parameters())
    assert plan_memory(str(path), context=16)["weight_bytes"] == held
