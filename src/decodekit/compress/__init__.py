"""Weight quantisation and pruning of the Linear layers of a model (seed 000, REFERENCES.md).

Layer level: `quantize_rtn`, `gptq_quantize`, `clip_round`, `prune_magnitude`,
`prune_sparsegpt`. Model level: `quantize_model` (Linear -> `QuantizedLinear`, in place),
`prune_model`, and `save_compressed` / `load_compressed` for checkpoints.
"""

from decodekit.compress.apply import (
    CompressionSummary,
    collect_hessians,
    find_linears,
    model_nbytes,
    prune_model,
    quantize_model,
)
from decodekit.compress.checkpoint import (
    load_compressed,
    read_compression_config,
    save_compressed,
)
from decodekit.compress.hessian import HessianAccumulator, hessian_from_inputs
from decodekit.compress.prune import (
    magnitude_mask,
    nm_mask,
    parse_n_m,
    prune_magnitude,
    prune_sparsegpt,
)
from decodekit.compress.qlinear import QuantizedLinear, pack_int4, unpack_int4
from decodekit.compress.quantize import (
    QuantSpec,
    absmax_scales,
    clip_round,
    dequantize,
    gptq_quantize,
    quantize_rtn,
    round_half_away,
)

__all__ = [
    "CompressionSummary",
    "HessianAccumulator",
    "QuantSpec",
    "QuantizedLinear",
    "absmax_scales",
    "clip_round",
    "collect_hessians",
    "dequantize",
    "find_linears",
    "gptq_quantize",
    "hessian_from_inputs",
    "load_compressed",
    "magnitude_mask",
    "model_nbytes",
    "nm_mask",
    "pack_int4",
    "parse_n_m",
    "prune_magnitude",
    "prune_model",
    "prune_sparsegpt",
    "quantize_model",
    "quantize_rtn",
    "read_compression_config",
    "round_half_away",
    "save_compressed",
    "unpack_int4",
]
