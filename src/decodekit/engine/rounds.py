"""The programs' part of a step (program.py): their rounds on other models, then their end.

Every running program starts its step; the forwards they ask of other models (drafts,
amateurs) run batched, one forward per model per round, until each waits on the engine's
model or has ended its step (`run_rounds`). Their feeds then join the step's one forward
(engine.py), and `resume` sends each its logits, which ends its step.

`end(entry, deltas, error=None)` is the engine's: it takes an entry out (engine.py `_end`).
A program that raises ends with its error; the engine and the other programs go on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decodekit.engine.batch import build_batch, paged_forward
from decodekit.engine.entry import ProgramEntry
from decodekit.engine.handle import wake
from decodekit.engine.members import Members, ModelKV
from decodekit.engine.program import Feed
from decodekit.engine.rows import GatheredRows
from decodekit.engine.scheduler import Work
from decodekit.models.base import LanguageModel

End = Callable[..., None]


def run_rounds(
    programs: list[ProgramEntry], model: LanguageModel, members: Members, end: End
) -> list[ProgramEntry]:
    """Start every program's step and run the forwards they need on models other than the
    engine's `model`, batched per model, until each waits on `model` or has ended its step.
    Returns those that wait."""
    active = []
    for entry in programs:
        entry.generator = entry.program.step(entry.kv)
        if _advance(entry, None, end):
            active.append(entry)
    while True:
        todo: dict[int, list] = {}  # per model: (entry, index, Forward)
        for entry in active:
            for i, fw in enumerate(entry.forwards):
                if fw.model is not model and not entry.results[i]:
                    todo.setdefault(id(fw.model), []).append((entry, i, fw))
        if not todo:
            return active
        for jobs in todo.values():
            feeds = [feed for _, _, fw in jobs for feed in fw.feeds]
            outputs = iter(member_forward(members.of(jobs[0][2].model), feeds))
            for entry, i, fw in jobs:
                entry.results[i] = [next(outputs) for _ in fw.feeds]
        waiting = []
        for entry in active:
            if any(fw.model is model for fw in entry.forwards):
                waiting.append(entry)  # its member forwards are done; it waits for ours
            elif _advance(entry, entry.results, end):
                waiting.append(entry)
        active = waiting


def resume(entry: ProgramEntry, end: End) -> None:
    """After the step's forward: the program ends its step with the logits it waited for."""
    if _advance(entry, entry.results, end):
        end(entry, [], RuntimeError("a program's step must end after its forward on the engine's model"))


def member_forward(model_kv: ModelKV, feeds: list[Feed]) -> list[torch.Tensor]:
    """One forward of another model over programs' feeds (their blocks, no lanes): through
    its compiled decode step when each feeds one token and its bucket is ready (members.py),
    over rows gathered from its pool, else eager."""
    manager = model_kv.manager
    works = [Work(f.seq, f.seq.pending, manager.reserve(f.seq.table, f.seq.pending), f.every) for f in feeds]
    model = model_kv.model

    def eager() -> tuple:
        items = [(w.seq.table, w.seq.tokens, w.slots) for w in works]
        batch = build_batch(model_kv.pool, items, None, model.config.layer_windows, [w.every for w in works])
        return paged_forward(model, *batch, model.batch_invariant), None

    if model_kv.compiled is not None and all(w.count == 1 and not w.every for w in works):
        tables = [w.seq.table for w in works]
        rows = GatheredRows(model_kv.pool, [t.blocks for t in tables], [t.length for t in tables])
        logits, _ = model_kv.compiled.forward(works, rows, model_kv.pool, eager)
    else:
        logits, _ = eager()
    for w in works:
        manager.register(w.seq.table, w.seq.tokens, w.seq.table.length)
    return split(logits, works)


def split(logits: torch.Tensor, works: list[Work]) -> list[torch.Tensor]:
    """The kept logits [K, V] of a forward, per work: [count, V] if `every`, else [1, V]."""
    return list(logits.split([w.count if w.every else 1 for w in works]))


def _advance(entry: ProgramEntry, results, end: End) -> bool:
    """Send a program its forwards' logits; True if it asks for more in this step."""
    try:
        forwards = entry.generator.send(results)
    except StopIteration as stop:
        deltas = stop.value or []
        if entry.program.finished:
            end(entry, deltas)
        else:
            wake(entry.handle._push(deltas))
        return False
    except Exception as error:  # noqa: BLE001 -- ends this program, not the engine
        end(entry, [], error)
        return False
    for fw in forwards:
        for feed in fw.feeds:
            if feed.seq.pending < 1:
                end(entry, [], ValueError("a feed must have a token to compute"))
                return False
    entry.forwards = forwards
    entry.results = [[] for _ in forwards]
    return True
