"""What the lab page shows (server/lab.py serves it): each view computed by the library's own
pieces, recorded step by step as JSON.

- `sampler_view`: the next-token distribution before and after every adapter of the
  request's chain (sampling/chain.py `chain_stages`: the chain's own adapters, one by one);
- `beam_view`: every ranked candidate of `BeamSearch` per step (its `trace`), as a tree, from
  the library's own `Beam` run;
- `tree_view`: the nodes of a tree meta-generator (meta/tree.py `tree_search(trace=)`);
- `speculative_view`: the library's own speculative run (its `BlockTrace`s), each block
  shown verified by token and by block verification on the same draft and the same
  uniforms (decode/speculative.py's rules), following one of them;
- `votes_view`: N samples, their rewards and answers, and what majority vote, weighted vote
  and best-of-N pick (meta/parallel.py's aggregators over the same candidates).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from decodekit.decode.beam import Beam
from decodekit.decode.speculative import BlockTrace, speculative_generate
from decodekit.decode.verification import (
    block_acceptance,
    block_verify,
    expected_accepted,
    greedy_verify,
    token_acceptance,
    token_verify,
)
from decodekit.meta.generator import LocalGenerator, derive_seed
from decodekit.meta.parallel import candidates_of, choose_best, chosen_for, vote
from decodekit.meta.tasks.arith import check_answer, extract_answer, format_prompt, parse_question
from decodekit.meta.tree import TreeConfig, tree_search
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams
from decodekit.request import encode_prompt
from decodekit.sampling import SamplerState, select_tokens
from decodekit.sampling.chain import chain_stages

VERIFIERS = {"token": token_verify, "block": block_verify}


def token_label(model: LanguageModel, token: int) -> dict:
    """A token for display: its id and text (EOS named)."""
    text = "<eos>" if token in model.eos_token_ids else model.token_text(token)
    return {"id": token, "text": text}


def check_tokens(model: LanguageModel, name: str, tokens: Sequence[int]) -> list[int]:
    if not isinstance(tokens, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in tokens):
        raise TypeError(f"{name} must be a list of token ids, got {tokens!r:.80}")
    bad = [t for t in tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"{name} holds token ids {bad[:5]} outside the vocabulary [0, {model.vocab_size})")
    return list(tokens)


# -- sampler chain -------------------------------------------------------------------------------


def entropy_bits(probs: torch.Tensor) -> float:
    """H(p) in bits of probs [V] float64 (0 log 0 = 0)."""
    logs = torch.where(probs > 0, probs.log2(), torch.zeros_like(probs))
    return float(-(probs * logs).sum())


@torch.inference_mode()
def stage_logits(model: LanguageModel, prompt_ids: list[int], generated: list[int],
                 params: SamplingParams) -> tuple[list[tuple[str, torch.Tensor]], SamplerState]:
    """[(stage, logits [1, V])] for the position after prompt + generated: "raw", then each
    active adapter's output in chain order. The generated tokens are replayed through the
    chain first, so history-reading adapters (penalties, DRY, mirostat's μ) see them."""
    ids = prompt_ids + generated
    if len(ids) >= model.max_context:
        raise ValueError(f"generated reaches the model's context of {model.max_context} tokens")
    logits = model.forward(torch.tensor([ids]), model.new_cache(1))[0]  # [T, V]
    stages = chain_stages(params, model.tokenizer)
    state = SamplerState(params, prompt_ids, 1, model.vocab_size, model.eos_token_ids, model.tokenizer)
    for j, token in enumerate(generated):
        row = logits[len(prompt_ids) - 1 + j][None]  # [1, V]
        for _, adapter in stages:
            row = adapter(row, state)
        state.accept(torch.tensor([token]), row)
    row = logits[-1][None]
    out = [("raw", row)]
    for name, adapter in stages:
        row = adapter(row, state)
        out.append((name, row))
    return out, state


def describe_stages(model: LanguageModel, stages: list[tuple[str, torch.Tensor]], top: int) -> dict:
    """Per stage: entropy, tokens kept, mass kept; per shown token: p at every stage and the
    stage that removed it."""
    probs = [torch.softmax(x[0].double(), dim=-1) for _, x in stages]  # each [V]
    alive = [(p > 0) for p in probs]
    summary = []
    for i, ((name, _), p) in enumerate(zip(stages, probs)):
        before = probs[i - 1] if i else p
        kept = alive[i] & alive[i - 1] if i else alive[0]
        summary.append({"name": name, "entropy_bits": round(entropy_bits(p), 4),
                        "kept_tokens": int(alive[i].sum()),
                        "removed_tokens": int((alive[i - 1] & ~alive[i]).sum()) if i else 0,
                        "kept_mass": round(float(before[kept].sum()), 6)})
    final = probs[-1].topk(min(top, int(alive[-1].sum()))).indices  # kept tokens only
    shown = torch.cat([probs[0].topk(min(top, len(probs[0]))).indices, final]).tolist()
    rows = []
    for token in sorted(dict.fromkeys(shown), key=lambda t: -float(probs[0][t])):
        removed_by = next((stages[i][0] for i in range(1, len(stages))
                           if alive[i - 1][token] and not alive[i][token]), None)
        rows.append({**token_label(model, token), "probs": [round(float(p[token]), 6) for p in probs],
                     "removed_by": removed_by})
    return {"stages": summary, "tokens": rows}


def sampler_view(model: LanguageModel, prompt: str, params: SamplingParams, generated: list[int],
                 top: int, choose: str | int | None) -> dict:
    """The chain at the next position; with `choose` ("sample" or a token id) first take one
    step: the token is drawn from (or must be kept by) the chain's final distribution."""
    prompt_ids = encode_prompt(model, prompt, params.truncate_prompt_tokens)
    generated = check_tokens(model, "generated", generated)
    chosen = None
    if choose is not None:
        stages, state = stage_logits(model, prompt_ids, generated, params)
        final = stages[-1][1]  # [1, V]
        if choose == "sample":
            state.generator.manual_seed(derive_seed(state.seed, "step", len(generated)))
            token = int(select_tokens(final, state)[0])
        else:
            [token] = check_tokens(model, "choose", [choose])
            if not math.isfinite(float(final[0, token])):
                raise ValueError(f"choose: token {token} was removed by the chain; pick a kept token")
        chosen = token_label(model, token)
        generated = generated + [token]
    stages, _ = stage_logits(model, prompt_ids, generated, params)
    return {"prompt_tokens": len(prompt_ids), "generated": generated, "chosen": chosen,
            "text": model.decode(generated), **describe_stages(model, stages, top)}


# -- beam search ---------------------------------------------------------------------------------


def beam_view(model: LanguageModel, prompt: str, params: SamplingParams, num_beams: int,
              length_penalty: float, early_stopping: bool) -> dict:
    """The search tree: every ranked candidate of every step with its fate."""
    run = Beam(num_beams, length_penalty, early_stopping).prepare(model, [prompt], params)
    [search] = run.items
    search.trace = []  # recorded by the search itself, on the engine or the plain loop
    [completions] = run.completions()
    nodes = [{"id": 0, "parent": None, "step": 0, "token": None, "text": prompt, "score": 0.0,
              "total": 0.0, "fate": "live"}]
    paths: dict[int, tuple[int, ...]] = {0: ()}
    live = [0]  # node ids of the live beams after each step
    for step, candidates in enumerate(search.trace, 1):
        following = []
        for parent, token, score, total, fate in candidates:
            node = len(nodes)
            nodes.append({"id": node, "parent": live[parent], "step": step, **_token(model, token),
                          "score": round(score, 4), "total": round(total, 4), "fate": fate})
            paths[node] = paths[live[parent]] + (token,)
            if fate == "live":
                following.append(node)
        live = following
    best = tuple(completions[0].token_ids) if completions else ()
    for node in nodes:
        node["chosen"] = paths[node["id"]] == best[: len(paths[node["id"]])]
    return {"nodes": nodes, "steps": len(search.trace),
            "hypotheses": [{"text": c.text, "score": round(c.score, 4), "tokens": len(c.token_ids),
                            "finish_reason": c.finish_reason} for c in completions],
            "budget": {"num_beams": num_beams, "max_new_tokens": params.max_new_tokens,
                       "model_calls": len(search.trace), "candidates": len(nodes) - 1}}


def _token(model: LanguageModel, token: int) -> dict:
    label = token_label(model, token)
    return {"token": label["id"], "text": label["text"]}


# -- tree meta-generators ------------------------------------------------------------------------


def tree_view(model: LanguageModel, prm: Callable, question: str, method: str, n: int,
              config: TreeConfig, params: SamplingParams) -> dict:
    """The nodes a tree search made on an arith question: scores, fates, the chosen path."""
    parse_question(question)
    trace: list = []
    result = tree_search(LocalGenerator(model), format_prompt(question), prm, n, method, params, config,
                         extract=extract_answer, is_final=lambda step: step.startswith("Answer"),
                         prm_kind="steps", trace=trace)
    ids: dict[int, int] = {}
    made: list = []
    parents = {}
    for parent, child in trace:
        if id(parent) not in ids:
            ids[id(parent)] = len(made)
            made.append(parent)
        ids[id(child)] = len(made)
        made.append(child)
        parents[id(child)] = ids[id(parent)]
    expanded = {parents[id(child)] for _, child in trace}
    chosen = set()
    if result.chosen is not None:
        node = next((c for c in made if c.completion is result.chosen.completion), None)
        while node is not None:
            chosen.add(ids[id(node)])
            node = made[parents[id(node)]] if id(node) in parents else None
    nodes = []
    for i, node in enumerate(made):
        fate = node.reason or ("expanded" if i in expanded else "pruned")
        nodes.append({"id": i, "parent": parents.get(id(node)), "depth": len(node.steps),
                      "step": node.steps[-1] if node.steps else format_prompt(question).strip(),
                      "scores": [round(s, 4) for s in node.scores],
                      "value": round(node.value(config.aggregate), 4), "fate": fate,
                      "answer": extract_answer(node.steps[-1]) if node.steps else None,
                      "chosen": i in chosen})
    truth = parse_question(question).answer
    return {"nodes": nodes, "answer": result.answer, "truth": truth, "correct": result.answer == truth,
            "budget": {"n": n, "width": config.width, "max_depth": config.max_depth, **result.budget}}


# -- speculative decoding ------------------------------------------------------------------------


@torch.inference_mode()
def speculative_view(target: LanguageModel, draft: object, prompt: str, params: SamplingParams,
                     num_draft_tokens: int, follow: str) -> dict:
    """The library's own speculative run (`speculative_generate` with rule `follow`, on the
    engine where the target has one), drawn block by block from its trace: each block's
    draft, and what each rule does with it on the same uniforms (the other rule is run on a
    copy of the row's generator as it was before the block's draw; it changes nothing).
    Running totals per rule: α (the mean Σ_x min(p, q) over the positions the rule
    examined) and tokens per target call."""
    seed = params.seed if params.seed is not None else 0
    traces: list[BlockTrace] = []
    # fallback=False: a block at every step to draw (speculation_gate.py would switch it off)
    result = speculative_generate(target, draft, prompt, params.replace(seed=seed), num_draft_tokens,
                                  verify=follow, trace=traces.append, fallback=False)  # fmt: skip
    blocks = []
    totals = {rule: {"accepted": 0, "emitted": 0, "alpha_sum": 0.0, "alpha_count": 0} for rule in VERIFIERS}
    for trace in traces:
        p, q, gamma = trace.p, trace.q, len(trace.draft)
        x = torch.as_tensor(trace.draft, dtype=torch.long)
        overlap = torch.minimum(p[:gamma], q).sum(-1).tolist() if gamma else []  # α_i per position
        outcomes = {}
        for rule, verify in VERIFIERS.items():
            if params.greedy:
                tau, y = greedy_verify(trace.processed, x)
                source = "target argmax"
            else:
                if rule == follow:
                    tau, y = trace.tau, trace.y
                else:  # the same uniforms: a generator in the state the run's was before its draw
                    generator = torch.Generator()
                    generator.set_state(trace.generator_state)
                    tau, y = verify(p, q, x, generator)
                source = "target p" if tau == gamma else "residual"
            examined = min(tau + 1, gamma)
            outcomes[rule] = {"accepted": tau, "extra": token_label(target, y), "source": source,
                              "expected_accepted": round(expected_accepted(rule, p, q, x), 4)
                              if gamma and not params.greedy else None}
            total = totals[rule]
            total["accepted"] += tau
            total["emitted"] += tau + 1
            total["alpha_sum"] += sum(overlap[:examined])
            total["alpha_count"] += examined
        h_token = token_acceptance(p, q, x).tolist() if gamma else []
        h_block = block_acceptance(p, q, x)[0].tolist() if gamma else []
        blocks.append({
            "draft": [{**token_label(target, t), "q": round(float(q[i, t]), 4), "p": round(float(p[i, t]), 4),
                       "alpha": round(overlap[i], 4), "h_token": round(h_token[i], 4),
                       "h_block": round(h_block[i], 4)} for i, t in enumerate(trace.draft)],
            "token": outcomes["token"], "block": outcomes["block"],
            "running": {rule: _running(totals[rule], len(blocks) + 1) for rule in VERIFIERS}})
    [completion] = result.completions
    return {"follow": follow, "greedy": params.greedy, "num_draft_tokens": num_draft_tokens,
            "text": completion.text, "blocks": blocks,
            "totals": {rule: _running(totals[rule], len(blocks)) for rule in VERIFIERS}}


def _running(total: dict, calls: int) -> dict:
    alpha = total["alpha_sum"] / total["alpha_count"] if total["alpha_count"] else None
    return {"accepted": total["accepted"], "target_calls": calls,
            "alpha": round(alpha, 4) if alpha is not None else None,
            "tokens_per_call": round(total["emitted"] / calls, 4) if calls else None}


# -- best-of-N and voting ------------------------------------------------------------------------


def votes_view(model: LanguageModel, orm: Callable, question: str, n: int, params: SamplingParams) -> dict:
    """N solutions of an arith question, their rewards and answers, and each rule's pick."""
    prompt = format_prompt(question)
    [completions] = LocalGenerator(model).generate([prompt], n, params)
    candidates = candidates_of(completions, extract_answer)
    for candidate in candidates:
        candidate.score = float(orm(question, candidate.text))
    picks = {}
    for rule, weighted in (("majority", False), ("weighted", True)):
        answer, tallies = vote(candidates, weighted, getattr(orm, "score_kind", None))
        chosen = chosen_for(candidates, answer, weighted)
        picks[rule] = {"answer": answer, "index": candidates.index(chosen) if chosen is not None else None,
                       "tallies": [{"answer": a, "total": round(t, 4)} for a, t in tallies.items()]}
    best = choose_best(candidates)
    picks["best_of_n"] = {"answer": best.answer if best is not None else None,
                          "index": candidates.index(best) if best is not None else None}
    truth = parse_question(question).answer
    return {"prompt": prompt, "truth": truth, "picks": picks,
            "samples": [{"index": i, "text": c.text, "answer": c.answer, "reward": round(c.score, 4),
                         "correct": check_answer(question, c.text)} for i, c in enumerate(candidates)]}
