"""One entry point for every model the course serves: ``weights_from_hf(model)`` and the step ``forward``.

``weights_from_hf`` turns a Hugging Face causal LM - OPT, Llama, Qwen2 or Qwen3 - into the weights object that
``Engine``, ``ModelRunner`` and every cache's ``for_model`` take. The caches and the scheduler read only its
geometry (:class:`ModelWeights`); the model's name is known here and nowhere below the seam.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lesson_utils.cache.seam import KVCache, StepBatch
from lesson_utils.model.config_check import check_config
from lesson_utils.model.families import family


class ModelWeights(Protocol):
    """What the engine, the runner and the caches read of a model (``OPTWeights`` and ``LlamaWeights`` both are one)."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    layers: list
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
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward_step(
        self, batch: StepBatch, cache: KVCache, *, last_only: bool = True, last_n: list[int] | None = None
    ) -> torch.Tensor: ...


def weights_from_hf(model) -> ModelWeights:
    """The course's weights for a Hugging Face ``OPTForCausalLM``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
    ``Qwen3ForCausalLM`` (references to its tensors: nothing is copied). An unsupported config is refused with a
    ValueError naming the field and its value."""
    check_config(model.config)
    if family(model.config.model_type).forward == "opt":
        from lesson_utils.model.opt_forward import OPTWeights

        return OPTWeights.from_hf(model)
    from lesson_utils.model.llama_forward import LlamaWeights

    return LlamaWeights.from_hf(model)


def forward(
    w: ModelWeights, batch: StepBatch, cache: KVCache, *, last_only: bool = True, last_n: list[int] | None = None
) -> torch.Tensor:
    """One step of whichever model ``w`` is (see ``opt_forward.forward`` for the contract)."""
    return w.forward_step(batch, cache, last_only=last_only, last_n=last_n)
