"""Token healing (seed 001): back the prompt up over its last token(s), then make the first
generated token(s) reproduce the removed bytes.

A prompt that ends inside a frequent token ("The url is http:" ends on ":" where the model
learnt "://") forces a tokenisation the model rarely saw. Healing removes the prompt's last
`k` tokens and constrains generation: while removed bytes remain, a token is allowed only if
its bytes start with what remains (it covers the rest and goes on) or are a prefix of it (it
covers part of it). So the model picks the natural merged token itself ("://"), and
prompt + completion still starts with the prompt text exactly.

`Completion.text` is the text after the original prompt (the removed bytes are not repeated);
`token_ids` start with the healing token(s), whose text begins with the removed bytes. The
prompt is not healed when it would become empty, or when a removed token is special or
not whole characters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from weakref import WeakKeyDictionary

import torch

from decodekit.decode.constrained import ll_tokenizer
from decodekit.models.base import LanguageModel

NEG_INF = float("-inf")
HEAL_CONTEXT = 4  # prompt tokens decoded before the generated ones
_TOKEN_BYTES: WeakKeyDictionary = WeakKeyDictionary()


def token_bytes(model: LanguageModel) -> list[bytes | None]:
    """Bytes of every token id (None for special tokens), cached per tokenizer."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise TypeError(f"model {model.name!r} has no tokenizer; token healing needs one")
    if tokenizer not in _TOKEN_BYTES:
        ll = ll_tokenizer(model)
        _TOKEN_BYTES[tokenizer] = [
            None if ll.is_special_token(t) else ll.decode_bytes([t]) for t in range(model.vocab_size)
        ]
    return _TOKEN_BYTES[tokenizer]


class HealingMask:
    """Per row: the removed bytes not yet reproduced; masks tokens that disagree with them."""

    def __init__(self, table: list[bytes | None], removed: bytes, num_rows: int):
        self.table = table
        self.remaining = [removed] * num_rows
        self._allowed: dict[bytes, torch.Tensor] = {}  # remaining bytes -> allowed [V] bool

    def allowed_for(self, remaining: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        """[V] bool on `device`: tokens whose bytes start with `remaining` or are a non-empty
        prefix of it (built on the host once per `remaining`, copied once)."""
        if remaining not in self._allowed:
            self._allowed[remaining] = torch.tensor(
                [
                    b is not None and len(b) > 0 and (b.startswith(remaining) or remaining.startswith(b))
                    for b in self.table
                ],
                device=device,
            )
        return self._allowed[remaining].to(device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, V]
        if not any(self.remaining):
            return logits
        keep = torch.ones_like(logits, dtype=torch.bool)  # [R, V]
        for row, remaining in enumerate(self.remaining):
            if remaining:
                keep[row, : len(self.table)] = self.allowed_for(remaining, logits.device)
                keep[row, len(self.table) :] = False
        return logits.masked_fill(~keep, NEG_INF)

    def accept(self, tokens: torch.Tensor | Sequence[int]) -> None:
        for row, token in enumerate(tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens):
            piece = self.table[token] if token < len(self.table) else None
            self.remaining[row] = self.remaining[row][len(piece or b"") :]

    def select_rows(self, rows: Sequence[int]) -> None:
        self.remaining = [self.remaining[r] for r in rows]

    def is_complete(self, row: int) -> bool:
        return False  # healing never ends generation

    def completes(self, row: int, token: int) -> bool:
        return False


def heal_prompt(
    model: LanguageModel, prompt_ids: Sequence[int], num_rows: int, heal: bool | int = True
) -> tuple[HealingMask | None, list[int], Callable[[Sequence[int]], str]]:
    """(mask, shortened prompt ids, decode of generated ids to text after the original prompt).

    heal: True backs up one token, an integer k >= 1 backs up k tokens. The mask is None
    (and the prompt unchanged) when the prompt cannot be healed.
    """
    if isinstance(heal, bool):
        count = int(heal)
    elif isinstance(heal, int) and heal >= 0:
        count = heal
    else:
        raise ValueError(f"heal must be a bool or an integer >= 0 (tokens to back up), got {heal!r}")
    ids = list(prompt_ids)
    if count == 0 or count >= len(ids):
        return None, ids, model.decode
    table = token_bytes(model)
    kept, removed = ids[:-count], ids[-count:]
    pieces = [table[t] if t < len(table) else None for t in removed]
    if any(p is None or not p for p in pieces) or "\ufffd" in model.decode(removed):
        return None, ids, model.decode
    # Text after the original prompt, decoded after a few prompt tokens of context (so that a
    # tokenizer that drops a leading space, as SentencePiece does, treats both texts alike);
    # while healing is partial it is shorter than the prompt's tail, hence "".
    context = kept[-HEAL_CONTEXT:]
    tail_length = len(model.decode(context + removed))

    def decode(generated: Sequence[int]) -> str:
        return model.decode(context + list(generated))[tail_length:]

    return HealingMask(table, b"".join(pieces), num_rows), kept, decode
