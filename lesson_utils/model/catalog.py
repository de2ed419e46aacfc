"""The models the course knows by name: their configs ship with the package, so no lesson needs a download to
know a model's geometry (lesson 00's bytes-per-token table) or to build it with random weights offline.

* :func:`shipped_config` - the Hugging Face config of a named model, from ``configs/*.json``;
* :func:`tiny_config` - the ci profile's and the tests' toy configs of each family (OPT, Llama, Qwen2, Qwen3);
* :func:`random_causal_lm` - a model of a config with random weights, seeded. ``spread=True`` also draws every
  norm weight around 1 and every bias around 0: HF initialises norms to exactly 1 and biases to 0, which would
  hide a norm applied in the wrong place or a bias dropped (a test model must be able to notice both).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
SHIPPED = {
    "facebook/opt-125m": "opt-125m",
    "HuggingFaceTB/SmolLM2-135M": "smollm2-135m",
    "HuggingFaceTB/SmolLM2-360M": "smollm2-360m",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
}


def shipped_fields(name: str) -> dict:
    """The shipped config.json of ``name`` as a dict (``_source`` says where its values come from)."""
    if name not in SHIPPED:
        raise KeyError(f"no config ships for {name!r}; the course ships {', '.join(SHIPPED)}")
    return json.loads((CONFIG_DIR / f"{SHIPPED[name]}.json").read_text())


def shipped_config(name: str):
    """The Hugging Face config object of ``name`` (no download)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in shipped_fields(name).items() if not k.startswith("_")}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def tiny_opt_config():
    """The ``ci`` profile's model: OPT's architecture (pre-LN, ReLU, learned positions) at toy size.

    512 positions leave room for prompts written with the byte tokenizer (one token per byte); the
    vocabulary (320) covers the byte tokenizer's 260 ids. Weights are drawn 10x wider than OPT's default
    (``init_std=0.2``): with the default the toy model's attention is almost uniform and its output hardly
    depends on the context, so K/V written to the wrong block left every output token unchanged
    (``tests/cache/test_model_and_forward.py`` shows that this model notices).
    """
    from transformers import OPTConfig

    return OPTConfig(
        init_std=0.2,
        vocab_size=320,
        hidden_size=64,
        word_embed_proj_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=256,
        max_position_embeddings=512,
        do_layer_norm_before=True,
    )


def opt125m_config():
    """OPT-125m's geometry: ``OPTConfig()``'s defaults (12 layers, 768 hidden, 12 heads, 50272 tokens,
    2048 positions)."""
    from transformers import OPTConfig

    return OPTConfig()


def tiny_config(
    model_type: str = "llama",
    *,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    layers: int = 2,
    vocab_size: int = 320,
    max_positions: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    **fields,
):
    """A toy config of a family (:mod:`~lesson_utils.model.families`): 2 layers, 320 ids (the byte tokenizer's 260
    fit), weights drawn 10x wider than HF's default (``initializer_range=0.2``) so attention is far from uniform and a
    wrong K/V changes the tokens. The family's own ``tiny`` fields apply on top (a field set to None is left out);
    ``fields`` last."""
    from transformers import AutoConfig

    from lesson_utils.model.families import family

    fam = family(model_type)
    if fam.forward == "opt":
        return tiny_opt_config()
    config = dict(
        vocab_size=vocab_size,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=1,
        rope_theta=10000.0,
    )
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    config.update(fam.tiny)
    config.update(fields)
    return AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if v is not None})


def random_causal_lm(config, seed: int = 0, *, spread: bool = False):
    """A causal LM of ``config`` with seeded random weights, in eval mode (see the module docstring for ``spread``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if spread:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
                elif name.endswith("bias"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model
