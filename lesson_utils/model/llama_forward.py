"""The Llama architecture behind the same cache seam as OPT: RMSNorm, RoPE, a SwiGLU MLP, grouped-query attention.

Qwen2 and Qwen3 are the same code with one difference each, chosen from the Hugging Face config's ``model_type``:

* ``llama``: no biases (unless ``attention_bias`` / ``mlp_bias``), RoPE with ``rope_theta`` and optional
  Llama 3 scaling;
* ``qwen2``: biases on the q, k and v projections;
* ``qwen3``: an RMSNorm over each head of q and of k (``q_norm``/``k_norm``), before RoPE.

Grouped-query attention (GQA): ``num_heads`` query heads share ``num_kv_heads`` key/value heads, query head
``h`` reading KV head ``h // (num_heads // num_kv_heads)``. Only the KV heads are written to the cache, so a cache
made ``for_model`` holds ``num_kv_heads`` heads per token - the whole point of GQA for serving.

Per step (the seam of ``opt_forward``)::

    cache.prepare(batch)
    per layer: q, k, v = projections; rotate q and k by their positions; cache.write(layer, batch, k, v);
               out = cache.attend(layer, batch, q, head_dim ** -0.5)

The keys are written *rotated*: the cache never needs to know a token's position again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lesson_utils.cache.seam import KVCache, StepBatch
from lesson_utils.model.common import Linear, PlacedByEmbeddings, check_positions, ref, select_rows
from lesson_utils.model.config_check import check_config
from lesson_utils.model.families import FAMILIES, family
from lesson_utils.model.rope import Rope, apply_rope


@dataclass
class RMSNorm:
    """``weight * x / sqrt(mean(x**2) + eps)``, the mean over the last axis, computed in fp32 as HF does."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def from_module(cls, m) -> "RMSNorm":
        return cls(ref(m.weight), m.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class LlamaLayerWeights:
    """One decoder layer. ``q_norm``/``k_norm`` are Qwen3's per-head norms (None for Llama and Qwen2)."""

    input_layernorm: RMSNorm
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    post_attention_layernorm: RMSNorm
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


@dataclass
class LlamaWeights(PlacedByEmbeddings):
    """References to a Hugging Face Llama, Qwen2 or Qwen3 causal LM's tensors (no copies), plus its geometry.

    The geometry fields are the ones every cache's ``for_model`` and the engine read (the same names as
    ``OPTWeights``): a cache holds ``num_kv_heads`` heads of ``head_dim`` per token and layer.
    """

    family: str  # its model_type: "llama", "qwen2", "qwen3" (lesson_utils.model.families)
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LlamaLayerWeights]
    norm: RMSNorm
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed_tokens when the embeddings are tied
    rope: Rope
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab_size: int
    max_positions: int
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def group(self) -> int:
        """Query heads per KV head (1: multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, model) -> "LlamaWeights":
        """Take the weights of a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (shared with it).
        The config is checked first (``config_check.check_config``): an unsupported one is refused, naming the field."""
        cfg = model.config
        geometry = check_config(cfg)
        fam = family(cfg.model_type)
        if fam.forward != "llama":
            llama_like = [f.model_type for f in FAMILIES.values() if f.forward == "llama"]
            raise ValueError(f"model_type {cfg.model_type!r} is not a Llama-family model ({', '.join(llama_like)})")
        qk_norm = fam.qk_norm
        layers = [
            LlamaLayerWeights(
                input_layernorm=RMSNorm.from_module(layer.input_layernorm),
                q_proj=Linear.from_module(layer.self_attn.q_proj),
                k_proj=Linear.from_module(layer.self_attn.k_proj),
                v_proj=Linear.from_module(layer.self_attn.v_proj),
                o_proj=Linear.from_module(layer.self_attn.o_proj),
                q_norm=RMSNorm.from_module(layer.self_attn.q_norm) if qk_norm else None,
                k_norm=RMSNorm.from_module(layer.self_attn.k_norm) if qk_norm else None,
                post_attention_layernorm=RMSNorm.from_module(layer.post_attention_layernorm),
                gate_proj=Linear.from_module(layer.mlp.gate_proj),
                up_proj=Linear.from_module(layer.mlp.up_proj),
                down_proj=Linear.from_module(layer.mlp.down_proj),
            )
            for layer in model.model.layers
        ]
        embed = ref(model.model.embed_tokens.weight)
        return cls(
            family=cfg.model_type,
            embed_tokens=embed,
            layers=layers,
            norm=RMSNorm.from_module(model.model.norm),
            lm_head=ref(model.lm_head.weight),
            rope=Rope.for_config(cfg, geometry.head_dim, embed.device),
            num_layers=cfg.num_hidden_layers,
            num_heads=geometry.num_heads,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            hidden=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_positions=cfg.max_position_embeddings,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=_first(cfg.eos_token_id),
        )

    def forward_step(
        self, batch: StepBatch, cache: KVCache, *, last_only: bool = True, last_n: list[int] | None = None
    ) -> torch.Tensor:
        return forward(self, batch, cache, last_only=last_only, last_n=last_n)


def _first(token_id):
    """A config may list several eos ids (Llama 3 instruct); greedy decoding here stops on the first."""
    return token_id[0] if isinstance(token_id, (list, tuple)) else token_id


def forward(
    w: LlamaWeights, batch: StepBatch, cache: KVCache, *, last_only: bool = True, last_n: list[int] | None = None
) -> torch.Tensor:
    """One step: write the new tokens' (rotated) K/V into ``cache`` and return logits - the same contract as
    ``opt_forward.forward``: ``[num_seqs, vocab]`` when ``last_only``, every token's otherwise, or each sequence's
    last ``last_n[i]`` rows."""
    check_positions(w.max_positions, batch)
    with torch.inference_mode():
        h = F.embedding(batch.input_ids, w.embed_tokens)
        cos, sin = w.rope.cos_sin(batch.positions, h.dtype)  # once per step, shared by every layer
        cache.prepare(batch)
        for i, layer in enumerate(w.layers):
            h = h + _attention(w, i, layer, layer.input_layernorm(h), batch, cache, cos, sin)
            x = layer.post_attention_layernorm(h)
            h = h + layer.down_proj(F.silu(layer.gate_proj(x)) * layer.up_proj(x))
        h = select_rows(h, batch, last_only, last_n)
        return F.linear(w.norm(h), w.lm_head)


def _attention(w: LlamaWeights, i: int, layer: LlamaLayerWeights, x, batch, cache, cos, sin) -> torch.Tensor:
    n = x.shape[0]
    q = layer.q_proj(x).view(n, w.num_heads, w.head_dim)
    k = layer.k_proj(x).view(n, w.num_kv_heads, w.head_dim)
    v = layer.v_proj(x).view(n, w.num_kv_heads, w.head_dim)
    if layer.q_norm is not None:  # Qwen3: each head normalised on its own, before the rotation
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(i, batch, k, v)
    out = cache.attend(i, batch, q, w.head_dim**-0.5)
    return layer.o_proj(out.reshape(n, w.num_heads * w.head_dim))
