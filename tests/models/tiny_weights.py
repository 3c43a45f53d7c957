"""The tiny transformers models the parity tests compare NativeLM with: their random weights,
saved with a tokenizer, and transformers' own logits and greedy tokens."""

from __future__ import annotations

import shutil

import torch
import transformers


def randomize(
    model: torch.nn.Module, seed: int = 0, norm_center: float = 1.0, norm_spread: float = 0.1
) -> None:
    """Weights far from uniform attention, so a wrong mask, rotation or scale shows: each
    norm's weight norm_center + norm_spread x N(0, 1) (Gemma's (1 + w) norms: center 0), every
    other parameter 0.15 x N(0, 1), drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(norm_center + norm_spread * noise if "norm" in name else 0.15 * noise)


def save_tiny(config, path, tokenizer_dir=None, **weights) -> transformers.PreTrainedModel:
    """transformers' model of `config` with `randomize(**weights)`'s weights, saved to `path`
    with `tokenizer_dir`'s tokenizer files (where given); the model, in eval mode."""
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, **weights)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tokenizer_dir is not None and (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return model.eval()


def hf_logits(hf_model, sequence: list[int]) -> torch.Tensor:
    """transformers' logits [T, V] float32 of one sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([sequence])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' `generate()` greedy tokens after `prompt`, EOS ignored."""
    with torch.no_grad():
        ones = torch.ones((1, len(prompt)), dtype=torch.long)
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=ones, max_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()
