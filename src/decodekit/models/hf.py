"""`HFModelLM`: any local Hugging Face `AutoModelForCausalLM` behind the LanguageModel contract.

The fallback for architectures `NativeLM` does not implement. The cache wraps a
transformers `DynamicCache` together with the attention mask of every position
seen so far, so left-padded rows keep their own position ids.

`load_causal_lm` is how decodekit loads every transformers model (here, the reward models'
policies, the benchmarks' baselines): without transformers' "Loading weights" bars unless
asked for.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from decodekit.models.base import Cache, LanguageModel


class HFCache(Cache):
    def __init__(self, batch_size: int, device: str | torch.device = "cpu"):
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self.mask = torch.zeros((batch_size, 0), dtype=torch.bool, device=device)  # [B, L]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def fork(self, rows: Sequence[int]) -> HFCache:
        other = copy.copy(self)
        other.kv = copy.deepcopy(self.kv)
        other.mask = self.mask
        other.select(rows)
        return other

    def select(self, rows: Sequence[int]) -> None:
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.mask.device)
        if self.length > 0:
            self.kv.reorder_cache(index)
        self.mask = self.mask[index]

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        if length < self.length:
            self.kv.crop(length - self.length)  # transformers 5 takes minus the tokens to remove
        self.mask = self.mask[:, :length]


class HFModelLM(LanguageModel):
    """A transformers causal LM (float32 on the CPU unless loaded otherwise), in inference
    mode; its logits are float32 whatever the weights' dtype, on the model's device."""

    def __init__(self, model, tokenizer, name: str):
        self.model = model.eval()
        # transformers 5 renamed forward's `past_key_values` to `cache` (the old name warns,
        # FutureWarning, to be removed in 5.40); earlier versions know only the old one.
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.tokenizer = tokenizer
        self.name = name
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.device = model.device

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        name: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        progress: bool = False,
    ) -> HFModelLM:
        """The checkpoint directory `path` in `dtype` on `device`; `progress`: transformers'
        loading bars."""
        from decodekit.models.checkpoint import load_tokenizer

        path = Path(path)
        model = load_causal_lm(path, dtype, progress).to(device)
        return cls(model, load_tokenizer(path), name or path.name)

    def new_cache(self, batch_size: int) -> HFCache:
        return HFCache(batch_size, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: HFCache, mask: torch.Tensor | None = None):
        tokens = tokens.to(self.device)
        mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.to(self.device)
        full_mask = torch.cat([cache.mask, mask], dim=1)  # [B, L + T]
        # Padding does not advance a row's position: position = real tokens before it.
        positions = full_mask.long().cumsum(dim=1)[:, -tokens.shape[1] :] - 1
        out = self.model(
            input_ids=tokens,
            attention_mask=full_mask.long(),
            position_ids=positions.clamp(min=0),
            use_cache=True,
            **{self.cache_argument: cache.kv},
        )
        cache.mask = full_mask
        return out.logits.float()  # [B, T, V]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


@contextmanager
def loading_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars ("Loading weights") on or off for the block, then as before."""
    from transformers.utils import logging

    before = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()
    try:
        yield
    finally:
        (logging.enable_progress_bar if before else logging.disable_progress_bar)()


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False):
    """transformers' AutoModelForCausalLM of a local directory, in eval mode; `progress`:
    its loading bars (off: decodekit's output is the answer, not a loading log). A directory
    whose weights are stored as int8 (models/int8_storage.py) is built from its config and
    given the dequantised float32 weights, which transformers cannot read itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from decodekit.models import int8_storage

    if int8_storage.is_int8_storage(Path(path)):
        from decodekit.models.checkpoint import load_safetensors

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(load_safetensors(Path(path)), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # a tied lm_head is not stored
            raise ValueError(f"{path}: weights do not match its config.json (missing {missing}, "
                             f"unexpected {unexpected})")
        model.tie_weights()
        return model.to(dtype).eval()
    with loading_bars(progress):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval()


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """EOS ids from the generation config, the model config and the tokenizer, deduplicated."""
    found: list[int] = []
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    sources += [getattr(model.config, "eos_token_id", None)]
    sources += [getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None]
    for value in sources:
        for token in value if isinstance(value, list | tuple) else [value]:
            if token is not None and token not in found:
                found.append(int(token))
    return tuple(found)
