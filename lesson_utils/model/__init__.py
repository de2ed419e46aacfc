"""The models the course serves, behind one seam: ``weights_from_hf(model)`` for OPT, Llama, Qwen2 and Qwen3."""

from lesson_utils.model.weights import ModelWeights, forward, weights_from_hf

__all__ = ["ModelWeights", "forward", "weights_from_hf"]
