"""One compression run of a whole model: `CompressConfig`, calibration windows from text,
`compress_lm` (in place) and `compress_to_dir` (what `decodekit compress` calls).

Calibration follows GPTQ and SparseGPT (REFERENCES.md): `calib_windows` random segments of
`calib_length` tokens of held-in text (theirs: 128 segments of 2048 tokens of C4; ours
default to the shipped Shakespeare validation split, which no evaluation here scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decodekit.compress.apply import (
    PRUNE_METHODS,
    QUANT_METHODS,
    CompressionSummary,
    prune_model,
    quantize_head,
    quantize_model,
)
from decodekit.compress.prune import parse_n_m
from decodekit.models.base import LanguageModel
from decodekit.models.quant_grid import check_activation_bits
from decodekit.models.registry import ASSETS

METHODS = QUANT_METHODS + PRUNE_METHODS
CALIBRATION_TEXT = ASSETS / "data" / "shakespeare_val.txt"
DEFAULT_BITS = {"rtn": 8, "gptq": 4}
DEFAULT_SPARSITY = 0.5
# head_bits "auto" quantises the output head from this many tokens: real tokenizers (Llama 2's
# 32,000 on), not the package's 2,048-token models, whose tables keep a float head.
AUTO_HEAD_VOCAB = 32_000


@dataclass(frozen=True)
class CompressConfig:
    """What to do to every Linear layer, and to the output head (`head_bits`: by default int8 at
    a real vocabulary only). None means the method's default (bits: 8 for rtn, 4 for gptq;
    sparsity 0.5); options of the other family are errors."""

    method: str
    bits: int | None = None
    group_size: int | None = None  # None: one scale per output channel
    act_order: bool = False  # gptq: quantise columns by decreasing Hessian diagonal
    # 8: the layers also quantise their inputs per block of 32 to int8 (W8A8 / W4A8, llama.cpp's
    # q8_0 / q4_0 numerics; models/qlinear.py); None: weight-only
    activation_bits: int | None = None
    # the output head RTN-quantised to these bits, one scale per channel (compress/apply.py
    # `quantize_head`; llama.cpp's quantisers keep it at 6-8 bits); None: float; "auto": 8 where
    # the quantised model's vocabulary is a real tokenizer's (`AUTO_HEAD_VOCAB` tokens or more),
    # float for smaller ones (the package's 2,048-token models)
    head_bits: int | str | None = "auto"
    sparsity: float | None = None
    n_m: str | None = None  # "2:4": n zeros in every m consecutive weights
    calib_windows: int = 128
    calib_length: int | None = None  # None: min(model context, 512)
    block_size: int = 128
    damp: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        quant = self.method in QUANT_METHODS
        wrong = {
            "bits": self.bits is not None and not quant,
            "group_size": self.group_size is not None and not quant,
            "act_order": self.act_order and self.method != "gptq",
            "activation_bits": self.activation_bits is not None and not quant,
            "head_bits": self.head_bits not in (None, "auto") and not quant,
            "sparsity": self.sparsity is not None and quant,
            "n_m": self.n_m is not None and quant,
        }
        for option, bad in wrong.items():
            if bad:
                raise ValueError(f"{option} does not apply to method {self.method!r}")
        if self.bits is not None and (isinstance(self.bits, bool) or not 2 <= self.bits <= 8):
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        head = self.head_bits
        if head not in (None, "auto") and (isinstance(head, bool) or head not in (4, 8)):
            raise ValueError(f"head_bits must be 8, 4, None (the head in float) or 'auto', got {head!r}")
        check_activation_bits(self.activation_bits, self.group_size)
        if self.sparsity is not None and not 0 <= self.sparsity < 1:
            raise ValueError(f"sparsity must be in [0, 1), got {self.sparsity}")
        if self.sparsity is not None and self.n_m is not None:
            raise ValueError("give sparsity or n_m, not both")
        if self.n_m is not None:
            parse_n_m(self.n_m)
        if self.calib_windows < 1:
            raise ValueError(f"calib_windows must be >= 1, got {self.calib_windows}")
        if self.calib_length is not None and self.calib_length < 2:
            raise ValueError(f"calib_length must be >= 2, got {self.calib_length}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def head_bits_for(self, vocab_size: int) -> int | None:
        """The output head's bits for a model of `vocab_size` tokens (None: float): "auto" is 8
        from `AUTO_HEAD_VOCAB` tokens, where the head is among a small model's largest matrices
        (Qwen2.5-0.5B's 151,936 x 896: a quarter of its weights, 545 MB a token in float32)."""
        if self.method not in QUANT_METHODS:
            return None
        if self.head_bits == "auto":
            return 8 if vocab_size >= AUTO_HEAD_VOCAB else None
        return self.head_bits

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("gptq", "sparsegpt")

    def label(self) -> str:
        """Short name of the run, e.g. 'gptq-4b-g128' or 'sparsegpt-2:4'."""
        if self.method in QUANT_METHODS:
            bits = self.bits or DEFAULT_BITS[self.method]
            group = f"-g{self.group_size}" if self.group_size else ""
            a8 = f"-a{self.activation_bits}" if self.activation_bits else ""
            head = f"-h{self.head_bits}" if isinstance(self.head_bits, int) else ""
            return f"{self.method}-{bits}b{group}{'-act' if self.act_order else ''}{a8}{head}"
        if self.n_m is not None:
            return f"{self.method}-{self.n_m}"
        return f"{self.method}-{round(100 * (self.sparsity or DEFAULT_SPARSITY))}%"


def calibration_batches(
    model: LanguageModel,
    text: str | Sequence[int],
    windows: int,
    length: int,
    batch_size: int = 8,
    seed: int = 0,
) -> list[torch.Tensor]:
    """`windows` segments of `length` tokens of `text` (or of token ids, for models without a
    tokenizer) at random offsets, as [B, length] batches."""
    ids = torch.tensor(model.encode(text) if isinstance(text, str) else list(text))  # [N] long
    if len(ids) < length:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one window of {length}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length + 1, (windows,), generator=generator)
    rows = torch.stack([ids[s : s + length] for s in starts.tolist()])  # [windows, length]
    return list(rows.split(batch_size))


def _net_forward(lm: Any):
    """How apply.py runs one calibration batch [B, T] through a NativeLM's `net`."""
    return lambda net, tokens: lm.forward(tokens, lm.new_cache(tokens.shape[0]))


def compress_lm(
    lm: Any,
    config: CompressConfig,
    calib_text: str | Sequence[int] | None = None,
    progress: bool = False,
) -> CompressionSummary:
    """Compress a NativeLM in place (its `net`); `calib_text` (text or token ids) defaults to
    the shipped validation split; `progress` shows a bar over the layers on stderr. Returns
    what was done."""
    from decodekit.models.native import NativeLM

    if not isinstance(lm, NativeLM):
        raise TypeError(
            f"compression runs on NativeLM (Llama-family) models, got {type(lm).__name__}"
        )
    batches: Sequence[torch.Tensor] | None = None
    if config.needs_calibration:
        text = CALIBRATION_TEXT.read_text() if calib_text is None else calib_text
        length = config.calib_length or min(lm.max_context, 512)
        if length > lm.max_context:
            raise ValueError(
                f"calib_length must be at most the model's context {lm.max_context}, got {length}"
            )
        batches = calibration_batches(lm, text, config.calib_windows, length, seed=config.seed)
    calibration = {"calib_batches": batches, "forward": _net_forward(lm),
                   "block_size": config.block_size, "damp": config.damp, "progress": progress}  # fmt: skip
    if config.method in QUANT_METHODS:
        summary = quantize_model(
            lm.net, config.method, config.bits or DEFAULT_BITS[config.method],
            config.group_size, act_order=config.act_order, activation_bits=config.activation_bits,
            **calibration,
        )  # fmt: skip
        head_bits = config.head_bits_for(lm.vocab_size)
        if head_bits is not None:
            quantize_head(lm.net, head_bits)
            summary.head_bits = head_bits
            summary.layers.append("lm_head")
    else:
        sparsity = DEFAULT_SPARSITY if config.sparsity is None else config.sparsity
        summary = prune_model(lm.net, config.method, sparsity, config.n_m, **calibration)
    if batches:
        summary.calib_batches = sum(b.shape[0] for b in batches)  # windows, not [B, T] batches
    return summary


def quantized_copy(lm: Any, config: CompressConfig, calib_text: str | Sequence[int] | None = None) -> Any:
    """A compressed copy of the float NativeLM `lm` that shares its float tensors: the
    embedding, norms and (unless `config.head_bits` quantises it) output head are the same
    tensors, only the compressed layers are new, so the copy costs the bytes of its codes.
    `lm` is left unchanged. Used as a speculative drafter of its own original
    (decode/drafters.py, "self-int4")."""
    import copy

    from decodekit.models.native import NativeLM

    if not isinstance(lm, NativeLM):
        raise TypeError(f"a quantised copy needs a NativeLM (Llama-family) model, got {type(lm).__name__}")
    shared = {id(t): t for t in [*lm.net.parameters(), *lm.net.buffers()]}
    net = copy.deepcopy(lm.net, memo=shared)  # new modules over the same tensors
    twin = NativeLM(net, lm.config, name=f"{lm.name}-{config.label()}", tokenizer=lm.tokenizer,
                    eos_token_ids=lm.eos_token_ids)  # fmt: skip
    summary = compress_lm(twin, config, calib_text)
    if not summary.layers:
        raise ValueError(f"model {lm.name!r} has no float Linear layer that {config.label()} applies to")
    return twin


def compress_to_dir(
    model: str | Path,
    config: CompressConfig,
    out: str | Path,
    calib_file: str | Path | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Load `model` (embedded name or local directory), compress it, write `out`;
    `progress` shows a bar over the layers on stderr.

    The model loads in its checkpoint's dtype: a bfloat16 checkpoint is read and calibrated
    in bfloat16 (no float32 copy of the model), while rounding and GPTQ's updates run in
    float32 on each layer's weight (quantize.py). The directory loads back as float32 codes
    and scales either way (models/compressed.py).

    Returns a report: the summary, the source dtype, bytes in memory before and after, bytes
    on disk, and how many quantised layers run on each matmul kernel (models/qlinear.py).
    """
    from decodekit.compress.apply import model_nbytes
    from decodekit.compress.pretrained import is_compressed_dir, save_compressed_dir
    from decodekit.models.compressed import WEIGHTS_FILE
    from decodekit.models.qlinear import kernel_counts
    from decodekit.models.registry import load_model, resolve

    name, source, kind = resolve(model)
    if kind == "gguf":
        raise ValueError(f"model {str(model)!r} is a GGUF file; compress starts from a Hugging Face "
                         "directory")
    if is_compressed_dir(source):
        raise ValueError(f"model {str(model)!r} is already compressed; start from the float model")
    lm = load_model(model, backend="native")
    calib_text = Path(calib_file).read_text() if calib_file is not None else None
    before = model_nbytes(lm.net)
    summary = compress_lm(lm, config, calib_text, progress)
    out = save_compressed_dir(lm, out, source, summary)
    return {
        "model": name,
        "out": str(out),
        "label": config.label(),
        "source_dtype": str(lm.dtype).removeprefix("torch."),
        "layers": len(summary.layers),
        "kernels": kernel_counts(lm.net),
        "summary": summary.to_dict(),
        "memory_bytes_before": before,
        "memory_bytes_after": model_nbytes(lm.net),
        "disk_bytes": (out / WEIGHTS_FILE).stat().st_size,
    }
