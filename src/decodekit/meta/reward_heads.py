"""What a Hugging Face reward model's directory holds: which of three kinds it is, its head,
and how a head's output becomes a score.

Kinds (`HEADS`), recognised from config.json's `architectures`:

- "sequence_classification": `*ForSequenceClassification`, a linear `score` head on the
  final hidden state (after the final norm); num_labels = 1 is an outcome reward model
  (Skywork-Reward, RLHF reward models): the raw logit at the last token, `score_kind`
  "logit"; num_labels = 2 reads P(label 1), "probability".
- "token_classification": `*ForTokenClassification` (a linear `score` or `classifier` head
  with a bias) or `Qwen2ForProcessRewardModel` (Qwen2.5-Math-PRM: `score` is
  Linear-ReLU-Linear): a process reward model read at each step's separator; 2 labels:
  P(label 1), "probability"; 1 label: the raw logit, "logit".
- "causal_lm": `*ForCausalLM` asked whether a step is good (Math-Shepherd, RLHFlow PRMs):
  p(+) / (p(+) + p(-)) of the next token at the step's last token (its tag), "probability".
  Only the LM head's "-" and "+" rows are kept: a 2-label head whose softmax is exactly
  that ratio.

A head maps final states [..., hidden] to [..., L] (L = 1 or 2); `read_scores` turns L = 1
into the logit itself and L = 2 into softmax(...)[1] (for "causal_lm" the rows are
["-", "+"], so index 1 is "+").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

HEADS = ("sequence_classification", "token_classification", "causal_lm")
SCORE_KINDS = ("probability", "logit")
SUFFIXES = {"ForSequenceClassification": "sequence_classification",
            "ForTokenClassification": "token_classification",
            "ForProcessRewardModel": "token_classification",
            "ForCausalLM": "causal_lm"}  # fmt: skip


def reward_config(path: Path) -> tuple[dict, str]:
    """(config.json, head kind) of a reward model directory; ValueError naming the problem."""
    if not path.is_dir():
        raise ValueError(f"reward model {str(path)!r} is not a directory (nor an embedded name)")
    if not (path / "config.json").exists():
        raise ValueError(f"reward model directory {str(path)!r} has neither probe.json nor config.json")
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{path / 'config.json'} names no architectures; cannot tell the reward head")
    name = architectures[0]
    kind = next((k for suffix, k in SUFFIXES.items() if name.endswith(suffix)), None)
    if kind is None:
        raise ValueError(f"unknown reward head {name!r} in {path / 'config.json'}: expected "
                         f"*{', *'.join(SUFFIXES)}")  # fmt: skip
    if kind != "causal_lm":
        labels = num_labels(config)
        if labels not in (1, 2):
            raise ValueError(f"unknown reward head {name!r} with num_labels={labels}: a reward "
                             "model's head has 1 label (a logit) or 2 (P(label 1))")
    return config, kind


def num_labels(config: dict) -> int:
    """A classification head's labels: id2label's size (what transformers saves), else num_labels."""
    if config.get("id2label"):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def score_kind(kind: str, labels: int) -> str:
    """What a score means: "logit" for a one-label head, else "probability"."""
    return "logit" if kind != "causal_lm" and labels == 1 else "probability"


def build_head(state: dict[str, torch.Tensor], kind: str,
               token_ids: tuple[int, int] | None = None) -> nn.Module:
    """The head from a checkpoint's tensors (transformers' names): `score`/`classifier` Linear,
    `score.0`/`score.2` Linear-ReLU-Linear (Qwen2.5-Math-PRM), or for "causal_lm" the LM
    head's rows `token_ids` = (minus, plus) (the embedding's when the head is tied)."""
    if kind == "causal_lm":
        assert token_ids is not None
        weight = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
        if weight is None:
            raise ValueError("the causal LM checkpoint has neither lm_head.weight nor "
                             "model.embed_tokens.weight")
        return _linear(weight[list(token_ids)], None)
    for name in ("score", "classifier"):
        if f"{name}.weight" in state:
            return _linear(state[f"{name}.weight"], state.get(f"{name}.bias"))
        if f"{name}.0.weight" in state and f"{name}.2.weight" in state:
            return nn.Sequential(_linear(state[f"{name}.0.weight"], state.get(f"{name}.0.bias")), nn.ReLU(),
                                 _linear(state[f"{name}.2.weight"], state.get(f"{name}.2.bias")))
    heads = sorted({k.split(".")[0] for k in state if not k.startswith("model.")})
    raise ValueError(f"unknown reward head: the checkpoint has no score or classifier weights "
                     f"(its top-level tensors: {heads})")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
    return layer.eval()


def read_scores(outputs: torch.Tensor) -> list[float]:
    """Head outputs [S, L] -> S scores: the logit (L = 1) or softmax(...)[:, 1] (L = 2)."""
    outputs = outputs.double()
    if outputs.shape[-1] == 1:
        return outputs[:, 0].tolist()
    return torch.softmax(outputs, dim=-1)[:, 1].tolist()
