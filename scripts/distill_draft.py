"""Distil a draft model from a target: the target's next-token distributions become its labels.

Speculative decoding accepts a drafted token with probability min(1, p/q), so a draft that
matches the target's *distribution* (not the text's next token) is accepted more often: at
T = 0 its argmax must agree with the target's, at T = 1 its acceptance is 1 - TV(p, q).
This recipe (DistillSpec's forward-KL variant, on the training text rather than on drafted
text) trains a draft on the target's top-k log-probabilities:

    python scripts/distill_draft.py --teacher shakespeare-large --student shakespeare \
        --data /work/runs/data/shakespeare --out /work/runs/distill --epochs 2 --threads 2

1. Labels: the teacher reads the training stream in aligned windows of the student's context
   and keeps, per position, its top-k log-probabilities and their token ids (float16 / int16),
   written in chunks to `out/teacher/`; a killed run recomputes only missing chunks.
2. Training: the student (initialised from `--student`, a model name or directory) minimises
   the cross-entropy of its log-probabilities against the teacher's top-k distribution,
   renormalised; `--hard` mixes in the text's next token. Resumable from `out/checkpoint.pt`.
3. Every evaluation reports, on held-out windows, the student's text perplexity and its
   agreement with the teacher: how often the two argmaxes agree (T = 0 acceptance per token)
   and the mean 1 - TV(p, q) (T = 1 acceptance per token), both over the full vocabulary.
   `out/best` keeps the student with the highest T = 1 agreement.

One thread per process unless `--threads` says otherwise (STYLE.md 9).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decodekit.models.hf import load_causal_lm  # noqa: E402
from decodekit.models.registry import resolve  # noqa: E402
from train_lm import add_tokenizer, encode_documents, learning_rate, make_optimizer  # noqa: E402

CHUNK = 64  # windows per label file


def windows_of(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The stream cut into aligned windows [N, seq_len]; a partial last window is dropped."""
    n = len(ids) // seq_len
    return ids[: n * seq_len].view(n, seq_len)


@torch.inference_mode()
def teacher_labels(teacher, windows: torch.Tensor, folder: Path, top_k: int) -> None:
    """Write the teacher's top-k log-probabilities for every window, chunk by chunk."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks = math.ceil(len(windows) / CHUNK)
    for c in range(chunks):
        path = folder / f"chunk_{c:04d}.pt"
        if path.exists():
            continue
        start = time.perf_counter()
        values, indices = [], []
        for w in windows[c * CHUNK:(c + 1) * CHUNK]:
            logp = torch.log_softmax(teacher(input_ids=w[None]).logits[0].float(), -1)  # [T, V]
            top = logp.topk(top_k, dim=-1)
            values.append(top.values.half())
            indices.append(top.indices.to(torch.int16))
        torch.save({"values": torch.stack(values), "indices": torch.stack(indices)},
                   str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        print(f"labels {c + 1}/{chunks} | {time.perf_counter() - start:.1f} s", flush=True)


def load_labels(folder: Path, n_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [torch.load(folder / f"chunk_{c:04d}.pt") for c in range(math.ceil(n_windows / CHUNK))]
    values = torch.cat([p["values"] for p in parts])
    indices = torch.cat([p["indices"] for p in parts])
    return values[:n_windows], indices[:n_windows]


def keep_layers(model, keep: list[int]) -> None:
    """Drop every decoder layer of a Llama-style model but `keep` (in order): a shallower
    student that starts from a trained model's embeddings, norms and chosen layers."""
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    for new_index, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new_index
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]


def distill_loss(student_logits, values, indices, targets, hard: float) -> torch.Tensor:
    """Cross-entropy against the teacher's renormalised top-k distribution (+ `hard` x text CE)."""
    logq = torch.log_softmax(student_logits.float(), -1)  # [B, T, V]
    p = torch.softmax(values.float(), -1)  # renormalised over the top k
    soft = -(p * logq.gather(-1, indices.long())).sum(-1).mean()
    if hard == 0:
        return soft
    return soft + hard * F.nll_loss(logq.flatten(0, 1), targets.flatten())


@torch.inference_mode()
def log_probs(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Each window's next-token log-probabilities [T - 1, V] (the last position predicts none)."""
    return [torch.log_softmax(model(input_ids=w[None]).logits[0].float(), -1)[:-1] for w in windows]


@torch.inference_mode()
def agreement(student, teacher_logps: list[torch.Tensor], windows: torch.Tensor) -> dict[str, float]:
    """Text perplexity of the student and its per-token agreement with the teacher."""
    nll = argmax_agree = overlap = n = 0.0
    for w, logq, logp in zip(windows, log_probs(student, windows), teacher_logps, strict=True):
        nll += -logq.gather(-1, w[1:, None]).sum().item()
        argmax_agree += (logq.argmax(-1) == logp.argmax(-1)).sum().item()
        overlap += torch.minimum(logq.exp(), logp.exp()).sum().item()
        n += len(w) - 1
    return {"val_ppl": math.exp(nll / n), "agree_t0": argmax_agree / n, "agree_t1": overlap / n}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", required=True, help="model name or directory")
    parser.add_argument("--student", required=True, help="model name or directory to start from")
    parser.add_argument("--data", required=True, help="folder with train.txt, val.txt, tokenizer/")
    parser.add_argument("--out", required=True)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--hard", type=float, default=0.0, help="weight of the text's CE")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--labels", default=None, help="label folder (default OUT/teacher); "
                        "students of one teacher can share it")
    parser.add_argument("--layers", default=None,
                        help="keep only these decoder layers of the student, e.g. 0,3 (layer-drop init)")
    parser.add_argument("--labels-only", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    teacher = load_causal_lm(resolve(args.teacher)[1])
    student_dir = resolve(args.student)[1]
    student = load_causal_lm(student_dir)
    if args.layers:
        keep_layers(student, [int(i) for i in args.layers.split(",")])
    seq_len = student.config.max_position_embeddings
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(args.data) / "tokenizer")
    data = Path(args.data)
    train = windows_of(encode_documents(tokenizer, (data / "train.txt").read_text()), seq_len)
    val = windows_of(encode_documents(tokenizer, (data / "val.txt").read_text()), seq_len)
    val = val[torch.randperm(len(val), generator=torch.Generator().manual_seed(0))[:args.eval_windows]]
    print(f"{len(train)} train windows of {seq_len}, {len(val)} val windows", flush=True)
    labels = Path(args.labels) if args.labels else out / "teacher"
    teacher_labels(teacher, train, labels, args.top_k)
    if args.labels_only:
        return
    values, indices = load_labels(labels, len(train))
    teacher_val = log_probs(teacher, val)
    del teacher

    steps = int(args.epochs * len(train) / args.batch_size)
    optimizer = make_optimizer(student, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    step, minutes_before, history, best = 0, 0.0, [], -1.0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        student.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["data_rng"])
        step, minutes_before, history, best = (state["step"], state["minutes"], state["history"],
                                               state["best"])
        print(f"resumed at step {step}", flush=True)
    else:
        first = agreement(student, teacher_val, val)
        history.append({"step": 0, **first})
        print(f"step 0 | {first}", flush=True)
    start = time.perf_counter()
    student.train()
    while step < steps:
        minutes = minutes_before + (time.perf_counter() - start) / 60
        done = step / steps
        if args.max_minutes is not None:
            done = max(done, minutes / args.max_minutes)
        if done >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(done, step, args.lr, min(20, max(1, steps // 10)))
        rows = torch.randint(len(train), (args.batch_size,), generator=gen)
        batch = train[rows]
        logits = student(input_ids=batch[:, :-1]).logits
        loss = distill_loss(logits, values[rows, :-1], indices[rows, :-1], batch[:, 1:], args.hard)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 10 == 0:
            print(f"step {step}/{steps} | loss {loss.item():.4f} | {minutes:.1f} min", flush=True)
        if step % args.eval_every == 0 or step == steps:
            student.eval()
            result = agreement(student, teacher_val, val)
            student.train()
            history.append({"step": step, "minutes": minutes, **result})
            print(f"step {step} | {result}", flush=True)
            if result["agree_t1"] > best:
                best = result["agree_t1"]
                student.save_pretrained(out / "best", safe_serialization=True)
                add_tokenizer(out / "best", student_dir, tokenizer)
            state = {"model": student.state_dict(), "optimizer": optimizer.state_dict(),
                     "data_rng": gen.get_state(), "step": step, "history": history, "best": best,
                     "minutes": minutes_before + (time.perf_counter() - start) / 60}
            torch.save(state, str(ckpt) + ".tmp")
            os.replace(str(ckpt) + ".tmp", ckpt)
    (out / "history.json").write_text(json.dumps(history, indent=1))


if __name__ == "__main__":
    main()
