"""A compact OPT forward pass whose keys and values live in a pluggable cache.

This is the seam every lesson plugs its cache into. The model below is Hugging Face's OPT, computed
from the same weight tensors, with one difference: it never stores K/V itself. Each step it calls

    cache.prepare(batch)                      # once, before layer 0: find room for the new tokens
    cache.write(layer, batch, k, v)           # per layer: store the new tokens' keys and values
    out = cache.attend(layer, batch, q, scale)  # per layer: attention over each sequence's tokens
    cache.free(seq_id)                        # when a sequence finishes (in generate_greedy)

A step is a flat ``StepBatch``: whole prompts (prefill) and single tokens (decode) side by side, with no
padding. Tensors inside a step are ``[num_tokens, hidden]`` or ``[num_tokens, heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lesson_utils.cache.seam import KVCache, StepBatch
from lesson_utils.model.common import Linear, PlacedByEmbeddings, check_positions, select_rows
from lesson_utils.model.common import ref as _ref

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (a fairseq padding convention)


class Norm(NamedTuple):
    """A LayerNorm's parameters (``weight``/``bias`` are None for a non-affine norm)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float

    @classmethod
    def from_module(cls, m) -> "Norm":
        return cls(_ref(m.weight), _ref(m.bias), m.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


@dataclass
class OPTLayerWeights:
    """One decoder layer: attention projections, FFN, and their two layer norms."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    out_proj: Linear
    self_attn_layer_norm: Norm
    fc1: Linear
    fc2: Linear
    final_layer_norm: Norm


@dataclass
class OPTWeights(PlacedByEmbeddings):
    """References to a Hugging Face OPT model's tensors (no copies), plus its geometry.

    ``do_layer_norm_before`` is True for OPT-125m and most OPT sizes (pre-LN) and False for OPT-350m
    (post-LN). ``final_layer_norm`` is None for post-LN models; ``project_in``/``project_out`` are None
    unless the embedding width differs from the hidden width (OPT-350m).
    """

    embed_tokens: torch.Tensor  # [vocab, embed_dim]
    embed_positions: torch.Tensor  # [max_positions + POSITION_OFFSET, hidden]
    project_in: Linear | None
    layers: list[OPTLayerWeights]
    final_layer_norm: Norm | None
    project_out: Linear | None
    lm_head: torch.Tensor  # [vocab, embed_dim] (tied to embed_tokens in OPT)
    num_layers: int
    num_heads: int
    head_dim: int
    hidden: int
    vocab_size: int
    max_positions: int
    bos_token_id: int
    eos_token_id: int
    do_layer_norm_before: bool

    @property
    def num_kv_heads(self) -> int:
        """Heads that store K/V: OPT has multi-head attention, so every query head has its own."""
        return self.num_heads

    def forward_step(
        self, batch: StepBatch, cache: KVCache, *, last_only: bool = True, last_n: list[int] | None = None
    ) -> torch.Tensor:
        return forward(self, batch, cache, last_only=last_only, last_n=last_n)

    @classmethod
    def from_hf(cls, model) -> "OPTWeights":
        """Take the weights of an ``OPTForCausalLM`` (they stay shared with it)."""
        cfg, dec = model.config, model.model.decoder
        if cfg.activation_function != "relu":
            raise ValueError(f"this forward implements OPT's ReLU FFN, not {cfg.activation_function!r}")
        layers = [
            OPTLayerWeights(
                q_proj=Linear.from_module(layer.self_attn.q_proj),
                k_proj=Linear.from_module(layer.self_attn.k_proj),
                v_proj=Linear.from_module(layer.self_attn.v_proj),
                out_proj=Linear.from_module(layer.self_attn.out_proj),
                self_attn_layer_norm=Norm.from_module(layer.self_attn_layer_norm),
                fc1=Linear.from_module(layer.fc1),
                fc2=Linear.from_module(layer.fc2),
                final_layer_norm=Norm.from_module(layer.final_layer_norm),
            )
            for layer in dec.layers
        ]
        return cls(
            embed_tokens=_ref(dec.embed_tokens.weight),
            embed_positions=_ref(dec.embed_positions.weight),
            project_in=_optional(Linear, dec.project_in),
            layers=layers,
            final_layer_norm=_optional(Norm, dec.final_layer_norm),
            project_out=_optional(Linear, dec.project_out),
            lm_head=_ref(model.lm_head.weight),
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            head_dim=cfg.hidden_size // cfg.num_attention_heads,
            hidden=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_positions=cfg.max_position_embeddings,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=cfg.eos_token_id,
            do_layer_norm_before=cfg.do_layer_norm_before,
        )


def _optional(kind, module):
    return None if module is None else kind.from_module(module)


def forward(
    w: OPTWeights, batch: StepBatch, cache: KVCache, *, last_only: bool = True, last_n: list[int] | None = None
) -> torch.Tensor:
    """Run one step: write the new tokens' K/V into ``cache`` and return logits.

    Returns ``[num_seqs, vocab]`` - the logits after each sequence's last new token - when
    ``last_only``, else ``[num_tokens, vocab]`` for every new token. ``last_n`` (lesson 11) asks for each
    sequence's last ``last_n[i]`` tokens instead, sequence after sequence: ``[sum(last_n), vocab]``.
    """
    check_positions(w.max_positions, batch)
    with torch.inference_mode():
        h = _embed(w, batch)
        cache.prepare(batch)
        for i, layer in enumerate(w.layers):
            h = _decoder_layer(w, i, layer, h, batch, cache)
        h = select_rows(h, batch, last_only, last_n)
        if w.final_layer_norm is not None:
            h = w.final_layer_norm(h)
        if w.project_out is not None:
            h = w.project_out(h)
        return F.linear(h, w.lm_head)


def _embed(w: OPTWeights, batch: StepBatch) -> torch.Tensor:
    x = F.embedding(batch.input_ids, w.embed_tokens)
    if w.project_in is not None:
        x = w.project_in(x)
    return x + F.embedding(batch.positions + POSITION_OFFSET, w.embed_positions)


def _decoder_layer(w, i, layer: OPTLayerWeights, h, batch, cache) -> torch.Tensor:
    """One OPT layer. Pre-LN: ``h + f(norm(h))``; post-LN: ``norm(h + f(h))`` - as in HF's OPTDecoderLayer."""
    pre = w.do_layer_norm_before
    x = layer.self_attn_layer_norm(h) if pre else h
    h = h + _attention(w, i, layer, x, batch, cache)
    if not pre:
        h = layer.self_attn_layer_norm(h)

    x = layer.final_layer_norm(h) if pre else h
    h = h + layer.fc2(F.relu(layer.fc1(x)))
    if not pre:
        h = layer.final_layer_norm(h)
    return h


def _attention(w, i, layer: OPTLayerWeights, x, batch, cache) -> torch.Tensor:
    """Self-attention through the cache. HF scales q inside the projection; we pass the scale to
    ``attend`` instead (same maths, and it is where a kernel wants it)."""
    shape = (x.shape[0], w.num_heads, w.head_dim)
    q = layer.q_proj(x).view(shape)
    k = layer.k_proj(x).view(shape)
    v = layer.v_proj(x).view(shape)
    cache.write(i, batch, k, v)
    out = cache.attend(i, batch, q, w.head_dim**-0.5)
    return layer.out_proj(out.reshape(x.shape[0], w.hidden))
