"""Learned reward models as plain scorers: logistic probes over a policy's token log-probs.

A reward model here reads a prompt and a sequence of text segments (the steps of a
solution, or the whole solution as one segment) and returns P(label = 1) at the end of each
segment. It runs the policy that wrote the text (a causal LM) once over prompt + segments
and, for segment t, computes six features of the policy's own confidence:

    step:   min and mean token log-prob, max predictive entropy over segment t's tokens
    prefix: the same three over segments 0..t

then applies a logistic regression fitted on the policy's samples labelled by an exact
checker. Trained on outcome labels it is an outcome reward model (ORM, one segment); on
"every step so far correct" labels, a process reward model (PRM, one score per step;
Uesato et al. 2022, Lightman et al. 2024). Such a probe catches the errors the policy made
while unsure (a low-probability digit sampled at temperature 1) and misses the ones it made
confidently: imperfect the way a verifier built on the policy is. Task modules wrap a
model into the callables meta-generators take (`meta/tasks/arith.py`: load_orm, load_prm).

A probe whose policy is the model that generated the candidates needs no forward of its
own: every feature is a function of the policy's log-prob of each token and its entropy at
each position, which the generation computed. With `SamplingParams(entropies=True)` a
`Completion` carries them (its `logprobs`, `entropies`, and `final_logprobs`: the last
step's distribution, from which the log-prob of a token scored where the policy stopped is
read: arith's ORM scores `solution + "\n"` where the policy drew EOS).
`score_batch(items, completions=, model=)` reads them where `model`'s weights are the
policy's (`same_weights`) and the item's tokens are the completion's (`completion_features`),
and runs the policy over the rest.

A saved model is a directory with `probe.json` (weights, bias, feature standardisation, and
`policy`: the policy's checkpoint directory, relative to this one). `load_reward_model` also
loads Hugging Face reward models (sequence- and token-classification heads, causal LM PRMs):
meta/reward_models.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from decodekit.models.base import weights_stamp

FEATURES = ("step_min_logprob", "step_mean_logprob", "step_max_entropy",
            "prefix_min_logprob", "prefix_mean_logprob", "prefix_max_entropy")
PROBE_FILE = "probe.json"


def encode_segments(tokenizer, prompt: str, segments: Sequence[str]):
    """Token ids of prompt + segments, and each segment's token span [start, end)."""
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    if not ids:
        raise ValueError("the prompt must encode to at least one token")
    spans = []
    for segment in segments:
        piece = tokenizer.encode(segment, add_special_tokens=False)
        if not piece:
            raise ValueError(f"segment {segment!r} encodes to no tokens")
        spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
    return ids, spans


@torch.inference_mode()
def segment_features(model, tokenizer, items: Sequence[tuple[str, Sequence[str]]],
                     batch_size: int = 64) -> list[np.ndarray]:
    """For each (prompt, segments): features [S, 6] (FEATURES) under the policy `model`."""
    encoded = [encode_segments(tokenizer, prompt, segments) for prompt, segments in items]
    out = []
    for b in range(0, len(encoded), batch_size):
        chunk = encoded[b : b + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (seq, _) in enumerate(chunk):  # right padding: positions stay 0..n-1
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        # index i holds the prediction of token i + 1: its log-prob and the entropy before it
        token_logp = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].numpy()  # [B, T-1]
        entropy = (-(logp.exp() * logp).sum(-1))[:, :-1].numpy()  # [B, T-1]
        for row, (_, spans) in enumerate(chunk):
            out.append(_features(token_logp[row], entropy[row], spans))
    return out


def _features(token_logp: np.ndarray, entropy: np.ndarray, spans) -> np.ndarray:
    rows = []
    first = spans[0][0] - 1
    for start, end in spans:
        step, prefix = slice(start - 1, end - 1), slice(first, end - 1)
        rows.append([token_logp[step].min(), token_logp[step].mean(), entropy[step].max(),
                     token_logp[prefix].min(), token_logp[prefix].mean(), entropy[prefix].max()])
    return np.asarray(rows, dtype=np.float64).reshape(len(spans), len(FEATURES))


def completion_features(tokenizer, prompt: str, segments: Sequence[str], completion,
                        prompt_ids: Sequence[int]) -> np.ndarray | None:
    """Features [S, 6] of (prompt, segments) from what generating `completion` after
    `prompt_ids` (the generation's encoding of `prompt`) computed under the policy, or None
    when it did not compute them all: the item's tokens after the prompt must be the
    completion's, except that the last may differ where the completion's last token was
    (an EOS: its `final_logprobs` hold that position's distribution)."""
    entropies = completion.entropies
    ids, spans = encode_segments(tokenizer, prompt, segments)
    start = spans[0][0]  # the prompt's length
    if entropies is None or ids[:start] != list(prompt_ids) or completion.usage.prompt_tokens != start:
        return None
    wanted, generated = ids[start:], completion.token_ids
    n = len(wanted)
    if n > len(generated) or wanted[: n - 1] != generated[: n - 1]:
        return None
    logp = list(completion.logprobs[:n])
    if wanted[-1] != generated[n - 1]:
        if n != len(generated) or completion.final_logprobs is None:
            return None
        logp[-1] = float(completion.final_logprobs[wanted[-1]])
    # laid out as segment_features' rows: index i predicts token i + 1
    token_logp = np.zeros(len(ids) - 1, dtype=np.float32)
    entropy = np.zeros(len(ids) - 1, dtype=np.float32)
    token_logp[start - 1 :], entropy[start - 1 :] = logp, entropies[:n]
    return _features(token_logp, entropy, spans)


def fit_logistic(features: np.ndarray, labels: np.ndarray, l2: float = 1e-3,
                 iterations: int = 200) -> dict:
    """Logistic regression on standardised features (L-BFGS, L2 penalty): the probe's state."""
    x = torch.as_tensor(features, dtype=torch.float64)  # [N, F]
    y = torch.as_tensor(labels, dtype=torch.float64)  # [N]
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=iterations, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y)
        loss = loss + l2 * (w * w).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return {"features": list(FEATURES), "mean": mean.tolist(), "std": std.tolist(),
            "weights": w.detach().tolist(), "bias": float(b.detach())}


class ProbeRewardModel:
    """P(label = 1) at the end of each segment: a logistic probe over the policy's confidence."""

    score_kind = "probability"  # what a score is (meta/reward_models.py)

    def __init__(self, policy, tokenizer, probe: dict, name: str = "reward"):
        if probe.get("features") != list(FEATURES):
            raise ValueError(f"probe features {probe.get('features')} differ from {FEATURES}")
        self.policy = policy.eval()
        self.tokenizer = tokenizer
        self.probe = {key: probe[key] for key in ("features", "mean", "std", "weights", "bias")}
        self.name = name
        self._same: dict[tuple, bool] = {}  # weights_stamp of a model -> are they the policy's
        self.reused = 0  # items whose features came from their generation, not a forward

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """[S] sigmoid(w . standardised features + b) for features [S, 6]."""
        z = (features - np.asarray(self.probe["mean"])) / np.asarray(self.probe["std"])
        return 1.0 / (1.0 + np.exp(-(z @ np.asarray(self.probe["weights"]) + self.probe["bias"])))

    def score_segments(self, prompt: str, segments: Sequence[str]) -> list[float]:
        return self.score_batch([(prompt, segments)])[0] if segments else []

    def score_batch(self, items: Sequence[tuple[str, Sequence[str]]], batch_size: int = 64,
                    completions: Sequence | None = None, model=None) -> list[list[float]]:
        """Scores of many (prompt, segments), the policy run over them in padded batches.
        completions: per item, the Completion its segments are the text of, which `model`
        generated from the item's prompt with `SamplingParams(entropies=True)` (None for an
        item without one); where `model`'s weights are the policy's, an item whose tokens are
        its completion's is scored from the completion, with no forward (module docstring)."""
        if completions is not None and len(completions) != len(items):
            raise ValueError(f"completions must be one per item ({len(items)}), got {len(completions)}")
        features: list[np.ndarray | None] = [None] * len(items)
        if completions is not None and model is not None and self.same_weights(model):
            for i, ((prompt, segments), completion) in enumerate(zip(items, completions)):
                if segments and completion is not None:
                    features[i] = completion_features(self.tokenizer, prompt, segments, completion,
                                                      model.encode(prompt))
        self.reused += sum(f is not None for f in features)
        todo = [i for i, (_, segments) in enumerate(items) if segments and features[i] is None]
        computed = segment_features(self.policy, self.tokenizer, [items[i] for i in todo], batch_size)
        for i, f in zip(todo, computed):
            features[i] = f
        return [self.probabilities(f).tolist() if f is not None else [] for f in features]

    def same_weights(self, model) -> bool:
        """Are `model`'s weights the policy's, value for value (a decodekit NativeLM of the
        policy's checkpoint: its fused layout)? Checked once per `weights_stamp`."""
        from decodekit.models.native import fuse_checkpoint

        stamp = weights_stamp(model)
        if stamp not in self._same:
            net, config = getattr(model, "net", None), getattr(model, "config", None)
            same = net is not None and config is not None and hasattr(config, "num_layers")
            if same:
                ours = fuse_checkpoint(self.policy.state_dict(), config)
                theirs = net.state_dict()
                tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
                extra = set(theirs) - set(ours) - tied
                same = not extra and all(name in theirs and theirs[name].dtype == t.dtype
                                         and theirs[name].shape == t.shape and torch.equal(theirs[name], t)
                                         for name, t in ours.items())  # fmt: skip
            self._same = {stamp: same}  # one model's stamp kept: its weights are what changes
        return self._same[stamp]

    def save(self, path: str | Path, policy_dir: str | Path) -> None:
        """Write probe.json; the policy is referenced by its directory relative to `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        relative = os.path.relpath(Path(policy_dir).resolve(), path.resolve())
        meta = {"format": "decodekit-probe-reward", "version": 1, "policy": relative,
                **self.probe}
        (path / PROBE_FILE).write_text(json.dumps(meta, indent=1) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str | None = None) -> ProbeRewardModel:
        from decodekit.models.checkpoint import load_tokenizer
        from decodekit.models.hf import load_causal_lm

        path = Path(path)
        meta = json.loads((path / PROBE_FILE).read_text())
        if meta.get("format") != "decodekit-probe-reward":
            raise ValueError(f"{path / PROBE_FILE} is not a decodekit probe reward model")
        policy_dir = (path / meta["policy"]).resolve()
        policy = load_causal_lm(policy_dir, torch.float32)
        return cls(policy, load_tokenizer(policy_dir), meta, name or path.name)


def load_reward_model(name_or_path: str | Path, format=None, native: bool | None = None):
    """An embedded reward model by name (registry.json) or a local directory: a probe
    (probe.json) or a Hugging Face reward model (config.json: meta/reward_models.py, whose
    `RewardFormat` `format` and `native` apply to it only). Both have `score_segments`,
    `score_batch` and `score_kind`."""
    from decodekit.models.registry import resolve

    text = str(name_or_path)
    try:
        name, path, _ = resolve(text)
    except ValueError as error:
        raise ValueError(f"reward model {text!r}: {error}") from None
    if (path / PROBE_FILE).exists():
        if format is not None or native is not None:
            raise ValueError(f"format and native apply to Hugging Face reward models, not the probe {name!r}")
        return ProbeRewardModel.from_pretrained(path, name=name)
    from decodekit.meta.reward_models import RewardModel

    return RewardModel(path, format, name=name, native=native)
