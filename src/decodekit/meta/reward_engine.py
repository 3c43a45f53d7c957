"""Reward-model scoring on decodekit's engine: the body's native forward, paged KV and prefix
cache; the reward head where the LM head was.

A Llama/Qwen2 reward model is a `NativeLM` whose `net.lm_head` is the reward head
(reward_heads.py): the final norm's states go through it, so the engine's "logits" of a
position are the head's outputs there, [L] with L = 1 or 2 (`native_reward_lm`). Scoring
(prompt, segments) is then a `ScoreProgram` (engine/program.py) on the model's persistent
engine (engine/engine.py `run_requests`): one sequence of prompt + segments, one
`Feed(every=True)` over the tokens its table does not already hold, the head's outputs
read at each segment's position. So:

- a PRM's per-step scores over a whole solution come from one forward;
- a tree's siblings extend their parent's path, whose KV the prefix cache holds (full
  blocks and the closed sequence's partial last block), so scoring a node computes only
  its new step's tokens; the scores of positions the cache skipped come from `memo`
  (positions already scored: a parent's steps), and a position neither cached nor memoised
  is recomputed by cropping the table back to it;
- items that share a prefix not yet computed (best-of-N's candidates share their prompt;
  a tree's first children their question) compute it once first (`_warm`), and identical
  items (siblings that wrote the same step) are computed once;
- the items of a call are one program (up to CHUNK_TOKENS), and concurrent calls from
  other threads are programs of the same engine step: one forward.

`tokens_computed` counts the tokens the engine computed for scoring, `tokens_scored` those
a whole-path forward per item would have computed (BENCHMARKS.md compares the two).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from decodekit.engine.engine import engine_for, run_requests
from decodekit.engine.program import Feed, Forward, Program, ProgramKV, StepGenerator
from decodekit.models.base import LanguageModel
from decodekit.models.families import FAMILIES
from decodekit.models.native import NativeLM

MEMO_SIZE = 65536  # scored positions remembered (keys: their token prefixes)
CHUNK_TOKENS = 16384  # tokens per run of programs: bounds one forward's activations

# An item: token ids, the positions whose head outputs are wanted, and where its last
# segment starts (the prefix it may share with siblings).
Item = tuple[list[int], list[int], int]


def native_reward_lm(state: dict[str, torch.Tensor], config: dict, head: nn.Module, tokenizer,
                     name: str) -> NativeLM | None:
    """The reward model as a NativeLM whose output head is `head`, or None when NativeLM
    cannot run its body (the caller falls back to transformers)."""
    family = FAMILIES.get(config.get("model_type"))
    causal = None if family is None else family.architecture
    body = {**config, "architectures": [causal], "tie_word_embeddings": True}  # no LM head to read
    if causal is None or not NativeLM.supports(body):
        return None
    state = {key: t for key, t in state.items() if key.startswith("model.")}
    model = NativeLM.from_state_dict(body, state, name=name, tokenizer=tokenizer)
    model.net.lm_head = head  # [.., hidden] -> [.., L]: the engine's "logits" are the head's
    return model


class ScoreProgram(Program):
    """Items on the engine, as one program: for each, compute the tokens its table lacks (from
    its first wanted position at the latest) and keep the head's outputs at its positions.
    One program for many items, not one each: the engine's per-program books cost more than
    a short item's forward."""

    def __init__(self, model: LanguageModel, items: list[tuple[list[int], list[int]]]):
        self.model, self.items = model, items  # (tokens, wanted positions) each
        self.outputs: list[dict[int, torch.Tensor]] = [{} for _ in items]
        self.computed = 0

    def needs(self, block_size: int) -> list[tuple[LanguageModel, int]]:
        # each item's blocks, and one more: a shared partial block is copied before it is written
        return [(self.model, sum(-(-len(tokens) // block_size) + 1 for tokens, _ in self.items))]

    def step(self, kv: ProgramKV) -> StepGenerator:
        seqs, starts = [], []
        for tokens, positions in self.items:
            seq = kv.open(self.model, tokens)
            if positions and positions[0] < seq.table.length:
                kv.crop(seq, positions[0])  # a wanted position the cache skipped
                seq.tokens += tokens[positions[0] :]
            seqs.append(seq)
            starts.append(seq.table.length)
            self.computed += len(tokens) - seq.table.length
        [outputs] = yield [Forward(self.model, [Feed(seq, every=True) for seq in seqs])]  # [k_i, L] each
        for i, ((_, positions), start, out) in enumerate(zip(self.items, starts, outputs)):
            self.outputs[i] = {p: out[p - start] for p in positions}
        self.finished = True  # its sequences are closed by the engine: their KV stays cached
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
        longest = max((len(ids) for ids, _, _ in items), default=0)
        if longest > self.model.max_context:
            raise ValueError(f"an item of {longest} tokens is longer than the reward model's context "
                             f"({self.model.max_context} positions)")
        self._warm(items)
        found: dict[tuple, torch.Tensor] = {}
        todo: dict[tuple, tuple[list[int], list[int]]] = {}  # identical items (siblings that
        for ids, positions, _ in items:                        # wrote the same step) run once
            missing = [p for p in positions if self._recall(ids[: p + 1], found) is None]
            if missing and tuple(ids) not in todo:
                todo[tuple(ids)] = (ids, missing)
        for program in self._run(list(todo.values())):
            for (ids, _), outputs in zip(program.items, program.outputs):
                for p, out in outputs.items():
                    found[tuple(ids[: p + 1])] = out
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
        self._run([(prefix, []) for prefix in todo])
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

    def _run(self, items: list[tuple[list[int], list[int]]]) -> list[ScoreProgram]:
        """Run items on the engine as programs of at most CHUNK_TOKENS tokens (and a quarter
        of the pool); remember their scores."""
        engine = engine_for(self.model)
        budget = min(CHUNK_TOKENS, engine.pool.num_blocks * engine.config.block_size // 4)
        programs, chunk, tokens = [], [], 0
        for tokens_i, positions in items:
            if chunk and tokens + len(tokens_i) > budget:
                programs.append(ScoreProgram(self.model, chunk))
                chunk, tokens = [], 0
            chunk.append((tokens_i, positions))
            tokens += len(tokens_i)
        if chunk:
            programs.append(ScoreProgram(self.model, chunk))
        for _ in run_requests(self.model, programs):
            pass  # a ScoreProgram hands out no deltas: its outputs are its own
        with self._lock:
            for program in programs:
                self.tokens_computed += program.computed
                for (ids, _), outputs in zip(program.items, program.outputs):
                    for p, out in outputs.items():
                        self._memo[tuple(ids[: p + 1])] = out
            while len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        return programs
