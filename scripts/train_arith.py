"""Train the embedded arithmetic models: `arith` (a tiny Llama) and its reward models.

    python scripts/train_arith.py --out runs/arith [--max-minutes 12] [--install]
    python scripts/train_arith.py --out /tmp/x --tiny          # smoke run, a few seconds
    python scripts/train_arith.py --out runs/arith-small --run small [--install]  # issue 17

Stages (each resumes from what `--out` already holds):
1. `arith`: a character-level tokenizer and a Llama trained on generated problems and their
   step-by-step solutions (meta/tasks/arith.py) with `train_causal_lm` (scripts/train_lm.py);
   deliberately small and short-trained so that one sample at temperature 1 is right only
   some of the time, leaving room for voting, best-of-N and tree search (issue 3, item 5).
2. Samples of `arith` at temperature 1 on fresh problems, labelled by the exact checkers:
   outcome labels (answer right) and process labels (every step so far right).
3. Two learned reward models on those samples (meta/rewards.py): an ORM scoring the whole
   solution and a PRM scoring each step, each a logistic probe over `arith`'s own token
   log-probabilities and entropies (a token-classification head fine-tuned from `arith`
   learned problem difficulty instead: see MODELS.md).
4. Evaluation on held-out problems: accuracy at temperature 1 and greedy, ORM/PRM AUC, and
   what voting and best-of-4 reranking buy; written to `--out/metrics.json`.
`--install` copies the three models into src/decodekit/models/assets/ (`arith`, `arith-orm`,
`arith-prm`; for `--run small` / `large`: `arith-small`, `arith-small-orm`, ...).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from decodekit import runtime
from decodekit.meta.rewards import (
    FEATURES,
    PROBE_FILE,
    ProbeRewardModel,
    fit_logistic,
    segment_features,
)
from decodekit.meta.tasks.arith import (
    DELIMITER,
    ArithConfig,
    check_answer,
    check_steps,
    format_prompt,
    format_solution,
    generate_problems,
    split_steps,
)
from train_lm import (
    ASSETS,
    EOS,
    LMConfig,
    build_model,
    encode_documents,
    train_causal_lm,
)

# The conversation's text as it is: arith continues its own format ("Compute: 17+4*3-8=\n"), which
# a chat client sends as the user's message; a role-tagged template would write characters that
# its vocabulary lacks ("USER:").
CHAT_TEMPLATE = "{%- for message in messages %}{{ message['content'] }}{%- endfor %}"
CHARS = "0123456789+-*=: \nACPabcdeimnoprstuw"  # digits, operators, "Compute: ", "Answer: "
TASK = ArithConfig(min_ops=2, max_ops=4, max_operand=20)
SEEDS = {"train": 1, "val": 2, "reward_train": 3, "test": 4}  # disjoint problem streams


@dataclass(frozen=True)
class RunConfig:
    lm: LMConfig
    lm_steps: int
    train_problems: int
    rm_problems: int  # problems sampled (4 samples each) to train the reward models
    test_problems: int  # held-out problems (4 samples each, and greedy)
    max_new_tokens: int = 96  # longer than any reference solution (4 steps + answer)


RUNS = {
    # windows of the whole declared context (256), 8 x 256 tokens a step: the same tokens per
    # step as the first model's 32 x 64 windows, which never saw a position past 63 although
    # prompt and solution reach 92 characters (issue 13)
    "full": RunConfig(LMConfig(96, 3, 4, 2, 256, 256, 256, 8, 3e-3, 100), 2500, 200_000, 3000,
                      500, 96),
    # issue 17, item 2 (compute-optimal inference, Wu et al. 2024): the same data, steps and
    # tokens per step (8 x 256) as "full", at about 1/4 and 4x its parameters (width only)
    "small": RunConfig(LMConfig(48, 3, 4, 2, 128, 256, 256, 8, 3e-3, 100), 2500, 200_000, 3000,
                       500, 96),
    "large": RunConfig(LMConfig(192, 3, 4, 2, 512, 256, 256, 8, 3e-3, 100), 2500, 200_000, 3000,
                       500, 96),
    "tiny": RunConfig(LMConfig(32, 1, 2, 1, 64, 256, 64, 4, 1e-3, 1), 3, 200, 4, 4, 16),
}


def build_tokenizer(out_dir: Path):
    """One token per character, EOS as the only special token; AutoTokenizer loads it.

    Its tokens are spelled byte-level (GPT-2's byte-to-unicode map: " " is "Ġ", "\\n" is "Ċ")
    with a ByteLevel decoder, because llguidance (constrained decoding) reads only byte-level
    and byte-fallback tokenizers; a character-level vocabulary with a Fuse decoder encodes
    and decodes the same text to the same ids, but llguidance refuses it ("can't determine
    decoder type")."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    spelled = {c: byte_level.pre_tokenize_str(c)[0][0] for c in CHARS}
    vocab = {EOS: 0, "<unk>": 1} | {spelled[c]: i + 2 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, unk_token="<unk>", model_max_length=256,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def documents(problems) -> str:
    """Prompt and reference solution of each problem, separated by EOS (encode_documents)."""
    return "".join(format_prompt(p) + format_solution(p) + EOS for p in problems)


def train_lm_stage(run: RunConfig, out: Path, max_minutes: float | None, seed: int,
                   device: str = "cpu"):
    tokenizer = build_tokenizer(out / "tokenizer")
    problems = generate_problems(run.train_problems, SEEDS["train"], TASK)
    val = generate_problems(max(run.train_problems // 50, 20), SEEDS["val"], TASK)
    train_ids = encode_documents(tokenizer, documents(problems))
    val_ids = encode_documents(tokenizer, documents(val))
    model = build_model(run.lm, tokenizer)
    print(f"arith: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(train_ids):,} training tokens", flush=True)
    result = train_causal_lm(
        model, train_ids, val_ids, out_dir=str(out / "lm"), seq_len=run.lm.seq_len,
        batch_size=run.lm.batch_size, steps=run.lm_steps, lr=run.lm.lr, seed=seed,
        warmup=min(run.lm.warmup, max(1, run.lm_steps // 10)), eval_every=min(200, run.lm_steps),
        log_every=1 if run.lm_steps < 10 else 50, max_minutes=max_minutes, device=device,
    )
    from transformers import GenerationConfig

    final = out / "lm" / "final"
    tokenizer.save_pretrained(final)
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(final)
    return result


@torch.inference_mode()
def sample_solutions(model, tokenizer, problems, n: int, *, greedy: bool, seed: int,
                     max_new_tokens: int, batch_size: int = 256) -> list[list[str]]:
    """n completions per problem with transformers `generate` (pure temperature-1 sampling);
    a bar over the batches when stderr is a terminal."""
    tokenizer.padding_side = "left"
    prompts = [format_prompt(p) for p in problems for _ in range(n)]
    texts: list[str] = []
    torch.manual_seed(seed)
    for b in runtime.progress(range(0, len(prompts), batch_size), desc="sample"):
        batch = tokenizer(prompts[b : b + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0,
                                                         "top_k": 0, "top_p": 1.0}
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling,
                             pad_token_id=tokenizer.eos_token_id)
        new = out[:, batch["input_ids"].shape[1] :]
        texts += tokenizer.batch_decode(new, skip_special_tokens=True)
    return [texts[i * n : (i + 1) * n] for i in range(len(problems))]


def reward_items(problems, samples, kind: str):
    """(prompt, segments) per sample and its labels: one outcome label, or one per step."""
    items, labels = [], []
    for problem, solutions in zip(problems, samples):
        for solution in solutions:
            steps = split_steps(solution)
            if kind == "orm":
                items.append((format_prompt(problem), [solution.strip() + DELIMITER]))
                labels.append([check_answer(problem, solution)])
            elif steps:
                items.append((format_prompt(problem), [t + DELIMITER for t in steps]))
                labels.append(check_steps(problem, steps))
    return items, labels


def train_reward_model(lm, tokenizer, problems, samples, kind: str) -> ProbeRewardModel:
    """Fit the logistic probe on the policy's features of its own labelled samples."""
    items, labels = reward_items(problems, samples, kind)
    features = np.concatenate(segment_features(lm, tokenizer, items))  # [N, 6]
    targets = np.asarray([y for ys in labels for y in ys], dtype=np.float64)  # [N]
    probe = fit_logistic(features, targets)
    print(f"{kind}: {len(items)} samples, {len(targets)} labels ({targets.mean():.1%} positive), "
          f"weights {np.round(probe['weights'], 2).tolist()}", flush=True)
    return ProbeRewardModel(lm, tokenizer, probe, name=kind)


def auc(scores: list[float], labels: list[bool]) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties half."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    ranked = sorted([(s, 1) for s in pos] + [(s, 0) for s in neg])
    total, rank, i = 0.0, 1, 0
    while i < len(ranked):  # average ranks over ties (Mann-Whitney U)
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        total += sum(y for _, y in ranked[i:j]) * (rank + (j - i - 1) / 2)
        rank, i = rank + (j - i), j
    return (total - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def within_problem_auc(scores: list[list[float]], labels: list[list[bool]]) -> float:
    """AUC over (right, wrong) pairs of samples of the same problem: what reranking needs."""
    wins = pairs = 0.0
    for ss, ys in zip(scores, labels):
        for s_pos, y_pos in zip(ss, ys):
            for s_neg, y_neg in zip(ss, ys):
                if y_pos and not y_neg:
                    wins += 1.0 if s_pos > s_neg else 0.5 if s_pos == s_neg else 0.0
                    pairs += 1
    return wins / pairs if pairs else float("nan")


def evaluate(problems, samples, greedy, orm: ProbeRewardModel, prm: ProbeRewardModel) -> dict:
    """Accuracy, reward-model AUC and what voting / reranking the samples buy."""
    from collections import Counter

    from decodekit.meta.tasks.arith import extract_answer

    k = len(samples[0])
    correct = [[check_answer(p, s) for s in ss] for p, ss in zip(problems, samples)]
    outcomes = [c for cs in correct for c in cs]
    orm_items, _ = reward_items(problems, samples, "orm")
    orm_flat = [orm.probabilities(f)[0] for f in segment_features(orm.policy, orm.tokenizer,
                                                                   orm_items)]
    orm_scores = [orm_flat[i * k : (i + 1) * k] for i in range(len(problems))]
    # the PRM scores every step; a solution's score is its lowest step score (Lightman et al.)
    prm_items = [(format_prompt(p), [t + DELIMITER for t in split_steps(s) or ["?"]])
                 for p, ss in zip(problems, samples) for s in ss]
    prm_probs = [prm.probabilities(f) for f in segment_features(prm.policy, prm.tokenizer,
                                                                prm_items)]
    prm_labels = [check_steps(p, split_steps(s) or ["?"]) for p, ss in zip(problems, samples)
                  for s in ss]
    prm_min = [[float(prm_probs[i * k + j].min()) for j in range(k)] for i in range(len(problems))]
    vote = bon_orm = bon_prm = 0
    for p, ss, cs, o, m in zip(problems, samples, correct, orm_scores, prm_min):
        top = Counter(a for a in map(extract_answer, ss) if a is not None).most_common(1)
        vote += bool(top) and top[0][0] == p.answer
        bon_orm += cs[max(range(k), key=o.__getitem__)]
        bon_prm += cs[max(range(k), key=m.__getitem__)]
    n = len(problems)
    step_scores = [x for probs in prm_probs for x in probs.tolist()]
    step_labels = [y for ys in prm_labels for y in ys]
    return {
        "test_problems": n, "samples_per_problem": k,
        "accuracy_t1": sum(outcomes) / len(outcomes),
        "accuracy_greedy": sum(check_answer(p, g[0]) for p, g in zip(problems, greedy)) / n,
        f"pass_at_{k}": sum(any(c) for c in correct) / n, f"majority_vote_at_{k}": vote / n,
        f"orm_best_of_{k}": bon_orm / n, f"prm_min_best_of_{k}": bon_prm / n,
        "orm_auc": auc(orm_flat, outcomes),
        "orm_within_problem_auc": within_problem_auc(orm_scores, correct),
        "prm_step_auc": auc(step_scores, step_labels),
        "prm_min_outcome_auc": auc([x for xs in prm_min for x in xs], outcomes),
        "prm_min_within_problem_auc": within_problem_auc(prm_min, correct),
        "prm_step_positive_rate": sum(step_labels) / len(step_labels),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="smoke run: tiny models and data")
    parser.add_argument("--run", choices=sorted(RUNS), default=None,
                        help="which size to train (default full; --tiny is --run tiny)")
    parser.add_argument("--max-minutes", type=float, default=None, help="LM training budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--install", action="store_true", help="copy models into the package")
    parser.add_argument("--device", default="cpu", help="where the LM trains: cpu or cuda")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)  # the one place threading is set (STYLE.md 9)
    run_name = args.run or ("tiny" if args.tiny else "full")
    run, out = RUNS[run_name], Path(args.out)
    start = time.perf_counter()
    lm_dir = out / "lm" / "final"
    if not (lm_dir / "model.safetensors").exists():
        train_lm_stage(run, out, args.max_minutes, args.seed, args.device)
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()

    rm_problems = generate_problems(run.rm_problems, SEEDS["reward_train"], TASK)
    test = held_out(run, TASK)
    samples_path = out / "samples.json"

    def sample(problems, n, **kwargs):
        return sample_solutions(lm, tokenizer, problems, n, max_new_tokens=run.max_new_tokens,
                                **kwargs)

    if samples_path.exists():
        saved = json.loads(samples_path.read_text())
    else:
        saved = {
            "reward_train": sample(rm_problems, 4, greedy=False, seed=args.seed),
            "test": sample(test, 4, greedy=False, seed=args.seed + 1),
            "greedy": sample(test, 1, greedy=True, seed=0),
        }
        samples_path.write_text(json.dumps(saved))

    scorers = {}
    for kind in ("orm", "prm"):
        rm_dir = out / kind
        if not (rm_dir / PROBE_FILE).exists():
            model = train_reward_model(lm, tokenizer, rm_problems, saved["reward_train"], kind)
            model.save(rm_dir, policy_dir=lm_dir)
        scorers[kind] = ProbeRewardModel.from_pretrained(rm_dir)

    metrics = evaluate(test, saved["test"], saved["greedy"], scorers["orm"], scorers["prm"])
    metrics["task"] = asdict(TASK)
    metrics["parameters"] = {"arith": sum(p.numel() for p in lm.parameters()),
                             "probe": len(FEATURES) + 1}
    metrics["minutes"] = (time.perf_counter() - start) / 60
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics, indent=1), flush=True)
    if args.install:
        install(lm_dir, scorers, ASSETS, "arith" if run_name == "full" else f"arith-{run_name}")
    return metrics


def install(lm_dir: Path, scorers: dict, where: Path, name: str) -> None:
    """Copy the policy to where/name and its probes to where/name-orm, -prm: the pairing
    `decodekit eval arith --model NAME` expects (meta/compute_optimal.py, reward_names)."""
    shutil.copytree(lm_dir, where / name, dirs_exist_ok=True)
    for kind in ("orm", "prm"):  # the probes reference the installed policy, ../NAME
        scorers[kind].save(where / f"{name}-{kind}", policy_dir=where / name)
    print(f"installed {name}, {name}-orm, {name}-prm into {where}", flush=True)


def held_out(run: RunConfig, config: ArithConfig):
    """Test problems none of which appears among the training problems' questions."""
    train = {p.question for p in generate_problems(run.train_problems, SEEDS["train"], config)}
    pool = generate_problems(4 * run.test_problems + 100, SEEDS["test"], config)
    return [p for p in pool if p.question not in train][: run.test_problems]


if __name__ == "__main__":
    main()
