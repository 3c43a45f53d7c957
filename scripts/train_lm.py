"""Train a small Llama-architecture causal LM on a token stream: seeded, resumable, time-bounded.

Library use (the arithmetic-task script imports this):

    from train_lm import train_causal_lm
    result = train_causal_lm(model, train_ids, val_ids, out_dir="runs/x", seq_len=256,
                             batch_size=16, steps=2000, lr=3e-3, max_minutes=40)

Command line (the embedded Shakespeare models, see MODELS.md):

    python scripts/train_lm.py --config shakespeare --steps 3000 --out runs/shakespeare \
        --max-minutes 45
    python scripts/train_lm.py --config shakespeare-draft --steps 10 --out /tmp/x --tiny

Training samples random windows of `seq_len + 1` tokens from one stream in which documents
are separated by EOS, optimises next-token cross-entropy with AdamW and a linear-warmup cosine
schedule, and writes `out_dir/checkpoint.pt` (model, optimizer, step, RNG states, history)
every `eval_every` steps so that a killed run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from decodekit import runtime

EOS = "<|endoftext|>"
REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "src" / "decodekit" / "models" / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EVAL_WINDOWS = 64  # windows of seq_len scored at each periodic evaluation


# ---------------------------------------------------------------- data


def encode_documents(tokenizer, text: str) -> torch.Tensor:
    """One long stream [N] of token ids: each EOS-separated document followed by EOS."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for doc in text.split(EOS):
        doc = doc.strip("\n")
        if doc:
            ids.extend(tokenizer.encode(doc, add_special_tokens=False))
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(ids: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator):
    """Inputs and targets [B, seq_len] from random windows of seq_len + 1 tokens."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=gen)
    rows = torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])  # [B, T+1]
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate_loss(
    model, ids: torch.Tensor, seq_len: int, batch_size: int, max_windows: int | None = None
) -> tuple[float, int]:
    """Mean next-token loss (nats) over non-overlapping windows of `ids`, and tokens scored.

    Each window starts a fresh context, as in nanoGPT's evaluation; the first token of the
    stream is never predicted. `max_windows` spreads that many windows evenly over the stream.
    """
    n_windows = (len(ids) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"need more than seq_len={seq_len} tokens to evaluate, got {len(ids)}")
    starts = [i * seq_len for i in range(n_windows)]
    if max_windows is not None and n_windows > max_windows:
        stride = n_windows / max_windows
        starts = [starts[int(i * stride)] for i in range(max_windows)]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for b in range(0, len(starts), batch_size):
        rows = torch.stack([ids[s : s + seq_len + 1] for s in starts[b : b + batch_size]])
        rows = rows.to(next(model.parameters()).device)
        logits = model(input_ids=rows[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += rows[:, 1:].numel()
    model.train(was_training)
    return total / count, count


# ---------------------------------------------------------------- schedule


def learning_rate(progress: float, step: int, lr: float, warmup: int) -> float:
    """Linear warmup for `warmup` steps, then cosine decay to lr/10 as progress goes 0 -> 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (nanoGPT): norms and biases are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


# ---------------------------------------------------------------- training loop


def train_causal_lm(
    model,
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    *,
    out_dir: str,
    seq_len: int,
    batch_size: int,
    steps: int,
    lr: float,
    seed: int = 0,
    warmup: int = 100,
    eval_every: int = 100,
    log_every: int = 10,
    resume: bool = True,
    max_minutes: float | None = None,
    bf16: bool = False,
    device: str = "cpu",
    progress: bool | None = None,
    keep_best: bool = False,
) -> dict:
    """Train `model` (a transformers causal LM) and save it to `out_dir/final`.

    Stops after `steps` optimizer steps or `max_minutes` of training time, whichever comes
    first. With `max_minutes` the cosine schedule follows max(step / steps, minutes /
    max_minutes), so the learning rate has decayed when the clock runs out; such runs are
    seeded but not bit-for-bit reproducible. `bf16` runs the forward under bfloat16 autocast
    (weights and optimizer stay float32; evaluation is float32). `device` ("cpu", "cuda")
    is where the model trains; the data stream stays on the CPU, so a run's windows are the
    same on any device. `progress` (None: when stderr is a terminal) shows a bar over the
    steps on stderr, the training loss beside it, instead of the per-step log lines.
    `keep_best` also saves the model to `out_dir/best` whenever a periodic validation loss is
    the lowest so far (a model that can overfit its data: the last step need not be the best).
    Returns {"history", "val_loss", "train_minutes"}.
    """
    if train_ids.dim() != 1 or val_ids.dim() != 1:
        raise ValueError("train_ids and val_ids must be 1-D token streams")
    if len(train_ids) <= seq_len + 1:
        raise ValueError(f"train_ids has {len(train_ids)} tokens, need more than seq_len + 1")
    if steps < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError(f"steps, batch_size, seq_len must be >= 1, got {steps}, {batch_size}, "
                         f"{seq_len}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model.to(device)
    optimizer = make_optimizer(model, lr)
    step, minutes_before, history, best_val = 0, 0.0, [], math.inf
    if resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        step, minutes_before, history = state["step"], state["minutes"], state["history"]
        best_val = state.get("best_val", math.inf)
        print(f"resumed from {ckpt_path} at step {step} ({minutes_before:.1f} min)", flush=True)

    def save_checkpoint(minutes: float) -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "data_rng": gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "minutes": minutes,
            "history": history,
            "best_val": best_val,
        }
        torch.save(state, str(ckpt_path) + ".tmp")
        os.replace(str(ckpt_path) + ".tmp", ckpt_path)  # never leave a half-written checkpoint

    model.train()
    start = time.perf_counter()
    running, running_n, t_log = 0.0, 0, time.perf_counter()
    minutes = minutes_before
    bar = runtime.progress(total=steps, desc="train", enabled=progress)
    bar.update(step)
    say = partial(print, flush=True) if bar.disable else bar.write  # lines above the bar, not in it
    while True:
        minutes = minutes_before + (time.perf_counter() - start) / 60
        done = step / steps
        if max_minutes is not None:
            done = max(done, minutes / max_minutes)
        if step >= steps or done >= 1.0:
            break
        rate = learning_rate(done, step, lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = rate
        inputs, targets = random_windows(train_ids, seq_len, batch_size, gen)  # [B, T] each
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=inputs).logits  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        running += loss.item()
        running_n += 1
        bar.update()

        if step % log_every == 0 or step == 1:
            sec = (time.perf_counter() - t_log) / running_n
            if bar.disable:
                print(f"step {step:5d} | loss {running / running_n:.4f} | lr {rate:.2e} | "
                      f"{sec:.2f} s/step | {minutes:.1f} min", flush=True)
            else:
                bar.set_postfix_str(f"loss {running / running_n:.4f} lr {rate:.2e}", refresh=False)
            history.append({"step": step, "train_loss": running / running_n, "lr": rate,
                            "minutes": minutes})
            running, running_n, t_log = 0.0, 0, time.perf_counter()
        if step % eval_every == 0:
            val, _ = evaluate_loss(model, val_ids, seq_len, batch_size, EVAL_WINDOWS)
            say(f"step {step:5d} | val loss {val:.4f} | val ppl {math.exp(val):.2f}")
            history.append({"step": step, "val_loss": val, "minutes": minutes})
            if keep_best and val < best_val:
                best_val = val  # saved before the checkpoint that records it: a resume never skips it
                model.save_pretrained(out / "best", safe_serialization=True)
            save_checkpoint(minutes_before + (time.perf_counter() - start) / 60)

    bar.close()
    val, n_tokens = evaluate_loss(model, val_ids, seq_len, batch_size)
    print(f"final step {step} | val loss {val:.4f} | val ppl {math.exp(val):.2f} "
          f"over {n_tokens} tokens | {minutes:.1f} min", flush=True)
    history.append({"step": step, "val_loss": val, "minutes": minutes, "final": True})
    save_checkpoint(minutes)
    model.to("cpu").save_pretrained(out / "final", safe_serialization=True)
    result = {"history": history, "val_loss": val, "train_minutes": minutes}
    (out / "history.json").write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------- the Shakespeare models


@dataclass(frozen=True)
class LMConfig:
    """Architecture and training hyper-parameters of one embedded model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_context: int
    seq_len: int
    batch_size: int
    lr: float
    warmup: int


CONFIGS = {
    # target: ~3.4M parameters, grouped-query attention (4 query heads share 2 KV heads).
    # Sized for the compute actually available: the shared 2-core machine gave a training
    # process a fraction of one core, so a wider, shallower model with small batches (more
    # optimizer steps per token) learns more in 45 minutes than the 5M / batch-16 variant.
    # Trained on windows of the whole declared context (512 positions), so that quality is
    # flat over the context (issue 13: the first models saw 256-token windows of a 512-token
    # context, and their perplexity collapsed past position 256). Same tokens per step as
    # the first models (8 x 256, 16 x 256).
    "shakespeare": LMConfig(256, 4, 4, 2, 688, 512, 512, 4, 2e-3, 50),
    # draft / amateur: ~15x fewer parameters, 2 layers
    "shakespeare-draft": LMConfig(64, 2, 2, 1, 172, 512, 512, 8, 4e-3, 50),
    # issue 36's candidates for a memory-bound target (scripts/size_lm.py measures them;
    # MODELS.md "shakespeare-large"): 14M (55 MB in float32, under 4x the
    # 32 MiB L3), 36M (144 MB) and 56M (224 MB); head dim 64, KV heads half the heads
    "large-14m": LMConfig(384, 8, 6, 3, 1024, 512, 512, 8, 1e-3, 100),
    "large-36m": LMConfig(512, 12, 8, 4, 1376, 512, 512, 8, 1e-3, 100),
    "large-56m": LMConfig(640, 12, 10, 5, 1728, 512, 512, 8, 1e-3, 100),
    # the memory-bound target (issue 36): large-36m, the smallest candidate whose float32
    # weights (144 MB) are over 4x the 32 MiB L3, so its batch-1 decode streams from memory;
    # batch 8 x 512 (4,096 tokens a step, twice `shakespeare`'s), 1,600 steps = 6.6M tokens
    "shakespeare-large": LMConfig(512, 12, 8, 4, 1376, 512, 512, 8, 1e-3, 100),
    # smoke test only
    "tiny": LMConfig(32, 1, 2, 1, 64, 64, 32, 4, 1e-3, 1),
}


def build_model(cfg: LMConfig, tokenizer):
    """A freshly initialised LlamaForCausalLM with tied embeddings for `tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_context,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def load_texts(data_dir: Path, tiny: bool) -> tuple[str, str]:
    """Train and validation text; `tiny` slices the validation text shipped in the package."""
    if tiny:
        text = (ASSETS / "data" / "shakespeare_val.txt").read_text()
        return text[:20_000], text[20_000:26_000]
    return (data_dir / "train.txt").read_text(), (data_dir / "val.txt").read_text()


def add_tokenizer(folder: Path, source: Path, tokenizer) -> None:
    """Tokenizer files and generation config beside a saved model, so that it loads by path."""
    for name in TOKENIZER_FILES:  # copied verbatim: save_pretrained rewrites the class name
        shutil.copyfile(source / name, folder / name)
    from transformers import GenerationConfig

    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=["shakespeare", "shakespeare-draft", "shakespeare-large"],
                        required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="smoke run: tiny model and data")
    parser.add_argument("--data", default=str(REPO / "data" / "shakespeare"))
    parser.add_argument("--tokenizer", default=None,
                        help="directory AutoTokenizer loads; default DATA/tokenizer (written by "
                             "prepare_corpus.py), or the shipped one for --tiny")
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    # one thread: on the shared 2-core machine two threads ran 2-4x slower per step whenever
    # other jobs were running (OpenMP threads waiting on each other)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fp32", action="store_true", help="no bfloat16 autocast")
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--device", default="cpu", help="where to train: cpu (default) or cuda")
    parser.add_argument("--batch-size", type=int, default=None, help="override the config's")
    parser.add_argument("--eval-every", type=int, default=100,
                        help="steps between validation + checkpoint (and --keep-best's save)")
    parser.add_argument("--keep-best", action="store_true",
                        help="also save OUT/best: the model at the lowest periodic validation loss")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)  # the one place threading is set (STYLE.md 9)
    if args.tokenizer is None:
        shipped = args.tiny or not (Path(args.data) / "tokenizer").exists()
        args.tokenizer = str(ASSETS / "shakespeare" if shipped else Path(args.data) / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cfg = CONFIGS["tiny" if args.tiny else args.config]
    if args.batch_size is not None:
        cfg = replace(cfg, batch_size=args.batch_size)
    train_text, val_text = load_texts(Path(args.data), args.tiny)
    train_ids = encode_documents(tokenizer, train_text)
    val_ids = encode_documents(tokenizer, val_text)
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.config}{' (tiny)' if args.tiny else ''}: {n_params:,} parameters, "
          f"{len(train_ids):,} train / {len(val_ids):,} val tokens, {asdict(cfg)}", flush=True)
    if args.keep_best:  # out/best loads by path as soon as its first weights are saved
        (Path(args.out) / "best").mkdir(parents=True, exist_ok=True)
        add_tokenizer(Path(args.out) / "best", Path(args.tokenizer), tokenizer)
    result = train_causal_lm(
        model, train_ids, val_ids, out_dir=args.out, seq_len=cfg.seq_len,
        batch_size=cfg.batch_size, steps=args.steps, lr=cfg.lr, seed=args.seed,
        warmup=min(cfg.warmup, max(1, args.steps // 10)),
        eval_every=min(args.eval_every, args.steps), log_every=1 if args.tiny else 10,
        resume=not args.no_resume, max_minutes=args.max_minutes, bf16=not args.fp32,
        device=args.device, keep_best=args.keep_best,
    )
    final = Path(args.out) / "final"
    add_tokenizer(final, Path(args.tokenizer), tokenizer)
    print(f"saved {final} | val ppl {math.exp(result['val_loss']):.2f}", flush=True)


if __name__ == "__main__":
    main()
