"""What a step would cost on a T4, predicted from bytes and FLOPs at the datasheet's peaks - never a measurement.

The lessons that say "on a GPU a decode step is memory-bound" cite these numbers instead of the slogan: the time to
read every fp16 weight once, the time to read the step's K/V, the time for the weights' multiply-adds, and, for the
framework's share, the launch cost per operator at which launching a step's operators would take as long as reading
its weights. A step takes at least the largest of the first three; launches, Python and attention's arithmetic come
on top (lesson 07 measures them on the device it runs on).
"""

from __future__ import annotations

from dataclasses import dataclass

T4_BYTES_PER_S = 320e9  # a T4's memory bandwidth (datasheet; ../shared/reference/colab-and-triton.md)
T4_FP16_FLOPS = 65e12  # its fp16 tensor-core peak (datasheet)
# What launching one operator may cost a T4's host (an assumed range, not a datasheet figure: a few microseconds per
# kernel launch from eager PyTorch; CUDA graphs and fused kernels - what production engines use - remove most of it).
LAUNCH_COSTS_S = (2e-6, 5e-6, 10e-6)


def t4_step_roofline_s(num_params: int, tokens_fed: int) -> tuple[float, float]:
    """(seconds to read every fp16 weight once, seconds for the weights' multiply-adds: 2 FLOPs per parameter per
    token) for a step feeding ``tokens_fed`` tokens, at a T4's peaks. The step takes at least the larger."""
    return 2 * num_params / T4_BYTES_PER_S, 2 * num_params * tokens_fed / T4_FP16_FLOPS


def compute_bound_from_tokens(dtype_bytes: int = 2) -> float:
    """Tokens per step above which a T4 spends longer on the weights' multiply-adds than on reading them: per token
    a step does 2 FLOPs per parameter and reads each parameter once, so the crossing is at FLOPS / bandwidth x
    bytes per parameter / 2, whatever the model's size (about 200 tokens in fp16)."""
    return T4_FP16_FLOPS / T4_BYTES_PER_S * dtype_bytes / 2


@dataclass(frozen=True)
class T4DecodePrediction:
    """A decode step of ``sequences`` sequences, each attending over ``context`` tokens, on a T4 (seconds)."""

    sequences: int
    context: int
    weights_s: float  # reading every fp16 weight once
    kv_s: float  # reading every sequence's K/V once
    flops_s: float  # the weights' multiply-adds
    operators: float  # operator launches per step (as measured on this device's engine)
    break_even_launch_s: float  # per launch, the launches take as long as reading the weights

    @property
    def bound_s(self) -> float:
        """The least the step can take: reading weights and K/V, or the multiply-adds, whichever is longer."""
        return max(self.weights_s + self.kv_s, self.flops_s)

    def step_s(self, launch_s: float) -> float:
        """The step with its launches: the GPU works while the host launches, so the step takes the longer of its device
        work (the bound above) and ``operators`` launches of ``launch_s`` each, one after another from one host thread."""
        return max(self.bound_s, self.operators * launch_s) if self.operators else self.bound_s

    def tokens_per_s(self, launch_s: float = 0.0) -> float:
        """Output tokens per second of a step of ``sequences`` decodes, with ``launch_s`` per operator launch."""
        return self.sequences / self.step_s(launch_s)

    def text(self) -> str:
        return (
            f"PREDICTED for a T4 (datasheet peaks, not measured): a decode step of {self.sequences} sequence(s) at "
            f"{self.context}-token contexts reads the fp16 weights in {self.weights_s * 1e3:.2f} ms and the K/V in "
            f"{self.kv_s * 1e3:.3f} ms; the weights' multiply-adds take {self.flops_s * 1e3:.3f} ms. Its "
            f"{self.operators:.0f} operator launches take longer than reading the weights if each costs more than "
            f"{self.break_even_launch_s * 1e6:.1f} µs"
        )


def t4_decode(num_params: int, kv_bytes_per_token: int, sequences: int, context: int, operators: float):
    """The :class:`T4DecodePrediction` of one decode step (``kv_bytes_per_token`` of the cache's dtype)."""
    weights_s, flops_s = t4_step_roofline_s(num_params, sequences)
    kv_s = sequences * context * kv_bytes_per_token / T4_BYTES_PER_S
    return T4DecodePrediction(sequences, context, weights_s, kv_s, flops_s, operators, weights_s / max(operators, 1))
