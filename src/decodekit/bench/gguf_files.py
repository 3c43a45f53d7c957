"""`decodekit bench packed --gguf FILE [--peer llamacpp]`: decodekit and llama.cpp on the same
GGUF bytes (issue 27).

Each file loads once in decodekit (`load_model(FILE)`: models/gguf_model.py, its blocks on
decodekit's kernels) and, with `peer="llamacpp"`, once in a llama.cpp worker session
(bench/llamacpp.py `PeerSession`, the same threads; q4_0 matmul weights in llama.cpp's
CPU_REPACK layout, as bench packed's own q4_0 row). Their batch-1 greedy decode and one-batch
prefill are timed by bench/packed.py's protocol, in the same interleaved rounds. Then the four
greedy prompts of bench/llamacpp.py run in both: `greedy_agreement` reports the share of
tokens each run has in common with the other before their first difference (a strict
measure: after one differing token the continuations are different texts) and whether the two
tokenisers give the same ids.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from decodekit.bench import llamacpp
from decodekit.bench.packed import PROMPT, decode_timers, median_seconds, speeds


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Tokens before the first difference over all tokens; tokens equal at the same position
    (after a difference they compare different texts); whole continuations equal."""
    common = same = 0
    for a, b in zip(ours, theirs, strict=True):
        common += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += sum(x == y for x, y in zip(a, b))
    total = sum(len(a) for a in ours)
    return {"tokens_before_first_difference": round(common / total, 3),
            "positions_equal": round(same / total, 3),
            "continuations_equal": [a == b for a, b in zip(ours, theirs, strict=True)]}  # fmt: skip


def greedy_ids(model: Any, new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts as ids, decodekit's greedy continuations) of llamacpp.GREEDY_PROMPTS."""
    import decodekit as dk

    prompts = [model.encode(text) for text in llamacpp.GREEDY_PROMPTS]
    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return prompts, [list(c[0].token_ids) for c in dk.generate(model, prompts, params)]


def peer_perplexity(session: llamacpp.PeerSession, ids: list[int], window: int, stride: int) -> float:
    """Perplexity of `ids` by a llama.cpp session over the windows decodekit's `perplexity`
    uses (compress/evaluate.py `windows`: each token scored once), so the two figures are of
    the same predictions."""
    import math

    from decodekit.compress.evaluate import windows

    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), window, stride):
        logprobs = session.ask({"do": "logprobs", "ids": ids[begin:end]})["logprobs"]
        scored = logprobs[first - begin - 1 :]  # position j's is logprobs[j - begin - 1]
        total -= sum(scored)
        count += len(scored)
    return math.exp(total / count)


def repack_for(path: Path, config: Any) -> str | None:
    """llama.cpp's CPU_REPACK pattern (bench/llamacpp.py `repack_pattern`) where every matmul
    weight it names is q4_0 in this file, else None (its q8_0 repacking crashes on x86)."""
    import re

    from decodekit.models.gguf_model import read_gguf

    pattern = llamacpp.repack_pattern(config)
    _, tensors = read_gguf(path)
    kinds = {t.tensor_type.name for name, t in tensors.items() if pattern and re.match(pattern, name)}
    return pattern if kinds == {"Q4_0"} else None


def bench_gguf(files: list[str], new_tokens: int = 32, repeats: int = 3, prefill_tokens: int = 400,
               threads: int = 1, peer: str | None = None, compile: bool = False) -> dict:  # fmt: skip
    """The report of the module docstring, as a JSON-able dict; `compile`: decodekit decodes
    with the engine's compiled step (compiled in the warm-up round), as `bench packed --compile`."""
    from decodekit.bench.decode import machine
    from decodekit.compress.evaluate import TEST_TEXT
    from decodekit.models.qlinear import kernel_counts
    from decodekit.models.registry import load_model

    if peer not in (None, "llamacpp"):
        raise ValueError(f"peer must be None or 'llamacpp', got {peer!r}")
    wall = threads > 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paths = {Path(file).name: Path(file) for file in files}
        models = {name: load_model(str(path)) for name, path in paths.items()}
        first = next(iter(models.values()))
        ids = first.encode(TEST_TEXT.read_text())[:prefill_tokens]
        timers = decode_timers(models, new_tokens, torch.tensor([ids]), compile)
        rows = [{"file": name, "bytes": paths[name].stat().st_size, "kernels": kernel_counts(m.net),
                 "dtype": str(m.dtype).removeprefix("torch.")} for name, m in models.items()]  # fmt: skip
        with ExitStack() as stack:
            found = llamacpp.find_llamacpp() if peer else None
            sessions = {}
            if found is not None:
                lengths = [len(first.encode(text)) + new_tokens for text in llamacpp.GREEDY_PROMPTS]
                context = 8 + max(len(ids), *lengths)
                for name, path in paths.items():
                    repack = repack_for(path, models[name].config)
                    session = llamacpp.PeerSession(found, path, context, threads, repack)
                    sessions[name] = stack.enter_context(session)
                run = llamacpp.PeerRun(found, paths, sessions, threads)
                timers |= llamacpp.timers(run, first.encode(PROMPT), new_tokens, ids)
            seconds = median_seconds(timers, repeats)
            measured = speeds(seconds, list(models), new_tokens, len(ids), wall)
            theirs = speeds(seconds, [f"llama.cpp {n}" for n in sessions], new_tokens, len(ids), wall)
            for row in rows:
                name, model = row["file"], models[row["file"]]
                row["decodekit"] = measured[name]
                if name in sessions:
                    row["llama.cpp"] = theirs[f"llama.cpp {name}"]
                    for key in ("decode_tok_s", "prefill_tok_s"):
                        ratio = measured[name][key] / row["llama.cpp"][key]
                        row[f"{key.split('_')[0]}_ratio"] = round(ratio, 2)
                    prompts, ours = greedy_ids(model, new_tokens)
                    session = sessions[name]
                    answer = session.ask({"do": "greedy", "prompts": prompts, "new_tokens": new_tokens})
                    tokenized = session.ask({"do": "tokenize", "texts": list(llamacpp.GREEDY_PROMPTS)})
                    row["greedy"] = {**greedy_agreement(ours, answer["greedy"]),
                                     "tokenizer_equal": tokenized["tokenized"] == prompts}  # fmt: skip
    finally:
        torch.set_num_threads(previous)
    report = {"files": rows, "new_tokens": new_tokens, "prefill_tokens": len(ids), "repeats": repeats,
              "compile": compile,
              "threads": threads, "clock": "wall" if wall else "process CPU time", "machine": machine()}
    if peer and found is None:
        report["peer"] = {peer: {"available": False, "reason": llamacpp.ABSENT}}
    return report
