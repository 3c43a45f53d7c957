"""Weight quantisation and pruning of the Linear layers of a model (seed 000, REFERENCES.md).

Layer level: `quantize_rtn`, `gptq_quantize`, `clip_round`, `prune_magnitude`,
`prune_sparsegpt`. Model level: `quantize_model` (Linear -> `QuantizedLinear`, in place),
`prune_model`, and `save_compressed` / `load_compressed` for checkpoints. Whole models:
`CompressConfig` + `compress_lm` (a NativeLM in place), `compress_to_dir` / `load_model(DIR)`
for compressed model directories, `perplexity` / `text_perplexity` to measure the result.
The integer layout (`QuantSpec`, round-to-nearest, `QuantizedLinear`) and the reading of
checkpoints and directories belong to models/ (qlinear.py, compressed.py), so that loading
a compressed model never imports this package; they are exported here too.
"""

from decodekit.compress.apply import (
    CompressionSummary,
    collect_hessians,
    find_linears,
    model_nbytes,
    prune_model,
    quantize_model,
)
from decodekit.compress.checkpoint import save_compressed
from decodekit.compress.evaluate import PerplexityResult, perplexity, text_perplexity
from decodekit.compress.hessian import HessianAccumulator, hessian_from_inputs
from decodekit.compress.pretrained import is_compressed_dir, save_compressed_dir
from decodekit.compress.prune import (
    magnitude_mask,
    nm_mask,
    parse_n_m,
    prune_magnitude,
    prune_sparsegpt,
)
from decodekit.compress.quantize import clip_round, gptq_quantize
from decodekit.compress.recipe import CompressConfig, compress_lm, compress_to_dir
from decodekit.models.compressed import load_compressed, load_compressed_dir, read_compression_config
from decodekit.models.qlinear import QuantizedLinear
from decodekit.models.quant_grid import (
    QuantSpec,
    absmax_scales,
    dequantize,
    pack_int4,
    quantize_rtn,
    round_half_away,
    unpack_int4,
)

__all__ = [
    "CompressConfig",
    "CompressionSummary",
    "HessianAccumulator",
    "PerplexityResult",
    "QuantSpec",
    "QuantizedLinear",
    "absmax_scales",
    "clip_round",
    "collect_hessians",
    "compress_lm",
    "compress_to_dir",
    "dequantize",
    "find_linears",
    "gptq_quantize",
    "hessian_from_inputs",
    "is_compressed_dir",
    "load_compressed",
    "load_compressed_dir",
    "magnitude_mask",
    "model_nbytes",
    "nm_mask",
    "pack_int4",
    "parse_n_m",
    "perplexity",
    "prune_magnitude",
    "prune_model",
    "prune_sparsegpt",
    "quantize_model",
    "quantize_rtn",
    "read_compression_config",
    "round_half_away",
    "save_compressed",
    "save_compressed_dir",
    "text_perplexity",
    "unpack_int4",
]
