"""NativeLM's feed-forward sublayers: the gated MLP (SwiGLU, GeGLU) and a mixture of experts
of such MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE).

A mixture routes each token to `experts_per_token` of its experts (Shazeer et al. 2017;
Mixtral, Jiang et al. 2024): a linear router scores the experts, a softmax over all of them
gives probabilities, the top k are kept (renormalised to sum to 1 where the family does so:
Mixtral always, Qwen as `norm_topk_prob` says), and the token's output is the weighted sum of
its experts' outputs, summed in ascending expert order as transformers' `index_add_` does.
Qwen2-MoE adds a shared expert that every token runs, gated by sigmoid(w . x).

Each expert is an `MLP` of its own `nn.Linear`s, so compress/ quantises experts like any
layer and decodekit's kernels run them; the router and the shared expert's gate are left in
float (compress/apply.py `DEFAULT_SKIP`), as llama.cpp leaves `ffn_gate_inp`. Only the
experts some token chose run: one host read of the choices per layer (the rows to gather),
none for the MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models.linear import apply_linear
from decodekit.models.native_config import NativeConfig


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate x) * up x), gate and up fused; GeGLU with GELU
    (exact, or its tanh approximation: Gemma) in place of SiLU. `width`: the hidden width
    (the config's intermediate_size by default; an expert's own)."""

    def __init__(self, config: NativeConfig, width: int | None = None):
        super().__init__()
        width = width or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * width, bias=config.mlp_bias)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=config.mlp_bias)
        # None: SiLU; else GELU, `approximate` as F.gelu takes it
        self.gelu_form = {"silu": None, "gelu": "none", "gelu_pytorch_tanh": "tanh"}[config.activation]

    def forward(self, x: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        gate, up = apply_linear(self.gate_up_proj, x, rowwise).chunk(2, dim=-1)
        gate = F.silu(gate) if self.gelu_form is None else F.gelu(gate, approximate=self.gelu_form)
        return apply_linear(self.down_proj, gate * up, rowwise)


class MoE(nn.Module):
    """A mixture of `MLP` experts in place of the MLP (module docstring). Parameter names
    are Qwen-MoE's: `gate` the router, `experts.{e}`, `shared_expert`, `shared_expert_gate`."""

    def __init__(self, config: NativeConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.expert_size) for _ in range(config.num_experts))
        self.top_k = config.experts_per_token
        self.normalize = config.normalize_expert_weights
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_size:
            self.shared_expert = MLP(config, config.shared_expert_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of x [N, hidden]'s experts [N, k] and their weights [N, k] in x's dtype."""
        scores = torch.softmax(apply_linear(self.gate, x, rowwise).float(), dim=-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, hidden]
        chosen, weights = self.route(flat, rowwise)
        if flat.shape[0] == 1:  # one token (a decode step): its k experts, no gather
            out = None
            for slot, expert in sorted(enumerate(chosen[0].tolist()), key=lambda pair: pair[1]):
                term = self.experts[expert](flat, rowwise) * weights[:, slot : slot + 1]
                out = term if out is None else out + term
        else:
            # The (token, slot) pairs sorted by expert: each expert runs once on its tokens.
            pairs = chosen.flatten()
            order = torch.argsort(pairs, stable=True)
            counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()  # the host read
            out = torch.zeros_like(flat)
            start = 0
            for expert, count in enumerate(counts):
                if count:
                    picked = order[start : start + count]
                    rows = picked // self.top_k
                    term = self.experts[expert](flat[rows], rowwise) * weights.flatten()[picked, None]
                    out.index_add_(0, rows, term)
                    start += count
        if self.shared_expert is not None:
            gate = torch.sigmoid(apply_linear(self.shared_expert_gate, flat, rowwise))
            out = out + gate * self.shared_expert(flat, rowwise)
        return out.view(x.shape)
