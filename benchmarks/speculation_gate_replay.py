"""The speculation gate (decode/speculation_gate.py) replayed on a real pair's acceptance and on
independent acceptances, against always and never speculating: how much of the better of the
two its choices keep, with the current parameters and with the former ones (decay 0.5, a prior
of one rejected position, no margin).

    python benchmarks/speculation_gate_replay.py [--target shakespeare-large] [--prompts 8]

Acceptance: the target's greedy continuation of each held-out prompt, and the draft's greedy
prediction of every token of it with the target's tokens as context (one forward). While the
draft agrees, its context is the target's, so a block of γ drafted at position p accepts the
run of agreeing positions from p, up to γ. The replay steps through each continuation: a
drafting step emits τ + 1 tokens for c plain steps, a plain step one token for one, each time
times a uniform noise of 1-1.15 (the gate reads noisy clocks). Independent acceptances: each
draft token accepted with probability α. The figure per (c, α) is the gate's tokens per unit of
cost over the better of always speculating and plain decoding, in the same noise. No timing
of the machine: the same numbers on any CPU. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
from contextlib import nullcontext
from unittest import mock

import torch

import decodekit as dk
from decodekit.bench.speculative import bench_params, heldout_prompts
from decodekit.decode import speculation_gate as gate_module

FORMER = {"DECAY": 0.5, "PRIOR": (0.0, 1.0), "CONFIDENCE": 0.0}
NOISE = (1.0, 1.15)


def agreement(target_name: str, draft_name: str, prompts: int, tokens: int) -> list[list[bool]]:
    """Per held-out prompt, whether the draft's greedy prediction of each continuation token
    equals the target's (module docstring)."""
    target, draft = dk.load_model(target_name), dk.load_model(draft_name)
    out = []
    for prompt in heldout_prompts(target, prompts):
        ids = target.encode(prompt)
        [completion] = dk.generate(target, prompt, bench_params(tokens, 0.0))
        continuation = list(completion.token_ids)
        with torch.inference_mode():
            sequence = torch.tensor([ids + continuation], device=draft.device)
            logits = draft.forward(sequence, draft.new_cache(1))[0]
        predicted = logits.argmax(-1).tolist()
        out.append([predicted[len(ids) - 1 + j] == token for j, token in enumerate(continuation)])
    return out


def replay(accepts, c: float, gamma: int, tokens: int, gated: bool, rng: random.Random) -> tuple:
    """(tokens, cost) of one continuation; accepts(position, n) -> τ."""
    gate, costs = gate_module.SpeculationGate(), gate_module.StepCosts()
    emitted = cost = 0.0
    step = 0
    while emitted < tokens:
        step += 1
        n = gate.draft_tokens(gamma, costs, step) if gated else gamma
        tau = accepts(int(emitted), n) if n else 0
        seconds = (c if n else 1.0) * rng.uniform(*NOISE)
        emitted += tau + 1
        cost += seconds
        if gated:
            if step > 1:  # the first step's seconds include the prompt's
                costs.record(seconds, n)
            gate.settle(n, tau, gamma, costs, step)
    return emitted, cost


def kept(make_accepts, sources: int, c: float, gamma: int, tokens: int, repeats: int, params: dict) -> float:
    """The gate's tokens per cost over the better of always and never speculating."""
    with mock.patch.multiple(gate_module, **params) if params else nullcontext():  # the former ones, or none
        rng = random.Random(0)
        totals = {True: [0.0, 0.0], False: [0.0, 0.0]}
        for source in range(sources):
            for _ in range(repeats):
                for gated in (True, False):
                    emitted, cost = replay(make_accepts(source, rng), c, gamma, tokens, gated, rng)
                    totals[gated][0] += emitted
                    totals[gated][1] += cost
        plain = 1.0 / (sum(NOISE) / 2)
        always = totals[False][0] / totals[False][1]
        return round(totals[True][0] / totals[True][1] / max(always, plain), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="shakespeare-large")
    parser.add_argument("--draft", default="shakespeare-large-draft")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    agree = agreement(args.target, args.draft, args.prompts, args.tokens + 2 * args.gamma)

    def from_pair(source, rng):
        row = agree[source]

        def accepts(position, n):
            tau = 0
            while tau < n and position + tau < len(row) and row[position + tau]:
                tau += 1
            return tau

        return accepts

    def independent(alpha):
        def make(source, rng):
            def accepts(position, n):
                tau = 0
                while tau < n and rng.random() < alpha:
                    tau += 1
                return tau

            return accepts

        return make

    after = sum(len(a) - 8 for a in agree)
    result: dict = {
        "pair": f"{args.target} / {args.draft}",
        "gamma": args.gamma,
        "tokens": args.tokens,
        "agreement_first_8": round(sum(sum(a[:8]) for a in agree) / (8 * len(agree)), 3),
        "agreement_after": round(sum(sum(a[8:]) for a in agree) / after, 3),
    }
    for label, params in (("current", {}), ("former", FORMER)):
        result[label] = {
            "pair": {f"c={c}": kept(from_pair, len(agree), c, args.gamma, args.tokens, args.repeats, params)
                     for c in (1.3, 1.6, 2.0, 2.6, 3.2)},
            "independent": {f"c={c},alpha={a}": kept(independent(a), 1, c, args.gamma, args.tokens,
                                                     args.repeats * 5, params)
                            for c in (1.3, 1.6, 2.2) for a in (0.3, 0.5, 0.65, 0.78, 0.9)},
        }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
