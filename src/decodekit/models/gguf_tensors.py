"""GGUF tensor blocks as decodekit weights (issue 27): integer codes for QuantizedLinear where
the block layout is an integer grid decodekit's kernels run, float tensors otherwise.

The block layouts are ggml's (ggml-common.h `block_q8_0`, `block_q4_0`, `block_q4_K`,
`block_q6_K`; their dequantisation is ggml-quants.c `dequantize_row_*`). A row of K weights
is K / 32 (or K / 256 for the K-quants) blocks stored back to back:

- q8_0, 34 bytes per 32 weights: d (float16), 32 int8 q; w = d · q. -> int8 codes q, group 32,
  scale d.
- q4_0, 18 bytes per 32 weights: d (float16), 16 bytes whose low nibbles are weights 0..15 and
  high nibbles 16..31; w = d · (q - 8). -> int4 codes q - 8 (in -8..7), group 32, scale d.
- Q4_K, 144 bytes per 256 weights: d, dmin (float16), 12 bytes of 6-bit scale sc_j and min m_j
  for the 8 sub-blocks of 32 (`get_scale_min_k4`), 128 bytes of nibbles (bytes 32c..32c+31 hold
  sub-block 2c in their low nibbles and 2c + 1 in their high ones); w = d·sc_j · q - dmin·m_j.
  -> int4 codes q - 8, group 32, scale d·sc_j and offset 8·d·sc_j - dmin·m_j (w = c·s + z).
- q5_0, 22 bytes per 32 weights: d, 4 bytes qh (bit j: weight j's fifth bit), 16 bytes of
  nibbles as q4_0's; w = d · (q - 16). -> int8 codes q - 16 (in -16..15), group 32, scale d.
- q4_1 (20 bytes: d, m, nibbles) and q5_1 (24 bytes: d, m, qh, nibbles); w = d · q + m. -> int4
  codes q - 8 (int8 codes q - 16 for q5_1), group 32, scale d, offset m + 8·d (m + 16·d).
- Q6_K, 210 bytes per 256 weights: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits),
  16 int8 scales, d (float16); w = d·sc_{i/16} · (q - 32). -> int8 codes q - 32 (6 bits in
  -32..31), group 16, scale d·sc. Exact, and 10 bits per weight rather than a float copy.

The scales are products of a float16 and an integer below 2^7, exact in float32, so codes and
scales reproduce ggml's weights exactly; an offset (Q4_K's 8·d·sc - dmin·m, q4_1's m + 8·d)
is one float32 rounding away from ggml's own sum.
f32, f16 and bf16 tensors are read as they are; every other type gguf-py's `gguf.quants`
dequantises (Q5_K, Q3_K, Q2_K, the IQ types, ...) becomes float once, at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# ggml type name -> (bits, group) of the QuantizedLinear grid its blocks map to (module docstring).
INTEGER_TYPES = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_K": (4, 32), "Q6_K": (8, 16), "Q5_0": (8, 32),
                 "Q4_1": (4, 32), "Q5_1": (8, 32)}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class Quantized:
    """A weight [N, K] as QuantizedLinear holds it: Ŵ = codes · scales (+ offsets)."""

    bits: int
    group_size: int
    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / group_size]
    offsets: torch.Tensor | None = None  # float32 [N, K / group_size]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """Ŵ [N, K] float32."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, -1, self.group_size) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.view(n, k)


def _float16(raw: np.ndarray) -> np.ndarray:
    """float32 values of little-endian float16 bytes [..., 2]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """uint8 [N, bytes] -> [N, blocks, block_bytes]."""
    return raw.reshape(raw.shape[0], -1, block_bytes)


def decode_q8_0(raw: np.ndarray) -> Quantized:
    blocks = _blocks(raw, 34)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1)
    return Quantized(8, 32, torch.from_numpy(codes.copy()), torch.from_numpy(_float16(blocks[..., :2])))


def decode_q4_0(raw: np.ndarray) -> Quantized:
    blocks = _blocks(raw, 18)
    qs = blocks[..., 2:]  # [N, G, 16]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8) - 8  # [N, G, 32]
    return Quantized(4, 32, torch.from_numpy(q.reshape(raw.shape[0], -1)),
                     torch.from_numpy(_float16(blocks[..., :2])))  # fmt: skip


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """The 32 four-bit values of a q4_0-style block's 16 bytes [..., 16] (low nibbles are
    weights 0..15, high nibbles 16..31) -> int16 [..., 32]."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int16)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of q5_0/q5_1's little-endian 32-bit qh [..., 4] as 0/16 for weight j -> [..., 32]."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)


def decode_q5_0(raw: np.ndarray) -> Quantized:
    blocks = _blocks(raw, 22)
    q = (_nibbles(blocks[..., 6:22]) | _fifth_bits(blocks[..., 2:6])) - 16  # [N, G, 32]
    return Quantized(8, 32, torch.from_numpy(q.astype(np.int8).reshape(raw.shape[0], -1)),
                     torch.from_numpy(_float16(blocks[..., :2])))  # fmt: skip


def decode_q4_1(raw: np.ndarray) -> Quantized:
    blocks = _blocks(raw, 20)
    d, m = _float16(blocks[..., 0:2]), _float16(blocks[..., 2:4])
    q = _nibbles(blocks[..., 4:20]) - 8
    return Quantized(4, 32, torch.from_numpy(q.astype(np.int8).reshape(raw.shape[0], -1)),
                     torch.from_numpy(d), torch.from_numpy(m + 8 * d))  # fmt: skip


def decode_q5_1(raw: np.ndarray) -> Quantized:
    blocks = _blocks(raw, 24)
    d, m = _float16(blocks[..., 0:2]), _float16(blocks[..., 2:4])
    q = (_nibbles(blocks[..., 8:24]) | _fifth_bits(blocks[..., 4:8])) - 16
    return Quantized(8, 32, torch.from_numpy(q.astype(np.int8).reshape(raw.shape[0], -1)),
                     torch.from_numpy(d), torch.from_numpy(m + 16 * d))  # fmt: skip


def q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins [..., 8] of Q4_K's 12 scale bytes [..., 12]
    (ggml-quants.c `get_scale_min_k4`)."""
    s = packed.astype(np.uint8)
    low, mid, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = np.concatenate([low & 63, (high & 0xF) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def decode_q4_k(raw: np.ndarray) -> Quantized:
    blocks = _blocks(raw, 144)
    n, supers = blocks.shape[:2]
    d, dmin = _float16(blocks[..., 0:2]), _float16(blocks[..., 2:4])  # [N, S]
    sc, m = q4_k_scales_mins(blocks[..., 4:16])  # [N, S, 8]
    qs = blocks[..., 16:].reshape(n, supers, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).astype(np.int8) - 8  # [N, S, 4, 2, 32]
    scales = d[..., None] * sc.astype(np.float32)  # [N, S, 8]
    offsets = 8 * scales - dmin[..., None] * m.astype(np.float32)
    return Quantized(4, 32, torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(scales.reshape(n, -1)),
                     torch.from_numpy(offsets.reshape(n, -1)))  # fmt: skip


def decode_q6_k(raw: np.ndarray) -> Quantized:
    blocks = _blocks(raw, 210)
    n, supers = blocks.shape[:2]
    ql = blocks[..., :128].reshape(n, supers, 2, 2, 32)  # [N, S, half, a/b, 32]
    qh = blocks[..., 128:192].reshape(n, supers, 2, 32)
    a, b = ql[:, :, :, 0], ql[:, :, :, 1]
    parts = [(a & 0xF) | (((qh >> 0) & 3) << 4), (b & 0xF) | (((qh >> 2) & 3) << 4),
             (a >> 4) | (((qh >> 4) & 3) << 4), (b >> 4) | (((qh >> 6) & 3) << 4)]  # fmt: skip
    q = np.stack(parts, axis=3).astype(np.int8) - 32  # [N, S, half, 4, 32]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [N, S, 16]
    scales = _float16(blocks[..., 208:210])[..., None] * sc
    return Quantized(8, 16, torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(scales.reshape(n, -1)))


DECODERS = {"Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_K": decode_q4_k, "Q6_K": decode_q6_k,
            "Q5_0": decode_q5_0, "Q4_1": decode_q4_1, "Q5_1": decode_q5_1}


def decode(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray | torch.Tensor | Quantized:
    """One tensor's data as the reader holds it (float values, or uint8 [rows, bytes] for
    block types) -> its values of `shape` (numpy order, [N, K]): for F32 and F16 the file's
    own array, a read-only view that the caller copies once into place (gguf_model.py
    `float_weight`); else a float tensor or, for a 2-D tensor of an INTEGER_TYPES type, its
    Quantized grid, both copies that keep nothing of the file mapped."""
    if type_name in ("F32", "F16"):
        return np.asarray(raw).reshape(shape)
    if type_name == "BF16":
        return torch.from_numpy(np.array(raw, copy=True).view(np.int16).reshape(shape)).view(torch.bfloat16)
    rows = np.ascontiguousarray(raw).reshape(int(np.prod(shape[:-1])), -1)
    if type_name in DECODERS:
        grid = DECODERS[type_name](rows)
        if len(shape) == 2:
            return grid
        return grid.dequantize().reshape(shape)
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(rows, GGMLQuantizationType[type_name])  # raises NotImplementedError
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


def unpermute_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's reordering of a llama-arch q or k projection
    (convert_hf_to_gguf.py `LlamaModel.permute`: within each head, rows (j, i) -> (i, j) for
    j in 2, i in head_dim / 2, so that ggml's rotation of adjacent pairs equals the Hugging
    Face rotation of halves). Works on any per-row data: float rows or rows of block bytes."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
