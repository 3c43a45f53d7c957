"""`NativeLM`: decodekit's own forward for Llama-family checkpoints (issue 4, item 1).

Reads a Hugging Face checkpoint directory (config.json, model.safetensors or sharded
safetensors with an index, tokenizer files) of Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3,
Gemma 1, 2 or 3, OLMo 2 (norms after each sublayer instead of before; q/k norms over the
whole projection, OLMoE's too), or the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and
OLMoE (feedforward.py `MoE` in place of the MLP): pre-norm decoder blocks with RMSNorm,
grouped-query attention with RoPE (rope.py; partial rotation for Phi-4-mini, a second base
for Gemma 3's sliding layers), SwiGLU or GeGLU MLP, optional q/k/v(/o) biases (Qwen2, Llama
`attention_bias`), per-head q/k RMSNorm (Qwen3, Gemma 3), tied or separate output
embeddings; Gemma's differences (families.py): the norms' (1 + w), a scaled embedding,
sandwich norms, scaled queries, capped logits, and Gemma 2's capped attention scores
(models/attention.py `softcap`).

Design (STYLE.md; gpt-fast and nano-vllm do the same): q/k/v and gate/up are each one
fused `nn.Linear` (fewer, larger matmuls; compress/ swaps any `nn.Linear` in `model.net`);
cos/sin tables are precomputed; one attention mask per forward (per sliding window) is
shared by the layers; a single unpadded row decodes with no mask at all. Attention
itself is the cache's `attend`, which stores the keys and values and calls
models/attention.py (one decode, one prefill, one batch-invariant function for every cache).

Sliding-window attention (Mistral, Phi-3; Qwen2/3 and Gemma 3 layers marked
"sliding_attention"): a query at position p sees the keys at positions p - window + 1 .. p, as
transformers' `sliding_window_overlay`. The cache keeps every position; the mask hides the old ones.
The context is `max_position_embeddings`, times the RoPE factor for linear and dynamic
scaling (transformers' docs: with these, max_position_embeddings is *not* raised to the
new length); a forward past it raises ValueError.

`batch_invariant` (off by default): every linear layer runs one token at a time and
every query attends alone over exactly the keys it sees (`rowwise_linear`,
`attention.attend_alone`), so a token's arithmetic -- and its logits, bit for bit -- never
depend on which other tokens share the forward, how a prompt was split into steps, or
whether its prefix came from the cache. BLAS picks another kernel for one row than for
several, and the two round differently (~1e-5 in the logits); vLLM's batch-invariant
kernels fix the reduction order for the same reason. Its cost: `python -m
decodekit.bench.batch_invariant` (docs/ARCHITECTURE.md quotes a run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decodekit.models import kernels
from decodekit.models.base import Cache, LanguageModel
from decodekit.models.checkpoint import eos_token_ids, load_safetensors, load_tokenizer, read_config
from decodekit.models.contiguous_kv import ContiguousKVCache, attention_mask
from decodekit.models.feedforward import MLP, MoE
from decodekit.models.hugepages import on_huge_pages
from decodekit.models.linear import apply_linear
from decodekit.models.native_config import NativeConfig, unsupported_reason
from decodekit.models.rope import RotaryTables, apply_rope


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 (Zhang & Sennrich 2019; as transformers)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # one nn.Module attribute lookup, not three (~10 calls a token)
        if x.dtype == torch.float32:  # skip two no-op casts per call on the decode path
            if weight.dtype == torch.float32 and x.is_cpu and kernels.eager_op(x, weight):
                return torch.ops.decodekit.rms_norm(x, weight, self.eps)  # one op (csrc/norm.cpp)
            return weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        if weight.dtype == torch.float32:  # a shifted norm's (1 + w), kept float32: Gemma's form,
            # normalised and scaled in float32, rounded once (transformers' Gemma3RMSNorm)
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * weight).to(x.dtype)
        # normalised in float32 and rounded once to x's dtype inside rms_norm (its CPU form
        # upcasts; CUDA's fused kernel accumulates in float32): no cast kernels of our own
        return weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class Attention(nn.Module):
    def __init__(self, config: NativeConfig, local: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.output_bias
        )
        # per head (Qwen3, Gemma 3), or over the whole projection (OLMo 2, OLMoE: `full_norms`)
        q_dim, k_dim = config.head_dim, config.head_dim
        if config.qk_norm_full:
            q_dim, k_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps) if config.qk_norm else None
        self.full_norms = config.qk_norm_full
        # the rotary tables' columns this layer reads: a sliding layer's own RoPE (Gemma 3;
        # rope.py `RotaryTables`), or all of them
        dim = config.head_dim
        self.table_columns = None
        if config.local_rope is not None:
            self.table_columns = slice(dim, 2 * dim) if local else slice(0, dim)
        # partial rotary (Phi-4-mini): the first `rotated` dims of a head turn, the rest pass
        self.rotated = config.rope.head_dim if config.rope.head_dim < dim else None
        self.query_scale = config.query_scale
        self.softcap = config.attn_softcap  # Gemma 2's cap of the scores (models/attention.py)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] rotated by its positions, the first `rotated` dims only if so."""
        if self.rotated is None:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., : self.rotated], cos, sin), x[..., self.rotated :]], dim=-1)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B or 1, T, 1, D]
        sin: torch.Tensor,
        cache: ContiguousKVCache,  # or anything with ContiguousKVCache.attend's signature
        layer: int,
        mask: torch.Tensor | None,  # [B or 1, 1, T, S]
        causal: bool,
        rowwise: bool = False,  # batch-invariant mode (module docstring)
    ) -> torch.Tensor:
        batch, num_new, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.table_columns is not None:
            cos, sin = cos[..., self.table_columns], sin[..., self.table_columns]
        qkv = apply_linear(self.qkv_proj, x, rowwise)
        if self.full_norms:  # q and k normed whole, then split into heads
            q_width, k_width = heads * self.head_dim, kv_heads * self.head_dim
            q = self.q_norm(qkv[..., :q_width]).view(batch, num_new, heads, self.head_dim)
            k = self.k_norm(qkv[..., q_width : q_width + k_width])
            k = k.view(batch, num_new, kv_heads, self.head_dim)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            v = qkv[..., q_width + k_width :].view(batch, num_new, kv_heads, self.head_dim)
            return self._attend(q, k, v, cache, layer, mask, causal, rowwise)
        qkv = qkv.view(batch, num_new, heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is None:
            # One RoPE call over the query and key heads together.
            qk = self.rotate(qkv[:, :, : heads + kv_heads], cos, sin)
            q, k = qk.split([heads, kv_heads], dim=2)
        else:
            q = self.rotate(self.q_norm(qkv[:, :, :heads]), cos, sin)
            k = self.rotate(self.k_norm(qkv[:, :, heads : heads + kv_heads]), cos, sin)
        v = qkv[:, :, heads + kv_heads :]
        return self._attend(q, k, v, cache, layer, mask, causal, rowwise)

    def _attend(self, q, k, v, cache, layer, mask, causal, rowwise) -> torch.Tensor:
        """The rotated q [B, T, H, D], k and v attended over the cache, through o_proj."""
        batch, num_new = q.shape[:2]
        if self.query_scale is not None:  # scores scaled by query_pre_attn_scalar ** -0.5 (Gemma)
            q = q * self.query_scale
        # The cache stores k/v and attends: ContiguousKVCache here, the engine's paged
        # batch (engine/batch.py) there; the layer maths stay in this one module.
        out = cache.attend(layer, q, k, v, mask, causal, rowwise, self.softcap)  # [B, T, H, D]
        return apply_linear(self.o_proj, out.reshape(batch, num_new, self.num_heads * self.head_dim), rowwise)


class Block(nn.Module):
    """Pre-norm: x + attn(norm x), then x + mlp(norm x). With sandwich norms (Gemma 2/3) each
    output is normed too before its add: `post_attention_layernorm` norms the attention's
    output there, `pre_feedforward_layernorm` the MLP's input (transformers' names)."""

    def __init__(self, config: NativeConfig, local: bool = False, experts: bool = False):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.post_norms = config.post_norms  # OLMo 2: no input norms, outputs normed (forward)
        if not config.post_norms:
            self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(config, local)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = MoE(config) if experts else MLP(config)  # models/feedforward.py
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        if config.sandwich_norms or config.post_norms:
            self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.sandwich = config.sandwich_norms

    def forward(self, x, cos, sin, cache, layer, mask, causal, rowwise=False):
        if self.post_norms:  # OLMo 2: x + norm(attn(x)), then x + norm(mlp(x))
            attended = self.self_attn(x, cos, sin, cache, layer, mask, causal, rowwise)
            x = x + self.post_attention_layernorm(attended)
            return x + self.post_feedforward_layernorm(self.mlp(x, rowwise))
        normed = self.input_layernorm(x)
        attended = self.self_attn(normed, cos, sin, cache, layer, mask, causal, rowwise)
        if not self.sandwich:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x), rowwise)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), rowwise))


class LlamaNet(nn.Module):
    """The weights: parameter names are the checkpoint's, minus `model.`, with q/k/v and
    gate/up fused (see `fuse_checkpoint`)."""

    def __init__(self, config: NativeConfig):
        super().__init__()
        # nn.Embedding's own initialisation draws normal_ values, which on the meta device (where
        # from_state_dict builds the net) go through torch._refs and import torch._dynamo: 0.3 s
        # of every start (issue 26). The same draw, made only where the weight is real:
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        windows = config.layer_windows or (None,) * config.num_layers
        self.layers = nn.ModuleList(Block(config, local=window is not None, experts=experts)
                                    for window, experts in zip(windows, config.moe_layers, strict=True))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Gemma's embedding scale rounded to each dtype the activations may have, as transformers
        scale = config.embed_scale
        self.embed_scales = None if scale is None else {
            dtype: float(torch.tensor(scale, device="cpu").to(dtype))
            for dtype in (torch.float32, torch.bfloat16, torch.float16)}  # fmt: skip
        self.final_softcap = config.final_softcap

    def forward(self, tokens, cos, sin, cache, masks, keep=None, rowwise=False, states=False):
        """Logits [B, T, V]; with `keep` (a [K] index) only those positions', [B, K, V].

        masks: each layer's (attention mask, causal) for `cache.attend`; rowwise: the
        batch-invariant mode (module docstring); states: also return the final hidden
        states the LM head read, (logits, states [B, T or K, hidden] float32).
        """
        x = self.trunk(tokens, cos, sin, cache, masks, rowwise)
        if keep is not None:
            x = x[:, keep]  # the engine needs logits at each sequence's last token only
        normed = self.norm(x)
        logits = apply_linear(self.lm_head, normed, rowwise).float()  # [B, T or K, V]
        if self.final_softcap is not None:  # Gemma 2/3: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return (logits, normed.float()) if states else logits

    def trunk(self, tokens, cos, sin, cache, masks, rowwise=False) -> torch.Tensor:
        """The last layer's output [B, T, hidden], before the final norm."""
        x = self.embed_tokens(tokens)  # [B, T, hidden]
        if self.embed_scales is not None:  # Gemma: times sqrt(hidden) rounded to the model's dtype
            x = x * self.embed_scales[x.dtype]
        for index, (block, (mask, causal)) in enumerate(zip(self.layers, masks, strict=True)):
            x = block(x, cos, sin, cache, index, mask, causal, rowwise)
        return x


def fuse_checkpoint(
    state: dict[str, torch.Tensor], config: NativeConfig
) -> dict[str, torch.Tensor]:
    """Rename a transformers state dict to LlamaNet's: drop `model.`, concatenate q/k/v and
    gate/up along the output dimension, drop the output head when it is tied, and shift the
    RMSNorm weights by the family's `norm_shift` (Gemma's (1 + weight), as llama.cpp's
    converter stores it: added in float32, the sum transformers' forward computes)."""
    out = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    out = {name: t for name, t in out.items() if not name.endswith("rotary_emb.inv_freq")}
    if config.num_experts:  # Mixtral's names -> Qwen-MoE's, which `MoE` keeps
        out = {mixtral_to_qwen(name): t for name, t in out.items()}
        # a transformers model's own state dict holds each layer's experts as [E, out, in]
        for name in [n for n in out if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            stacked = out.pop(name)
            for expert in range(stacked.shape[0]):
                out[name.replace("experts.", f"experts.{expert}.") + ".weight"] = stacked[expert]
    # q/k/v -> qkv_proj, gate/up -> gate_up_proj: the MLPs', the experts' and a shared expert's
    fused = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
    for target, parts in fused:
        for name in [n for n in out if n.endswith((f".{parts[0]}.weight", f".{parts[0]}.bias"))]:
            parent, _, suffix = name.rsplit(".", 2)
            names = [f"{parent}.{part}.{suffix}" for part in parts]
            if all(n in out for n in names):
                out[f"{parent}.{target}.{suffix}"] = torch.cat([out.pop(n) for n in names])
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    if config.norm_shift:
        out = {name: t.float() + config.norm_shift if name.endswith("norm.weight") else t
               for name, t in out.items()}  # fmt: skip
    return out


_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mixtral_to_qwen(name: str) -> str:
    """layers.0.block_sparse_moe.experts.3.w1.weight -> layers.0.mlp.experts.3.gate_proj.weight"""
    if ".block_sparse_moe." not in name:
        return name
    return ".".join(_MIXTRAL_NAMES.get(part, part) for part in name.split("."))


def transpose_weight_layout(net: nn.Module) -> None:
    """Store each Linear weight [out, in] as the transpose of a contiguous [in, out] tensor.

    Same values and shapes; `F.linear` then computes x @ W_t with no copy, which the CPU
    BLAS runs about 1.8x faster than x @ W.t() at batch 1 (a GEMV over the weights; measured
    on the dev machine for this model's shapes, BENCHMARKS.md "Fast engine"). A tied output
    head moves the embedding with it: a lookup then reads a strided row, which is cheap.
    Float32 weights only: bfloat16 and float16 ones stay row-major, the layout their
    one-row path (`one_row_gemv`) reads fastest. The copies go on huge pages (hugepages.py).
    """
    for module in net.modules():
        float32 = isinstance(module, nn.Linear) and module.weight.dtype == torch.float32
        if float32 and module.weight.is_contiguous():
            weight = module.weight
            layout = on_huge_pages(weight.detach().t()).t()  # [in, out] contiguous
            module.weight = nn.Parameter(layout, requires_grad=weight.requires_grad)
            if isinstance(net, LlamaNet) and weight is getattr(net.embed_tokens, "weight", None):
                net.embed_tokens.weight = module.weight  # keep the tie
    net.register_state_dict_post_hook(_contiguous_state)


def embedding_dtype_device(embedding: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The model's dtype and device, from its embedding: an nn.Embedding's weight, or the own
    of a lookup over another tensor (qlinear.py `QuantizedEmbedding`, half_linear.py
    `HalfEmbedding`)."""
    if isinstance(embedding, nn.Embedding):
        return embedding.weight.dtype, embedding.weight.device
    return embedding.dtype, embedding.device


def _contiguous_state(module, state_dict, prefix, local_metadata) -> None:
    """A state dict of row-major tensors (safetensors requires them); tied weights stay one."""
    copies: dict[tuple, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.startswith(prefix) and not tensor.is_contiguous():
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            state_dict[name] = copies.setdefault(key, tensor.contiguous())


class NativeLM(LanguageModel):
    """A Llama-family model run by decodekit's own forward. `net` holds the weights."""

    supports_paged_kv = True  # its layers attend over the engine's KV blocks (engine/batch.py)

    def __init__(
        self,
        net: LlamaNet,
        config: NativeConfig,
        name: str = "native",
        tokenizer: Any | None = None,
        eos_token_ids: tuple[int, ...] = (),
        batch_invariant: bool = False,
    ):
        self.net = net.eval()
        self.config = config
        self.name = name
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = config.vocab_size
        self.max_context = config.context_length
        # Read by each forward and by each Engine when it is built (module docstring).
        self.batch_invariant = batch_invariant
        self.dtype, self.device = embedding_dtype_device(net.embed_tokens)
        self.rope = RotaryTables(config.rope, self.dtype, device=self.device, local=config.local_rope)

    def to(self, device: str | torch.device) -> NativeLM:
        """Move the weights (and so the activations, KV caches and logits of every later
        forward) to `device`, in place; returns the model. Strides are kept, so the
        transposed weight layout (`transpose_weight_layout`) and tied weights survive."""
        device = torch.device(device)
        self.net.to(device)
        self.device = embedding_dtype_device(self.net.embed_tokens)[1]
        config = self.config
        self.rope = RotaryTables(config.rope, self.dtype, device=self.device, local=config.local_rope)
        return self

    @staticmethod
    def supports(config: dict[str, Any]) -> bool:
        """Whether a config.json dict describes a model NativeLM can run."""
        return unsupported_reason(config) is None

    @classmethod
    def from_state_dict(
        cls,
        config: dict[str, Any],
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> NativeLM:
        """Build from a config.json dict and a transformers-named state dict."""
        parsed = NativeConfig.from_dict(config, tie_default="lm_head.weight" not in state)
        with torch.device("meta"):
            net = LlamaNet(parsed)  # no random initialisation: every weight is assigned below
        # Copy every tensor taken as is from `state`: `.to` of a tensor already in `dtype`
        # returns it, and a safetensors tensor is a view into the memory-mapped file, whose
        # pages then stay resident (the whole file: issue 15 measured 2.1x the weights' bytes).
        given = {id(t) for t in state.values()}
        # A shifted norm's weight (1 + w) stays float32 in a half model: rounded to bfloat16 the
        # sum would lose w's low bits (1.01 -> 1.0078), which transformers keeps (`RMSNorm`).
        def kept(name: str) -> torch.dtype:
            return torch.float32 if parsed.norm_shift and name.endswith("norm.weight") else dtype

        weights = {name: t.to(kept(name), copy=id(t) in given)
                   for name, t in fuse_checkpoint(state, parsed).items()}  # fmt: skip
        if parsed.tie_word_embeddings:
            weights["lm_head.weight"] = weights["embed_tokens.weight"]
        net.load_state_dict(weights, strict=True, assign=True)
        if parsed.tie_word_embeddings:
            net.lm_head.weight = net.embed_tokens.weight
        transpose_weight_layout(net)
        return cls(net, parsed, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        name: str | None = None,
        batch_invariant: bool = False,
        device: str | torch.device = "cpu",
    ) -> NativeLM:
        """Read a checkpoint directory into `dtype` weights on `device` (read on the CPU,
        then moved)."""
        path = Path(path)
        config = read_config(path)
        tokenizer = load_tokenizer(path)
        return cls.from_state_dict(
            config,
            load_safetensors(path),
            dtype,
            name=name or path.name,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids(path, config, tokenizer),
            batch_invariant=batch_invariant,
        ).to(device)

    def new_cache(self, batch_size: int) -> ContiguousKVCache:
        config = self.config
        return ContiguousKVCache(
            config.num_layers, batch_size, config.num_kv_heads, config.head_dim, self.dtype,
            device=self.device,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, cache: Cache, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V] float32 of tokens [B, T]; `mask` [B, T] marks real tokens. Inputs
        on another device (the CPU, where samplers make tokens) are moved to the model's;
        the logits stay on the model's device."""
        return self.net(*self._layer_inputs(tokens, cache, mask), rowwise=self.batch_invariant)

    def hidden_states(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's state after the final norm (what the LM head reads), [B, T, hidden]
        float32, at every position of tokens [B, T], on a fresh cache."""
        # Cloned outside inference mode: the states are inputs of trained heads (align/qvalue.py).
        return self._final_states(tokens, mask).clone()

    @torch.inference_mode()
    def _final_states(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        cache = self.new_cache(tokens.shape[0])
        x = self.net.trunk(*self._layer_inputs(tokens, cache, mask), rowwise=self.batch_invariant)
        return self.net.norm(x).float()

    def _layer_inputs(self, tokens: torch.Tensor, cache: Cache, mask: torch.Tensor | None) -> tuple:
        """(tokens, cos, sin, cache, masks) for `LlamaNet`: inputs checked and moved to the
        model's device, rotary tables at each token's position, each layer's attention mask;
        the cache grows by T."""
        _check_inputs(tokens, cache, mask, self.vocab_size)
        assert isinstance(cache, ContiguousKVCache)
        tokens = tokens.to(self.device, non_blocking=True)
        mask = mask if mask is None else mask.to(self.device, non_blocking=True)
        num_new = tokens.shape[1]
        if mask is not None and bool(mask.all()):
            mask = None
        start = cache.length
        if mask is None and not cache.has_padding:
            # Every row is at position `start`: slice the tables, no gather.
            self.check_positions(start + num_new)
            cos, sin = self.rope.tables(start + num_new)
            cos, sin = cos[start : start + num_new, None], sin[start : start + num_new, None]
        else:
            real = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
            # Padding never advances a row's position: position = real tokens before it.
            positions = cache.next_position[:, None] + real.long().cumsum(dim=1) - 1  # [B, T]
            positions = positions.clamp(min=0)
            self.check_positions(int(positions.max()) + 1)
            lengths = positions.max(dim=1, keepdim=True).values.expand_as(positions) + 1  # each row's own
            cos, sin = self.rope.at(positions, lengths)
            cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, D]
        cache.append(mask, num_new)
        rowwise = self.batch_invariant
        by_window = {w: attention_mask(cache, num_new, w, explicit=rowwise)
                     for w in set(self.layer_windows())}  # fmt: skip
        masks = [(by_window[w], by_window[w] is None and num_new > 1) for w in self.layer_windows()]
        return tokens, cos, sin, cache, masks

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for full attention."""
        return self.config.layer_windows or (None,) * self.config.num_layers

    def check_positions(self, num_positions: int) -> None:
        """ValueError unless positions 0 .. num_positions - 1 fit the model's context."""
        if num_positions > self.max_context:
            c = self.config
            scaled = (f", times the {c.rope.kind} RoPE factor {c.rope.factor:g}"
                      if self.max_context != c.max_positions else "")  # fmt: skip
            raise ValueError(
                f"position {num_positions - 1} is past the model's context of "
                f"{self.max_context} positions (max_position_embeddings={c.max_positions}"
                f"{scaled})"
            )


def _check_inputs(tokens, cache, mask, vocab_size: int) -> None:
    if not isinstance(cache, ContiguousKVCache):
        raise TypeError(f"cache must come from NativeLM.new_cache, got {type(cache).__name__}")
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.shape[1] == 0:
        raise ValueError(
            "tokens must be a [B, T] long tensor with T >= 1, "
            f"got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if tokens.shape[0] != cache.batch_size:
        raise ValueError(f"tokens have {tokens.shape[0]} rows but the cache has {cache.batch_size}")
    if mask is not None and (mask.shape != tokens.shape or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(tokens.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    low, high = (int(v) for v in torch.aminmax(tokens))
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got ids in [{low}, {high}]")
