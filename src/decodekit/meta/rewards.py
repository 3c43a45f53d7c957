"""Learned reward models as plain scorers.

A reward model here is a small transformer with a one-logit token-classification head
(`LlamaForTokenClassification`, num_labels=1): it reads a prompt and a sequence of text
segments and, at the last token of each segment, predicts P(label = 1) = sigmoid(logit).
Causal attention makes the score of segment t depend only on the prompt and segments 0..t,
so one forward pass scores every step of a solution: a process reward model (PRM) scores each
step, an outcome reward model (ORM) scores one segment, the whole solution. Task modules
wrap a scorer into the callables meta-generators take (`meta/tasks/arith.py`: load_orm,
load_prm).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


class SegmentScorer:
    """P(label = 1) at the end of each segment, from a token-classification transformer."""

    def __init__(self, model, tokenizer, name: str = "reward"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str | None = None) -> SegmentScorer:
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        path = Path(path)
        model = AutoModelForTokenClassification.from_pretrained(
            path, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(model, tokenizer, name or path.name)

    def encode(self, prompt: str, segments: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of prompt + segments and the position of each segment's last token."""
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ends = []
        for segment in segments:
            piece = self.tokenizer.encode(segment, add_special_tokens=False)
            if not piece:
                raise ValueError(f"segment {segment!r} encodes to no tokens")
            ids += piece
            ends.append(len(ids) - 1)
        return ids, ends

    @torch.inference_mode()
    def score_segments(self, prompt: str, segments: Sequence[str]) -> list[float]:
        if not segments:
            return []
        ids, ends = self.encode(prompt, segments)
        logits = self.model(input_ids=torch.tensor([ids])).logits[0, :, 0]  # [T]
        return torch.sigmoid(logits[ends].float()).tolist()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_reward_model(name_or_path: str | Path) -> SegmentScorer:
    """An embedded reward model by name (registry.json) or a local checkpoint directory."""
    from decodekit.models.registry import resolve

    name, path, _ = resolve(name_or_path)
    return SegmentScorer.from_pretrained(path, name=name)
