"""Train the embedded arithmetic models: `arith` (a tiny Llama) and its reward models.

    python scripts/train_arith.py --out runs/arith [--max-minutes 12] [--install]
    python scripts/train_arith.py --out /tmp/x --tiny          # smoke run, a few seconds

Stages (each resumes from what `--out` already holds):
1. `arith`: a character-level tokenizer and a Llama trained on generated problems and their
   step-by-step solutions (meta/tasks/arith.py) with `train_causal_lm` (scripts/train_lm.py);
   deliberately small and short-trained so that one sample at temperature 1 is right only
   some of the time, leaving room for voting, best-of-N and tree search (issue 3, item 5).
2. Samples of `arith` at temperature 1 on fresh problems, labelled by the exact checkers:
   outcome labels (answer right) and process labels (every step so far right).
3. Two learned reward models on those samples (meta/rewards.py): an ORM scoring the whole
   solution and a PRM scoring each step, each a tiny Llama with a one-logit head.
4. Evaluation on held-out problems: accuracy at temperature 1 and greedy, ORM/PRM AUC, and
   what voting and best-of-4 reranking buy; written to `--out/metrics.json`.
`--install` copies the three models into src/decodekit/models/assets/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from decodekit.meta.rewards import SegmentScorer
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
    learning_rate,
    make_optimizer,
    train_causal_lm,
)

CHARS = "0123456789+-*=: \nACPabcdeimnoprstuw"  # digits, operators, "Compute: ", "Answer: "
TASK = ArithConfig(min_ops=2, max_ops=4, max_operand=9)
SEEDS = {"train": 1, "val": 2, "reward_train": 3, "test": 4}  # disjoint problem streams


@dataclass(frozen=True)
class RunConfig:
    lm: LMConfig
    lm_steps: int
    train_problems: int
    rm_hidden: int
    rm_layers: int
    rm_steps: int
    rm_problems: int  # problems sampled (4 samples each) to train the reward models
    test_problems: int  # held-out problems (4 samples each, and greedy)
    max_new_tokens: int = 96  # longer than any reference solution (4 steps + answer)


RUNS = {
    "full": RunConfig(LMConfig(96, 3, 4, 2, 256, 256, 64, 32, 3e-3, 100), 2500, 200_000,
                      64, 2, 1500, 3000, 500, 96),
    "tiny": RunConfig(LMConfig(32, 1, 2, 1, 64, 256, 64, 4, 1e-3, 1), 3, 200, 16, 1, 3, 4, 4, 16),
}


def build_tokenizer(out_dir: Path):
    """One token per character, EOS as the only special token; AutoTokenizer loads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, "<unk>": 1} | {c: i + 2 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, unk_token="<unk>", model_max_length=256,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out_dir)
    return fast


def documents(problems) -> str:
    """Prompt and reference solution of each problem, separated by EOS (encode_documents)."""
    return "".join(format_prompt(p) + format_solution(p) + EOS for p in problems)


def train_lm_stage(run: RunConfig, out: Path, max_minutes: float | None, seed: int):
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
        log_every=1 if run.lm_steps < 10 else 50, max_minutes=max_minutes,
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
    """n completions per problem with transformers `generate` (pure temperature-1 sampling)."""
    tokenizer.padding_side = "left"
    prompts = [format_prompt(p) for p in problems for _ in range(n)]
    texts: list[str] = []
    torch.manual_seed(seed)
    for b in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[b : b + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0,
                                                         "top_k": 0, "top_p": 1.0}
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling,
                             pad_token_id=tokenizer.eos_token_id)
        new = out[:, batch["input_ids"].shape[1] :]
        texts += tokenizer.batch_decode(new, skip_special_tokens=True)
    return [texts[i * n : (i + 1) * n] for i in range(len(problems))]


def reward_examples(scorer_tokenizer, problems, samples, kind: str) -> list[tuple]:
    """(ids, positions, labels) per sample: one outcome label, or one label per step."""
    scorer = SegmentScorer(torch.nn.Identity(), scorer_tokenizer)
    examples = []
    for problem, solutions in zip(problems, samples):
        for solution in solutions:
            if kind == "orm":
                segments = [solution.strip() + DELIMITER]
                labels = [check_answer(problem, solution)]
            else:
                steps = split_steps(solution)
                if not steps:
                    continue
                segments, labels = [s + DELIMITER for s in steps], check_steps(problem, steps)
            ids, ends = scorer.encode(format_prompt(problem), segments)
            examples.append((ids, ends, [float(x) for x in labels]))
    return examples


def build_reward_model(run: RunConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForTokenClassification

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=run.rm_hidden, num_hidden_layers=run.rm_layers,
        num_attention_heads=4 if run.rm_hidden >= 64 else 2, num_key_value_heads=2 if
        run.rm_hidden >= 64 else 1, intermediate_size=run.rm_hidden * 8 // 3,
        max_position_embeddings=256, tie_word_embeddings=False, num_labels=1,
        classifier_dropout=0.0, pad_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return LlamaForTokenClassification(config)


def pad_batch(examples, pad_id: int):
    """ids [B, T] right-padded, attention mask [B, T], targets [B, T] (nan where unlabelled)."""
    width = max(len(ids) for ids, _, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    targets = torch.full((len(examples), width), float("nan"))
    for row, (seq, ends, labels) in enumerate(examples):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        targets[row, ends] = torch.tensor(labels)
    return ids, mask, targets


def train_reward_model(model, examples, *, steps: int, batch_size: int, lr: float, seed: int,
                       pad_id: int) -> None:
    """Binary cross-entropy on the labelled positions; AdamW, warmup + cosine (train_lm)."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model, lr)
    model.train()
    running = 0.0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step / steps, step, lr, min(50, max(1, steps // 10)))
        index = torch.randint(0, len(examples), (batch_size,), generator=gen).tolist()
        ids, mask, targets = pad_batch([examples[i] for i in index], pad_id)
        logits = model(input_ids=ids, attention_mask=mask).logits[..., 0]  # [B, T]
        seen = ~torch.isnan(targets)
        loss = F.binary_cross_entropy_with_logits(logits[seen], targets[seen])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            print(f"reward step {step + 1:5d} | bce {running / ((step % 100) + 1):.4f}",
                  flush=True)
            running = 0.0 if (step + 1) % 100 == 0 else running
    model.eval()


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


def evaluate(problems, samples, greedy, orm: SegmentScorer, prm: SegmentScorer) -> dict:
    """Accuracy, reward-model AUC and what voting / reranking 4 samples buy."""
    from collections import Counter

    from decodekit.meta.tasks.arith import extract_answer

    correct = [[check_answer(p, s) for s in ss] for p, ss in zip(problems, samples)]
    orm_scores, prm_steps, prm_labels, prm_min, outcomes = [], [], [], [], []
    vote = bon_orm = bon_prm = 0
    for p, ss, cs in zip(problems, samples, correct):
        o = [orm.score_segments(format_prompt(p), [s.strip() + DELIMITER])[0] for s in ss]
        mins = []
        for s in ss:
            steps = split_steps(s) or [""]
            scores = prm.score_segments(format_prompt(p), [t + DELIMITER for t in steps])
            prm_steps += scores
            prm_labels += check_steps(p, steps)
            mins.append(min(scores))
        orm_scores += o
        prm_min += mins
        outcomes += cs
        answers = [extract_answer(s) for s in ss]
        top = Counter(a for a in answers if a is not None).most_common(1)
        vote += bool(top) and top[0][0] == p.answer
        bon_orm += cs[max(range(len(ss)), key=o.__getitem__)]
        bon_prm += cs[max(range(len(ss)), key=mins.__getitem__)]
    n = len(problems)
    return {
        "test_problems": n, "samples_per_problem": len(samples[0]),
        "accuracy_t1": sum(outcomes) / len(outcomes),
        "accuracy_greedy": sum(check_answer(p, g[0]) for p, g in zip(problems, greedy)) / n,
        "pass_at_4": sum(any(c) for c in correct) / n, "majority_vote_at_4": vote / n,
        "orm_best_of_4": bon_orm / n, "prm_min_best_of_4": bon_prm / n,
        "orm_auc": auc(orm_scores, outcomes), "prm_step_auc": auc(prm_steps, prm_labels),
        "prm_min_outcome_auc": auc(prm_min, outcomes),
        "orm_positive_rate": sum(outcomes) / len(outcomes),
        "prm_positive_rate": sum(prm_labels) / len(prm_labels),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="smoke run: tiny models and data")
    parser.add_argument("--max-minutes", type=float, default=None, help="LM training budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--install", action="store_true", help="copy models into the package")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)  # the one place threading is set (STYLE.md 9)
    run, out = RUNS["tiny" if args.tiny else "full"], Path(args.out)
    start = time.perf_counter()
    lm_dir = out / "lm" / "final"
    if not (lm_dir / "model.safetensors").exists():
        train_lm_stage(run, out, args.max_minutes, args.seed)
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
        if not (rm_dir / "model.safetensors").exists():
            examples = reward_examples(tokenizer, rm_problems, saved["reward_train"], kind)
            model = build_reward_model(run, tokenizer)
            print(f"{kind}: {sum(p.numel() for p in model.parameters()):,} parameters, "
                  f"{len(examples)} training samples", flush=True)
            train_reward_model(model, examples, steps=run.rm_steps, batch_size=32, lr=2e-3,
                               seed=args.seed, pad_id=tokenizer.eos_token_id)
            model.save_pretrained(rm_dir)
            tokenizer.save_pretrained(rm_dir)
        scorers[kind] = SegmentScorer.from_pretrained(rm_dir)

    metrics = evaluate(test, saved["test"], saved["greedy"], scorers["orm"], scorers["prm"])
    metrics["parameters"] = {
        "arith": sum(p.numel() for p in lm.parameters()),
        "arith-orm": scorers["orm"].num_parameters(),
        "arith-prm": scorers["prm"].num_parameters(),
    }
    metrics["minutes"] = (time.perf_counter() - start) / 60
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics, indent=1), flush=True)
    if args.install:
        for name, src in (("arith", lm_dir), ("arith-orm", out / "orm"), ("arith-prm", out / "prm")):
            shutil.copytree(src, ASSETS / name, dirs_exist_ok=True)
        print(f"installed arith, arith-orm, arith-prm into {ASSETS}", flush=True)
    return metrics


def held_out(run: RunConfig, config: ArithConfig):
    """Test problems none of which appears among the training problems' questions."""
    train = {p.question for p in generate_problems(run.train_problems, SEEDS["train"], config)}
    pool = generate_problems(4 * run.test_problems + 100, SEEDS["test"], config)
    return [p for p in pool if p.question not in train][: run.test_problems]


if __name__ == "__main__":
    main()
