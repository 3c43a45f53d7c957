"""Reward-model scoring through transformers, for bodies decodekit's NativeLM does not run.

The body is the checkpoint's base model (`AutoModel`: its `last_hidden_state` is the final
norm's output, what a transformers classification or LM head reads); the head is the one
reward_heads.py built from the same tensors, so both paths apply one head. Items run in
right-padded batches, each over its whole token sequence (no cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

BATCH = 16


class TransformersScorer:
    """Head outputs of items through a transformers base model (module docstring)."""

    def __init__(self, path: Path, head: nn.Module):
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        self.head = head
        self.tokens_computed = 0
        self.tokens_scored = 0

    @torch.inference_mode()
    def head_outputs(self, items: Sequence[tuple[list[int], list[int], int]]) -> list[torch.Tensor]:
        out = []
        for b in range(0, len(items), BATCH):
            chunk = items[b : b + BATCH]
            width = max(len(ids) for ids, _, _ in chunk)
            # right padding: positions stay 0..n-1; built on the host, copied once
            device = self.body.device
            ids = torch.tensor([list(seq) + [0] * (width - len(seq)) for seq, _, _ in chunk], device=device)
            mask = (torch.arange(width, device=device)[None, :]
                    < torch.tensor([len(seq) for seq, _, _ in chunk], device=device)[:, None]).long()
            states = self.body(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [B, T, H]
            for row, (seq, positions, _) in enumerate(chunk):
                out.append(self.head(states[row, positions]))  # [S, L]
                self.tokens_computed += len(seq)
                self.tokens_scored += len(seq)
        return out
