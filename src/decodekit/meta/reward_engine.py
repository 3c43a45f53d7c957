"""Reward-model scoring on decodekit's engine: the body's native forward, paged KV and prefix
cache; the reward head where the LM head was.

A Llama/Qwen2 reward model is a `NativeLM` whose `net.lm_head` is the reward head
(reward_heads.py): the final norm's states go through it, so the engine's "logits" of a
position are the head's outputs there, [L] with L = 1 or 2 (`native_reward_lm`). Scoring
(prompt, segments) is then a `ScoreProgram` (engine/program.py) on the model's persistent
engine (engine/shared.py `run_requests`): one sequence of prompt + segments, one
`Feed(every=True)` over the tokens its table does not already hold, the head's outputs
read at each segment's position. So:

- a PRM's per-step scores over a whole solution come from one forward;
- a tree's siblings extend their parent's path, whose KV the prefix cache holds (full
  blocks and the closed sequence's partial last block), so scoring a node computes only
  its new step's tokens; the scores of positions the cache skipped come from `memo`
  (positions already scored: a parent's steps), and a position neither cached nor memoised
  is recomputed by cropping the table back to it;
- items that share a prefix not yet computed (best-of-N's candidates share their prompt;
  a tree's first children their question) compute it once first (`_warm`);
- all the items of a call, and concurrent calls from other threads, are programs of one
  engine step: one forward.

`tokens_computed` counts the tokens the engine computed for scoring, `tokens_scored` those
a whole-path forward per item would have computed (BENCHMARKS.md compares the two).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from decodekit.engine.program import Feed, Forward, Program, ProgramKV, StepGenerator
from decodekit.engine.shared import run_requests
from decodekit.models.base import LanguageModel
from decodekit.models.native import ARCHITECTURES, NativeLM

MEMO_SIZE = 65536  # scored positions remembered (keys: their token prefixes)
CHUNK_TOKENS = 16384  # tokens per run of programs: bounds one forward's activations

# An item: token ids, the positions whose head outputs are wanted, and where its last
# segment starts (the prefix it may share with siblings).
Item = tuple[list[int], list[int], int]


def native_reward_lm(state: dict[str, torch.Tensor], config: dict, head: nn.Module, tokenizer,
                     name: str) -> NativeLM | None:
    """The reward model as a NativeLM whose output head is `head`, or None when NativeLM
    cannot run its body (the caller falls back to transformers)."""
    causal = {family: arch for arch, family in ARCHITECTURES.items()}.get(config.get("model_type"))
    body = {**config, "architectures": [causal], "tie_word_embeddings": True}  # no LM head to read
    if causal is None or not NativeLM.supports(body):
        return None
    state = {key: t for key, t in state.items() if key.startswith("model.")}
    model = NativeLM.from_state_dict(body, state, name=name, tokenizer=tokenizer)
    model.net.lm_head = head  # [.., hidden] -> [.., L]: the engine's "logits" are the head's
    return model


class ScoreProgram(Program):
    """One item on the engine: compute the tokens its table lacks (from `recompute_from` at
    the latest), keep the head's outputs at `positions`."""

    def __init__(self, model: LanguageModel, tokens: list[int], positions: list[int]):
        self.model, self.tokens, self.positions = model, tokens, positions
        self.outputs: dict[int, torch.Tensor] = {}
        self.computed = 0

    def needs(self, block_size: int) -> list[tuple[LanguageModel, int]]:
        # its blocks, and one more: a shared partial block is copied before it is written
        return [(self.model, -(-len(self.tokens) // block_size) + 1)]

    def step(self, kv: ProgramKV) -> StepGenerator:
        seq = kv.open(self.model, self.tokens)
        if self.positions and self.positions[0] < seq.table.length:
            kv.crop(seq, self.positions[0])  # a wanted position the cache skipped
            seq.tokens += self.tokens[self.positions[0] :]
        start = seq.table.length
        self.computed = len(self.tokens) - start
        [[outputs]] = yield [Forward(self.model, [Feed(seq, every=True)])]  # [computed, L]
        self.outputs = {p: outputs[p - start] for p in self.positions}
        self.finished = True  # its sequence is closed by the engine: the KV stays cached
        return []


class EngineScorer:
    """Head outputs of items on a reward NativeLM's persistent engine (module docstring)."""

    def __init__(self, model: NativeLM):
        self.model = model
        self._memo: OrderedDict[tuple, torch.Tensor | None] = OrderedDict()  # None: computed, unscored
        self._lock = threading.Lock()
        self.tokens_computed = 0
        self.tokens_scored = 0

    def head_outputs(self, items: Sequence[Item]) -> list[torch.Tensor]:
        """Per item, its positions' head outputs [S, L]."""
        self._warm(items)
        found: dict[tuple, torch.Tensor] = {}
        programs = []
        for ids, positions, _ in items:
            missing = [p for p in positions if self._recall(ids[: p + 1], found) is None]
            if missing:
                programs.append(ScoreProgram(self.model, ids, missing))
        self._run(programs)
        for program in programs:
            for p, out in program.outputs.items():
                found[tuple(program.tokens[: p + 1])] = out
        with self._lock:
            self.tokens_scored += sum(len(ids) for ids, _, _ in items)
        return [torch.stack([self._recall(ids[: p + 1], found) for p in positions])
                if positions else torch.empty(0, 1) for ids, positions, _ in items]  # fmt: skip

    def _warm(self, items: Sequence[Item]) -> None:
        """Compute once the prefixes several items share (before their last segment) that no
        earlier call computed (module docstring)."""
        shared = Counter(tuple(ids[:cut]) for ids, _, cut in items if cut > 1)
        with self._lock:
            todo = [list(prefix) for prefix, count in shared.items()
                    if count > 1 and prefix not in self._memo]
        self._run([ScoreProgram(self.model, prefix, []) for prefix in todo])
        with self._lock:
            for prefix in todo:
                self._memo.setdefault(tuple(prefix), None)

    def _recall(self, prefix: Sequence[int], found: dict) -> torch.Tensor | None:
        key = tuple(prefix)
        if key in found:
            return found[key]
        with self._lock:
            value = self._memo.get(key)
            if value is not None:
                self._memo.move_to_end(key)
            return value

    def _run(self, programs: list[ScoreProgram]) -> None:
        """Run programs on the engine, CHUNK_TOKENS at a time; remember their scores."""
        start = 0
        while start < len(programs):
            end, tokens = start, 0
            while end < len(programs) and (end == start
                                           or tokens + len(programs[end].tokens) <= CHUNK_TOKENS):
                tokens += len(programs[end].tokens)
                end += 1
            for _ in run_requests(self.model, list(programs[start:end])):
                pass  # a ScoreProgram hands out no deltas: its outputs are its own
            start = end
        with self._lock:
            for program in programs:
                self.tokens_computed += program.computed
                for p, out in program.outputs.items():
                    self._memo[tuple(program.tokens[: p + 1])] = out
            while len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
