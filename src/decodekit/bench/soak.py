"""`decodekit bench soak`: the engine under random faults (issue 24).

Mixed requests run concurrently on one engine (sampling with n samples, greedy, best-of-n,
beam search, speculative decoding with a draft model and with the target's own int4 copy,
contrastive decoding, a regex-constrained request) while each engine step fails with
probability `fail_p` (seeded) in one of its forwards, the target's or a member model's
(drafts, amateur): `Faults`. A
failed step fails exactly the requests it ran (engine.py `Engine.step`); the soak checks
that every request that did not fail equals its output on a fresh engine with no faults,
token for token, that every pool ends idle with its books right (`Engine.check`), and how
the process's resident memory moves between the 100th and the last finished request.

All models run in batch-invariant mode (models/native.py), so a request's logits, and so
its sampled tokens, do not depend on what else shares its forwards: equality is exact.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass

from decodekit.decode.beam import BeamProgram, beam_searches
from decodekit.decode.constrained import Regex, mask_builder
from decodekit.decode.contrastive import ContrastiveLM
from decodekit.decode.drafters import self_draft
from decodekit.decode.speculative import speculative_programs
from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams
from decodekit.request import make_requests

KINDS = ("sample", "greedy", "best-of", "beam", "speculative", "self-int4", "contrastive", "constrained")


class InjectedFault(RuntimeError):
    """A forward failure the soak injected."""


@dataclass
class Soak:
    """The models and prompts of a soak, and each request's recipe."""

    target: LanguageModel
    draft: LanguageModel
    amateur: LanguageModel
    prompts: list[str]
    new_tokens: int

    def submit(self, engine: Engine, kind: str, prompt: int, seed: int):
        """Queue one request of `kind` on `engine`; its handle."""
        text = self.prompts[prompt]
        greedy = SamplingParams(temperature=0, max_new_tokens=self.new_tokens, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, max_new_tokens=self.new_tokens, ignore_eos=True, seed=seed)
        if kind in ("sample", "best-of", "greedy"):
            params = {"sample": sampled.replace(n=2), "best-of": sampled.replace(n=4), "greedy": greedy}[kind]
            return engine.submit(text, params)
        if kind == "constrained":
            masks = mask_builder(Regex(r"[a-z ]{1,40}"))
            [request] = make_requests(self.target, [text], sampled.replace(ignore_eos=False), masks)
            return engine.add(request)
        if kind == "beam":
            [search] = beam_searches(self.target, [text], greedy, num_beams=2)
            return engine.add(BeamProgram(self.target, search, 0))
        if kind in ("speculative", "self-int4"):
            draft = self.draft if kind == "speculative" else "self-int4"
            # The draft model speculates at every step (its blocks drafted, verified and cropped
            # each step: the engine's memory under the most churn); self-int4 takes the default
            # fallback, so rows also switch to plain decoding and back (speculation_gate.py).
            fallback = False if kind == "speculative" else None
            [program] = speculative_programs(
                self.target, draft, [text], greedy, 3, "block", False, 16, fallback
            )
            return engine.add(program)
        if kind == "contrastive":
            pair = ContrastiveLM(self.target, self.amateur, alpha=0.1)
            [request] = make_requests(pair, [text], greedy)
            _, [program] = pair.engine_programs([request])
            return engine.add(program)
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")

    def models(self) -> list[LanguageModel]:
        """Every model whose forwards the soak may fail."""
        return [self.target, self.draft, self.amateur, self_draft(self.target).model]


def tokens_of(handle) -> list[list[int]]:
    return [c.token_ids for c in handle.result(0)]


def reference(soak: Soak, kind: str, prompt: int, seed: int) -> list[list[int]]:
    """The request's output alone on a fresh engine, no faults."""
    engine = Engine(soak.target)
    handle = soak.submit(engine, kind, prompt, seed)
    while not handle.done:
        engine.step()
    return tokens_of(handle)


class Faults:
    """Hooks on the last layer of every model: once armed (`arm`, before a step), the k-th
    forward from then, of whichever model, fails after the layers before it wrote their KV;
    k in 1..3 is drawn, so the failure lands on a draft's, an amateur's or the target's
    forward. `remove` takes the hooks off."""

    def __init__(self, models: list[LanguageModel], rng: random.Random):
        self.rng, self.countdown = rng, 0
        self.hooks = [m.net.layers[-1].register_forward_pre_hook(self._hook) for m in models]

    def arm(self) -> None:
        self.countdown = self.rng.randint(1, 3)

    def _hook(self, module, args) -> None:
        if self.countdown:
            self.countdown -= 1
            if not self.countdown:
                raise InjectedFault("injected forward failure")

    def remove(self) -> None:
        self.countdown = 0
        for hook in self.hooks:
            hook.remove()


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def run_soak(
    soak: Soak,
    requests: int = 500,
    concurrency: int = 64,
    fail_p: float = 0.05,
    seed: int = 0,
    progress: bool = False,
    kv_bytes: int = 32 * 2**20,
) -> dict:
    """Run `requests` mixed requests, `concurrency` at a time, with faults; the counts."""
    rng = random.Random(seed)
    plan = [(rng.choice(KINDS), rng.randrange(len(soak.prompts)), rng.randrange(4)) for _ in range(requests)]
    references = {key: reference(soak, *key) for key in sorted(set(plan))}
    # A KV bound the prefix cache fills within the first requests, so that resident memory
    # measures leaks, not a cache growing towards a generous bound (engine/block_pool.py grows the
    # pool's storage by doubling as blocks are first used).
    engine = Engine(soak.target, EngineConfig(max_kv_bytes=kv_bytes))
    faults, fault_rng = Faults(soak.models(), random.Random(seed + 1)), random.Random(seed + 2)
    queued, running = list(plan), []
    finished = failed = mismatched = step_failures = 0
    rss_at_100 = rss_at_half = None
    start = time.perf_counter()
    try:
        while queued or running:
            while queued and len(running) < concurrency:
                key = queued.pop(0)
                running.append((key, soak.submit(engine, *key)))
            if fault_rng.random() < fail_p:
                faults.arm()
            try:
                engine.step()
            except InjectedFault:
                step_failures += 1
            faults.countdown = 0  # an armed fault that did not fire dies with its step
            for item in [r for r in running if r[1].done]:
                running.remove(item)
                key, handle = item
                try:
                    got = tokens_of(handle)
                except InjectedFault:
                    failed += 1
                else:
                    mismatched += got != references[key]
                finished += 1
                if finished == min(100, requests):
                    rss_at_100 = rss_bytes()
                if finished == requests // 2:
                    rss_at_half = rss_bytes()
                if progress and finished % 50 == 0:
                    line = f"soak: {finished}/{requests} requests, {failed} failed"
                    print(line, file=sys.stderr, flush=True)
    finally:
        faults.remove()
    engine.check()
    pools = [m.pool for m in engine.members]
    rss_end = rss_bytes()
    return {
        "requests": requests,
        "concurrency": concurrency,
        "fail_p": fail_p,
        "seed": seed,
        "kinds": list(KINDS),
        "failed_steps": step_failures,
        "failed_requests": failed,
        "completed_requests": requests - failed,
        "mismatched_requests": mismatched,
        "idle": all(p.num_used == 0 and p.held == 0 for p in pools) and len(engine.running_kv) == 0,
        "members": len(engine.members),
        "kv_bytes": kv_bytes,
        "peak_used_blocks": engine.stats()["peak_used_blocks"],
        "rss_mb_at_100": round((rss_at_100 or 0) / 2**20, 1),
        "rss_mb_at_half": round((rss_at_half or 0) / 2**20, 1),
        "rss_mb_at_end": round(rss_end / 2**20, 1),
        "rss_growth": round(rss_end / rss_at_100 - 1, 4) if rss_at_100 else None,
        "seconds": round(time.perf_counter() - start, 1),
    }


def bench_soak(model: str, draft: str, requests: int, concurrency: int, fail_p: float, seed: int,
               new_tokens: int, progress: bool = False) -> dict:  # fmt: skip
    """The soak on embedded or local models (loaded batch-invariant)."""
    from decodekit.models.registry import load_model

    models = [load_model(name, backend="native") for name in (model, draft)]
    for m in models:
        m.batch_invariant = True
    # Each prompt spans full KV blocks (16 tokens), so that a failed step that registered
    # what it never wrote would be found by the next request with that prompt.
    prompts = [
        "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and",
        "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse",
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.",
        "KING HENRY V:\nOnce more unto the breach, dear friends, once more; or close",
        "HAMLET:\nTo be, or not to be, that is the question: whether 'tis nobler in",
        "MACBETH:\nIs this a dagger which I see before me, the handle toward my hand?",
    ]
    soak = Soak(models[0], models[1], models[1], prompts, new_tokens)
    return {"model": model, "draft": draft, "new_tokens": new_tokens,
            **run_soak(soak, requests, concurrency, fail_p, seed, progress)}  # fmt: skip
