"""Build Hugging Face-format reward models for `arith`: an ORM and a PRM that load like the
ones people download (meta/reward_models.py), made here since nothing can be downloaded.

    python scripts/build_arith_reward_models.py --out runs/arith-hf [--install]

- ORM: `LlamaForSequenceClassification`, num_labels = 1: `arith`'s own body and a linear
  `score` head (no bias, as transformers builds it) whose logit at the solution's last
  token is log-odds that the answer is right.
- PRM: `LlamaForTokenClassification`, 2 labels: the same body and a `score` head (with its
  bias) whose P(label 1) at each step's last token ("\\n") is the probability that every
  step so far is right.

The heads are fitted, the body kept frozen: `arith` samples solutions at temperature 1 to
fresh problems (a stream that neither its training nor `eval arith`'s held-out problems
use), the exact checkers label them (check_answer, check_steps), and a logistic regression
(L-BFGS, L2 penalty) on the body's final states at the score positions gives the head.
The tokens are exactly those `RewardModel` reads: the prompt `Compute: ...=\\n`, then each
segment (the whole solution, or one step) with its "\\n". Held-out AUCs and best-of-4
accuracy, scored by the saved models through `load_reward_model` (so through decodekit's
engine), are printed and written to `--out/metrics.json`. `--install` copies both into
src/decodekit/models/assets/ as `arith-hf-orm` and `arith-hf-prm`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

import decodekit as dk
from decodekit.meta.rewards import load_reward_model
from decodekit.meta.tasks.arith import (
    DELIMITER,
    check_answer,
    check_steps,
    format_prompt,
    generate_problems,
    split_steps,
)

ASSETS = Path(__file__).resolve().parents[1] / "src" / "decodekit" / "models" / "assets"
FIT_SEED, TEST_SEED = 21, 22  # problem streams: not arith's training (1) nor eval arith's (4)


def orm_items(problems, samples):
    """(prompt, [solution + "\\n"]) per sample and its outcome label."""
    return ([(format_prompt(p), [c.strip() + DELIMITER]) for p, cs in zip(problems, samples) for c in cs],
            [float(check_answer(p, c)) for p, cs in zip(problems, samples) for c in cs])


def prm_items(problems, samples):
    """(prompt, steps each with "\\n") per sample and its per-step labels."""
    items, labels = [], []
    for p, cs in zip(problems, samples):
        for c in cs:
            steps = split_steps(c) or ["?"]
            items.append((format_prompt(p), [s + DELIMITER for s in steps]))
            labels.append([float(x) for x in check_steps(p, steps)])
    return items, labels


@torch.inference_mode()
def final_states(policy, items) -> list[torch.Tensor]:
    """The body's final states [S, hidden] at each item's segment ends (RewardModel's tokens)."""
    tokenizer = policy.tokenizer
    out = []
    for prompt, segments in items:
        ids, ends = list(tokenizer.encode(prompt)), []
        for segment in segments:
            ids += tokenizer.encode(segment, add_special_tokens=False)
            ends.append(len(ids) - 1)
        out.append(policy.hidden_states(torch.tensor([ids]))[0, ends].double())
    return out


def fit_head(x: torch.Tensor, y: torch.Tensor, bias: bool, l2: float = 1e-3) -> tuple[torch.Tensor, float]:
    """Logistic regression of y on x [N, hidden] (L-BFGS): (weights [hidden], bias)."""
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=bias)
    optimizer = torch.optim.LBFGS([w, b] if bias else [w], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return w.detach(), float(b.detach())


def save_reward_model(kind: str, weight: torch.Tensor, bias: float, out: Path) -> Path:
    """`arith`'s body with a fitted head, saved by transformers in its own format."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        LlamaForSequenceClassification,
        LlamaForTokenClassification,
    )

    config = AutoConfig.from_pretrained(ASSETS / "arith")
    body = AutoModelForCausalLM.from_pretrained(ASSETS / "arith", dtype=torch.float32).model
    config.tie_word_embeddings = False
    if kind == "orm":
        config.num_labels = 1
        model = LlamaForSequenceClassification(config)
        head = weight[None]  # [1, hidden]
    else:
        config.num_labels = 2
        model = LlamaForTokenClassification(config)
        head = torch.stack([torch.zeros_like(weight), weight])  # softmax(...)[1] = sigmoid(w.h + b)
        model.score.bias.data = torch.tensor([0.0, bias])
    model.model.load_state_dict(body.state_dict())
    model.score.weight.data = head.float()
    path = out / f"arith-hf-{kind}"
    model.eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "arith" / name, path / name)
    return path


def auc(scores: list[float], labels: list[float]) -> float:
    """P(a positive outscores a negative), ties half."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def sample(policy, problems, k: int, seed: int) -> list[list[str]]:
    params = dk.SamplingParams(n=k, temperature=1.0, max_new_tokens=96, seed=seed)
    return [[c.text for c in cs] for cs in dk.generate(policy, [format_prompt(p) for p in problems], params)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--problems", type=int, default=1500, help="problems whose samples fit the heads")
    parser.add_argument("--test-problems", type=int, default=300)
    parser.add_argument("--samples", type=int, default=4, help="samples per problem")
    parser.add_argument("--install", action="store_true", help="copy both into the package's assets")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    start = time.perf_counter()
    policy = dk.load_model("arith")
    fit_problems = generate_problems(args.problems, FIT_SEED)
    fit_samples = sample(policy, fit_problems, args.samples, FIT_SEED)
    paths = {}
    for kind, items_of in (("orm", orm_items), ("prm", prm_items)):
        items, labels = items_of(fit_problems, fit_samples)
        x = torch.cat(final_states(policy, items))
        flat = [v for ys in labels for v in (ys if isinstance(ys, list) else [ys])]
        y = torch.tensor(flat, dtype=torch.float64)
        weight, bias = fit_head(x, y, bias=kind == "prm")
        paths[kind] = save_reward_model(kind, weight, bias, args.out)
        print(f"{kind}: head fitted on {len(y)} positions ({y.mean():.2f} positive)", flush=True)
    test = generate_problems(args.test_problems, TEST_SEED)
    samples = sample(policy, test, args.samples, TEST_SEED)
    orm, prm = (load_reward_model(paths[k]) for k in ("orm", "prm"))
    items, outcomes = orm_items(test, samples)
    orm_scores = [s[0] for s in orm.score_batch(items)]
    items, step_labels = prm_items(test, samples)
    prm_scores = prm.score_batch(items)
    k = args.samples
    correct = [outcomes[i * k : (i + 1) * k] for i in range(len(test))]
    best = [max(range(k), key=orm_scores[i * k : (i + 1) * k].__getitem__) for i in range(len(test))]
    prm_min = [min(s) for s in prm_scores]
    best_prm = [max(range(k), key=prm_min[i * k : (i + 1) * k].__getitem__) for i in range(len(test))]
    metrics = {
        "orm_auc": auc(orm_scores, outcomes),
        "prm_step_auc": auc([s for ss in prm_scores for s in ss], [y for ys in step_labels for y in ys]),
        "prm_min_outcome_auc": auc(prm_min, outcomes),
        "accuracy_t1": sum(outcomes) / len(outcomes),
        f"orm_best_of_{k}": sum(c[b] for c, b in zip(correct, best)) / len(test),
        f"prm_min_best_of_{k}": sum(c[b] for c, b in zip(correct, best_prm)) / len(test),
        f"oracle_pass_at_{k}": sum(max(c) for c in correct) / len(test),
        "fit_problems": args.problems, "test_problems": args.test_problems, "samples": k,
        "minutes": (time.perf_counter() - start) / 60,
    }
    print(json.dumps(metrics, indent=1))
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    if args.install:
        for path in paths.values():
            shutil.copytree(path, ASSETS / path.name, dirs_exist_ok=True)
        print(f"installed {', '.join(p.name for p in paths.values())} into {ASSETS}")
    return metrics


if __name__ == "__main__":
    main()
